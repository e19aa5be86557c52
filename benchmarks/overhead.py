"""What tracking costs: time per torch call, step time, prune time, bytes per node.

Four jobs (``kind="overhead"``, ``part=...``), each in its own fresh process, torch on
one thread, every comparison plain vs ``graphprune.track()`` in that one process:

* ``chain``       -- a chain of ``n`` ``h = torch.mul(h, c)`` on 16 floats (``c`` a
  constant, ``h`` starting at a leaf that requires grad): one forward, and the steady
  state (three forwards in a row, each after the previous graph was freed, the frees
  inside the timed window).  Plain and tracked alternate round by round (order
  flipped each round, one warm-up round); the overhead per torch call is the median
  over rounds of (tracked - plain) / calls, paired within a round.
* ``transformer`` -- a trunk of 4 ``TransformerEncoderLayer(128, 4, 256)`` and two heads
  of one layer each on 8 x 64 tokens.  Plain step: forward, ``l1.backward(retain_graph=
  True)``, ``l2.backward()``; graphprune step: the forward under ``track()``, the same
  backwards with ``prune_after(l1, keep=x)`` between them; floor step: the forward under
  the chain's floor (a no-op mode, a detaching pack hook), ``scaling.floor_walk`` in place
  of the prune.  Each step ends by dropping its tensors (timed, in all).  Steps rotate
  until a time budget is spent; ratios are paired medians, prune_after's share is the
  median of prune / its ``l1`` backward.
* ``transformer_cuda`` -- with ``--device cuda`` only: the transformer steps on the GPU,
  every timer read after ``torch.cuda.synchronize()`` (the kernels a step launched are
  in its time), reported in rows marked so.
* ``memory``      -- a chain of ``n`` muls under ``tracemalloc``: traced Python memory
  held after a tracked forward minus after an identical plain one, per node.  Only
  Python allocations are traced; the tensors are the same in both and cancel out.
* ``heads``       -- a trunk of ``sin`` on 64 floats and heads built on it one by one,
  each backpropagated and pruned with ``keep=x``: what each prune costs (the first
  walks the trunk, later ones their head: ``run_heads``).  No target.

The counts (torch calls a ``TorchFunctionMode`` sees, autograd nodes, saved tensors)
come from an extra untimed plain forward.  The prune_after / explain cost per node
comes from the scaling jobs (``scaling.py``, shape ``chain``).  ``python -m
benchmarks.overhead [--quick|--tiny]`` runs these jobs alone and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
import tracemalloc

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import graphprune as gp

from .scaling import bound_key, floor_walk

PARTS = ("chain", "transformer", "memory", "heads")
CUDA_PARTS = ("transformer_cuda",)  # with --device cuda, besides PARTS (which stay on the CPU)
# the targets (reported, never asserted)
CALL_US, STEADY_US = 4.0, 5.0  # µs per torch call over plain: one forward, steady state
FWD_X, STEP_X, PRUNE_SHARE = 1.15, 1.05, 0.04  # transformer: forward, step, prune / backward
NODE_BYTES = 150  # traced bytes per tracked node
SCALING_US = {1000: 4.0, 10000: 4.0, 100000: 8.0}  # prune_after / explain µs per node

SIZES = {
    "full": dict(chain=20000, chain_rounds=9, d=128, heads=4, ff=256, batch=8, seq=64,
                 steps=300, budget_s=40.0, memory=100000, trunk=10000, trunk_heads=8, head_rounds=5),
    "quick": dict(chain=10000, chain_rounds=3, d=128, heads=4, ff=256, batch=8, seq=64,
                  steps=60, budget_s=6.0, memory=20000, trunk=4000, trunk_heads=8, head_rounds=2),
    "tiny": dict(chain=300, chain_rounds=1, d=32, heads=4, ff=64, batch=2, seq=8,
                 steps=3, budget_s=1.0, memory=2000, trunk=300, trunk_heads=4, head_rounds=1),
}


def jobs(level: str, device: str = "cpu") -> list[dict]:
    """The overhead jobs of a suite level, one per part, and on ``device="cuda"`` the
    transformer's steps on the GPU besides."""
    parts = PARTS + (CUDA_PARTS if device == "cuda" else ())
    return [dict(kind="overhead", part=p, level=level, threads=1,
                 **({"device": "cuda"} if p in CUDA_PARTS else {})) for p in parts]


def run_overhead(job: dict) -> dict:
    torch.set_num_threads(1)  # the setting, whatever --threads says
    torch.manual_seed(0)
    size = SIZES[job["level"]]
    run = {"chain": run_chain, "transformer": run_transformer, "memory": run_memory,
           "heads": run_heads, "transformer_cuda": functools.partial(run_transformer, device="cuda")
           }[job["part"]]
    t0 = time.perf_counter()
    out = run(size)
    return dict(job=job, ok=True, gp_file=gp.__file__, elapsed_s=time.perf_counter() - t0, **out)


# -- counting ----------------------------------------------------------------------------
class _CallCounter(TorchFunctionMode):
    """Counts the torch calls a TorchFunctionMode sees (what graphprune's recorder sees)."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _count_nodes(roots) -> int:
    """Distinct autograd nodes reachable from ``roots`` (creates their Python wrappers:
    keep it to graphs of < 50k nodes, torch 2.13 crashes tearing down longer chains)."""
    seen, stack = {}, [t.grad_fn for t in roots]
    while stack:
        fn = stack.pop()
        if fn is not None and id(fn) not in seen:
            seen[id(fn)] = fn
            stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def census(forward) -> dict:
    """Torch calls, nodes and saved tensors of one untimed plain ``forward()``."""
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    counter = _CallCounter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        outs = forward()
    out = dict(calls=counter.calls, nodes=_count_nodes(outs), saved=saved[0])
    del outs
    gc.collect()
    return out


def _paired(a, b, op) -> float:
    """Median over rounds of ``op(a_i, b_i)``."""
    return statistics.median(op(x, y) for x, y in zip(a, b))


# -- the tiny-op chain ----------------------------------------------------------------
def _mul_chain(w, c, n):
    h = w
    for _ in range(n):
        h = torch.mul(h, c)
    return h


def _one(forward) -> float:
    """Time one forward; free its graph outside the timed window."""
    gc.collect()
    t0 = time.perf_counter()
    y = forward()
    dt = time.perf_counter() - t0
    del y
    return dt


def _steady(forward, k=3) -> float:
    """Time ``k`` forwards in a row, each previous graph freed before the next one."""
    gc.collect()
    t0 = time.perf_counter()
    y = None
    for _ in range(k):
        y = None
        y = forward()
    dt = time.perf_counter() - t0
    del y
    return dt


class _NoOpMode(TorchFunctionMode):
    """The floor's mode: sees every torch call, does nothing with it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _detach(t):
    return t.detach()


def _lean(forward):
    """``forward`` under the floor any tracker pays: a no-op ``TorchFunctionMode`` and a
    pack hook that detaches (the issue's lean prototype), measured beside graphprune
    so that the µs per call say what the machine costs and what graphprune adds."""
    with _NoOpMode(), torch.autograd.graph.saved_tensors_hooks(_detach, _identity):
        return forward()


def _identity(t):
    return t


def run_chain(size) -> dict:
    n = size["chain"]
    w, c = torch.randn(16, requires_grad=True), torch.ones(16)

    def plain():
        return _mul_chain(w, c, n)

    def tracked():
        with gp.track():
            return _mul_chain(w, c, n)

    def floor():
        return _lean(plain)

    counts = census(lambda: [plain()])
    t = {k: [] for k in ("plain", "gp", "floor", "plain3", "gp3", "floor3")}
    for rnd in range(size["chain_rounds"] + 1):  # round 0 warms up
        runs = [("plain", plain), ("gp", tracked), ("floor", floor)]
        runs = runs[rnd % 3:] + runs[:rnd % 3]  # the order turns round by round
        one = {k: _one(f) for k, f in runs}
        three = {k + "3": _steady(f) for k, f in runs}
        if rnd:
            for k, v in {**one, **three}.items():
                t[k].append(v)
    calls = counts["calls"]

    def over(key, plain_key, forwards):
        return _paired(t[key], t[plain_key], lambda a, b: (a - b) / (forwards * calls) * 1e6)

    return dict(calls=calls, census=counts, times_s=t,
                median_s={k: statistics.median(v) for k, v in t.items()},
                us_per_call=over("gp", "plain", 1), steady_us_per_call=over("gp3", "plain3", 3),
                floor_us_per_call=over("floor", "plain", 1),
                floor_steady_us_per_call=over("floor3", "plain3", 3))


# -- the small transformer ------------------------------------------------------------
class _Model:
    def __init__(self, s, device: str = "cpu"):
        def layer():
            return nn.TransformerEncoderLayer(s["d"], s["heads"], s["ff"], dropout=0.0, batch_first=True,
                                              device=device)

        self.trunk = nn.Sequential(*[layer() for _ in range(4)])
        self.head1, self.head2 = layer(), layer()
        self.params = [p for m in (self.trunk, self.head1, self.head2) for p in m.parameters()]
        self.inp = torch.randn(s["batch"], s["seq"], s["d"], device=device)
        self.clock = _synced_clock if device == "cuda" else time.perf_counter  # the steps' timer

    def forward(self):
        x = self.trunk(self.inp)
        return x, self.head1(x).square().mean(), self.head2(x).square().mean()


def _synced_clock() -> float:
    """``time.perf_counter()`` once the GPU has run every kernel launched so far."""
    torch.cuda.synchronize()
    return time.perf_counter()


def _plain_step(m) -> dict:
    t0 = m.clock()
    x, l1, l2 = m.forward()
    t1 = m.clock()
    l1.backward(retain_graph=True)
    t2 = m.clock()
    l2.backward()
    del x, l1, l2
    t3 = m.clock()
    return dict(fwd=t1 - t0, bwd1=t2 - t1, step=t3 - t0)


def _gp_step(m) -> dict:
    t0 = m.clock()
    with gp.track():
        x, l1, l2 = m.forward()
    t1 = m.clock()
    l1.backward(retain_graph=True)
    t2 = m.clock()
    gp.prune_after(l1, keep=x)
    t3 = m.clock()
    l2.backward()
    del x, l1, l2
    t4 = m.clock()
    return dict(fwd=t1 - t0, bwd1=t2 - t1, prune=t3 - t2, step=t4 - t0)


def _floor_step(m) -> dict:
    """The step any tracker of this kind pays at least: the forward under the floor's
    mode and hooks (``_lean``), and in place of the prune one walk that reads each
    node's saved objects (``scaling.floor_walk``, which makes the wrappers as a prune does)."""
    t0 = m.clock()
    x, l1, l2 = _lean(m.forward)
    t1 = m.clock()
    l1.backward(retain_graph=True)
    t2 = m.clock()
    floor_walk(l1.grad_fn)
    t3 = m.clock()
    l2.backward()
    del x, l1, l2
    t4 = m.clock()
    return dict(fwd=t1 - t0, bwd1=t2 - t1, prune=t3 - t2, step=t4 - t0)


def _touched(m, rounds: int) -> dict:
    """Median seconds of the prune and of the bare walk (``scaling.floor_walk``) on a
    graph that one bare walk has read already (its wrappers made, its nodes' saved
    objects read once), a fresh graph each time, the two alternating: the part of
    each that is not the first touch of the graph's objects (a fresh graph's nodes
    and handles are out of the CPU's caches after the backward it follows)."""
    out = {"prune": [], "walk": []}
    for rnd in range(2 * rounds):
        for p in m.params:
            p.grad = None
        with gp.track():
            x, l1, l2 = m.forward()
        l1.backward(retain_graph=True)
        floor_walk(l1.grad_fn)
        t0 = m.clock()
        if rnd % 2:
            floor_walk(l1.grad_fn)
        else:
            gp.prune_after(l1, keep=x)
        out["walk" if rnd % 2 else "prune"].append(m.clock() - t0)
        l2.backward()
        del x, l1, l2
    return {k: statistics.median(v) for k, v in out.items()}


def _fixed(m, rounds: int) -> dict:
    """Median seconds of ``prune_after`` on a 3-node graph of the same forward (``a =
    w.exp(); b = (a * a).sum()``, keep=a) right after the ``l1`` backward, and of a second
    such prune right after the first: what a prune pays whatever its graph's size, with
    the code it runs out of the CPU's caches after a backward pass (``cold``) and in them
    (``warm``). NOTE [ What a prune pays first ] in ``graphprune/_plan.py``."""
    out = {"cold": [], "warm": []}
    w = torch.ones(8, requires_grad=True, device=m.inp.device)
    for _ in range(rounds):
        for p in m.params:
            p.grad = None
        with gp.track():
            x, l1, l2 = m.forward()
            small = [(a, (a * a).sum()) for a in (w.exp(), w.exp())]
        for _, b in small:
            b.backward(retain_graph=True)
        l1.backward(retain_graph=True)
        for key, (a, b) in zip(("cold", "warm"), small):
            t0 = m.clock()
            gp.prune_after(b, keep=a)
            out[key].append(m.clock() - t0)
        gp.prune_after(l1, keep=x)
        l2.backward()
        del x, l1, l2, small
    return {k: statistics.median(v) for k, v in out.items()}


def run_transformer(size, device: str = "cpu") -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("overhead/transformer_cuda: no CUDA device is available here")
    m = _Model(size, device)
    counts = census(lambda: m.forward())
    steps = [("plain", _plain_step), ("gp", _gp_step), ("floor", _floor_step)]
    runs = {name: [] for name, _ in steps}
    start, rnd = time.perf_counter(), 0
    while rnd < size["steps"] + 2 and (rnd < 5 or time.perf_counter() - start < size["budget_s"]):
        gc.collect()  # once a round: a collection costs ~0.1 s with torch imported
        for name, step in steps[rnd % 3:] + steps[:rnd % 3]:  # the order turns round by round
            for p in m.params:
                p.grad = None
            r = step(m)
            if rnd >= 2:  # two warm-up rounds
                runs[name].append(r)
        rnd += 1

    def col(name, key):
        return [r[key] for r in runs[name]]

    med = {f"{n}_{k}": statistics.median(col(n, k)) for n in runs for k in runs[n][0]}
    for n in runs:  # the l2 backward and the drop of the step's tensors: the step's rest
        med[f"{n}_rest"] = statistics.median(r["step"] - r["fwd"] - r["bwd1"] - r.get("prune", 0.0)
                                             for r in runs[n])
    touched = _touched(m, max(4, size["steps"] // 10))
    med.update(touched_prune=touched["prune"], touched_walk=touched["walk"])
    fixed = _fixed(m, max(4, size["steps"] // 10))
    med.update(fixed_cold=fixed["cold"], fixed_warm=fixed["warm"])
    return dict(census=counts, steps=len(runs["gp"]), median_s=med,
                fwd_ratio=_paired(col("gp", "fwd"), col("plain", "fwd"), lambda a, b: a / b),
                step_ratio=_paired(col("gp", "step"), col("plain", "step"), lambda a, b: a / b),
                prune_share=_paired(col("gp", "prune"), col("gp", "bwd1"), lambda a, b: a / b),
                floor_fwd_ratio=_paired(col("floor", "fwd"), col("plain", "fwd"), lambda a, b: a / b),
                floor_step_ratio=_paired(col("floor", "step"), col("plain", "step"), lambda a, b: a / b),
                floor_prune_share=_paired(col("floor", "prune"), col("floor", "bwd1"), lambda a, b: a / b))


# -- bookkeeping bytes ----------------------------------------------------------------
def _traced(forward):
    """(traced bytes a ``forward()`` leaves held, its result)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    y = forward()
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before, y


def run_heads(size) -> dict:
    """The seed pattern on a long trunk: ``trunk_heads`` heads built one by one on ``x``, each
    backpropagated and pruned with ``keep=x``; the time of each prune, per head, median
    over rounds. The first prune walks the trunk; later ones walk their head only
    (NOTE [ The trunk walked once ] in ``graphprune/_trunk.py``)."""
    n, k = size["trunk"], size["trunk_heads"]
    w = torch.randn(64, requires_grad=True)
    per_head = [[] for _ in range(k - 1)]
    for _ in range(size["head_rounds"] + 1):  # the first round warms up
        with gp.track():
            h = w
            for _ in range(n):
                h = h.sin()
            x = h
        times = []
        for i in range(k):
            with gp.track():
                loss = (x * (i + 1)).exp().sum()
            if i == k - 1:
                loss.backward()
                break
            loss.backward(retain_graph=True)
            t0 = time.perf_counter()
            gp.prune_after(loss, keep=x)
            times.append(time.perf_counter() - t0)
        del x, h, loss
        gc.collect()
        w.grad = None
        for i, t in enumerate(times):
            per_head[i].append(t)
    med = [statistics.median(t) for t in per_head]
    return dict(trunk=n, heads=k, rounds=size["head_rounds"], prune_s=med[0] if med else 0.0,
                per_head_s=med)


def _heads_rows(r) -> list[dict]:
    per = r["per_head_s"]
    if len(per) < 3:
        return []
    later = statistics.median(per[2:])
    return [_row(
        f"`prune_after(loss_k, keep=x)` per head, {r['heads']} heads built one by one on a "
        f"{r['trunk']}-node trunk (no target): the first prune walks and measures the trunk, "
        "later ones read their head only", "—",
        f"first {per[0] * 1e3:.2f} ms, second {per[1] * 1e3:.2f} ms, later {later * 1e3:.3f} ms",
        f"later / first {later / per[0]:.3f}", "—", None, f"overhead/heads ({r['trunk']}-node trunk)",
        "prune_after")]


def run_memory(size) -> dict:
    n = size["memory"]
    w, c = torch.randn(16, requires_grad=True), torch.ones(16)

    def tracked(k):
        with gp.track():
            return _mul_chain(w, c, k)

    warm = tracked(100), _mul_chain(w, c, 100)  # first-call caches are not per-node cost
    del warm
    t0 = time.perf_counter()
    tracemalloc.start()
    plain_b, y_plain = _traced(lambda: _mul_chain(w, c, n))
    gp_b, y_gp = _traced(lambda: tracked(n))
    tracemalloc.stop()
    elapsed = time.perf_counter() - t0
    nodes = n + 1  # n MulBackward0 and the leaf's AccumulateGrad
    del y_plain, y_gp
    return dict(nodes=nodes, plain_bytes=plain_b, gp_bytes=gp_b,
                bytes_per_node=(gp_b - plain_b) / nodes, traced_s=elapsed)


# -- the report's rows ----------------------------------------------------------------
def _row(measure, plain, graphprune, value, target, ok, workload, strategy="track") -> dict:
    return dict(measure=measure, plain=plain, gp=graphprune, value=value, target=target, ok=ok,
                workload=workload, strategy=strategy)


def _chain_rows(r) -> list[dict]:
    m, n = r["median_s"], r["calls"]
    wl = f"overhead/chain ({n} x mul, 16 floats)"
    rows = [
        _row(f"tiny-op chain, one forward: {n} x `torch.mul` on 16 floats", f"{m['plain'] * 1e3:.1f} ms",
             f"{m['gp'] * 1e3:.1f} ms", f"+{r['us_per_call']:.2f} µs/call", f"≤ {CALL_US:g} µs/call",
             r["us_per_call"] <= CALL_US, wl),
        _row("tiny-op chain, steady state: 3 forwards in a row, previous graphs freed",
             f"{m['plain3'] * 1e3:.1f} ms", f"{m['gp3'] * 1e3:.1f} ms",
             f"+{r['steady_us_per_call']:.2f} µs/call", f"≤ {STEADY_US:g} µs/call",
             r["steady_us_per_call"] <= STEADY_US, wl),
    ]
    if "floor_us_per_call" in r:  # the machine's floor: a no-op mode and a detaching pack hook
        rows.append(_row(
            "the floor on this machine (no target): a no-op `TorchFunctionMode` and a pack hook that "
            "detaches, one forward / steady state", f"{m['plain'] * 1e3:.1f} ms",
            f"floor {m['floor'] * 1e3:.1f} ms", f"+{r['floor_us_per_call']:.2f} / "
            f"+{r['floor_steady_us_per_call']:.2f} µs/call; graphprune over it +"
            f"{r['us_per_call'] - r['floor_us_per_call']:.2f} / "
            f"+{r['steady_us_per_call'] - r['floor_steady_us_per_call']:.2f}", "—", None, wl, "floor"))
    return rows


def _transformer_rows(r, cuda: bool = False) -> list[dict]:
    m = r["median_s"]
    on = " on CUDA, each timer read after `torch.cuda.synchronize()`" if cuda else ""
    wl = f"overhead/transformer{'_cuda' if cuda else ''} ({r['steps']} paired steps)"
    rows = [
        _row(f"small transformer{on}, forward (4-layer trunk + 2 one-layer heads)",
             f"{m['plain_fwd'] * 1e3:.1f} ms", f"{m['gp_fwd'] * 1e3:.1f} ms", f"{r['fwd_ratio']:.3f}x",
             f"≤ {FWD_X:g}x",
             r["fwd_ratio"] <= FWD_X, wl),
        _row(f"small transformer{on}, step vs plain `retain_graph=True`", f"{m['plain_step'] * 1e3:.1f} ms",
             f"{m['gp_step'] * 1e3:.1f} ms", f"{r['step_ratio']:.3f}x", f"≤ {STEP_X:g}x",
             r["step_ratio"] <= STEP_X, wl),
        _row(f"`prune_after(l1, keep=x)` / the `l1` backward it follows{on}",
             f"backward {m['gp_bwd1'] * 1e3:.1f} ms", f"prune {m['gp_prune'] * 1e3:.2f} ms",
             f"{r['prune_share'] * 100:.1f}%", f"≤ {PRUNE_SHARE:.0%}", r["prune_share"] <= PRUNE_SHARE, wl,
             "prune_after"),
    ]
    if "floor_step_ratio" in r:  # the machine's floor: the chain's mode and hook, one bare walk
        rows.append(_row(
            f"the floor on this machine{on} (no target): forward under a no-op `TorchFunctionMode` "
            "and a pack hook that detaches; step with one walk reading the saved objects in place of "
            "the prune; that walk / the `l1` backward", f"{m['plain_fwd'] * 1e3:.1f} ms / "
            f"{m['plain_step'] * 1e3:.1f} ms", f"floor {m['floor_fwd'] * 1e3:.1f} ms / "
            f"{m['floor_step'] * 1e3:.1f} ms / walk {m['floor_prune'] * 1e3:.2f} ms",
            f"{r['floor_fwd_ratio']:.3f}x / {r['floor_step_ratio']:.3f}x / "
            f"{r['floor_prune_share'] * 100:.1f}%", "—", None, wl, "floor"))
    if "touched_prune" in m:  # how much of each is the first touch of a fresh graph's objects
        rows.append(_row(
            f"where the prune's time goes{on} (no target): the prune and the bare walk on a fresh "
            "graph (as above), and on a graph that one bare walk has read already",
            f"walk {m['floor_prune'] * 1e3:.2f} ms / read before {m['touched_walk'] * 1e3:.2f} ms",
            f"prune {m['gp_prune'] * 1e3:.2f} ms / read before {m['touched_prune'] * 1e3:.2f} ms",
            f"{m['touched_prune'] / m['gp_prune']:.2f}x / {m['touched_walk'] / m['floor_prune']:.2f}x",
            "—", None, wl, "floor"))
    if "fixed_cold" in m:  # what a prune pays whatever its size, right after a backward and again
        rows.append(_row(
            f"the prune's fixed cost{on} (no target): `prune_after` of a 3-node graph right after the "
            "`l1` backward, and a second one right after it; the first / the prune above",
            "—", f"first {m['fixed_cold'] * 1e3:.2f} ms / second {m['fixed_warm'] * 1e3:.2f} ms",
            f"{m['fixed_cold'] / m['gp_prune']:.0%}", "—", None, wl, "prune_after"))
    if "gp_rest" in m:  # the step's parts, each a median of its own
        def parts(n):
            return " / ".join(f"{m[f'{n}_{k}'] * 1e3:.2f}" if f"{n}_{k}" in m else "—"
                              for k in ("fwd", "bwd1", "prune", "rest"))
        rows.append(_row(
            f"where the step's time goes{on} (no target): forward / `l1` backward / prune (the floor: "
            "its walk) / `l2` backward and the drop of the step's tensors, ms, each a median of its own",
            parts("plain"), parts("gp"), f"floor {parts('floor')}", "—", None, wl, "floor"))
    return rows


def _memory_rows(r) -> list[dict]:
    n = r["nodes"]
    return [_row(f"bookkeeping per tracked node: {n}-node mul chain, tracemalloc",
                 f"{r['plain_bytes'] / n:.0f} B/node", f"{r['gp_bytes'] / n:.0f} B/node",
                 f"+{r['bytes_per_node']:.0f} B/node", f"≤ {NODE_BYTES} B/node",
                 r["bytes_per_node"] <= NODE_BYTES, f"overhead/memory ({n} nodes)")]


def _scaling_rows(scaling) -> list[dict]:
    out = []
    for s in sorted((s for s in scaling if s["shape"] == "chain"), key=lambda s: s["nodes"]):
        target = SCALING_US[100000] if s["target"] > 10000 else SCALING_US[10000]
        for name, key in (("prune_after", "prune_s"), ("explain", "explain_s")):
            us = s[key] / s["nodes"] * 1e6
            lo, hi = bound_key(key, "min"), bound_key(key, "max")
            spread = (f" (runs {s[lo] / s['nodes'] * 1e6:.2f}–{s[hi] / s['nodes'] * 1e6:.2f})"
                      if lo in s and s.get("runs", 1) > 1 else "")
            out.append(_row(f"`{name}(y, keep=x)`, chain of {s['nodes']} nodes", "—",
                            f"{s[key] * 1e3:.1f} ms", f"{us:.2f} µs/node{spread}", f"≤ {target:g} µs/node",
                            us <= target, f"scaling/chain ({s['nodes']} nodes)", name))
        if "floor_s" in s:  # the machine's floor: one walk reading each node's saved objects
            us = s["floor_s"] / s["nodes"] * 1e6
            out.append(_row(f"the floor on this machine (no target): one walk reading each node's saved "
                            f"objects, chain of {s['nodes']} nodes", "—", f"{s['floor_s'] * 1e3:.1f} ms",
                            f"{us:.2f} µs/node", "—", None, f"scaling/chain ({s['nodes']} nodes)", "floor"))
    return out


def rows(overhead: dict, scaling: list) -> list[dict]:
    """Table rows from the overhead jobs' results (``part -> result``) and the scaling rows."""
    make = {"chain": _chain_rows, "transformer": _transformer_rows, "memory": _memory_rows,
            "heads": _heads_rows, "transformer_cuda": functools.partial(_transformer_rows, cuda=True)}
    out = [r for part in PARTS + CUDA_PARTS if part in overhead for r in make[part](overhead[part])]
    return out + _scaling_rows(scaling)


def census_line(overhead: dict) -> str:
    parts = [f"{p}: {c['calls']} torch calls, {c['nodes']} autograd nodes, {c['saved']} saved tensors"
             for p in ("chain", "transformer") if (c := overhead.get(p, {}).get("census"))]
    return "Counts, from one extra untimed plain forward: " + "; ".join(parts) + "." if parts else ""


# -- running the overhead jobs alone ---------------------------------------------------
def main(argv=None) -> int:
    """``python -m benchmarks.overhead [--quick|--tiny] [--device cuda] [--parts a,b]``: the
    overhead jobs and the chain scaling jobs in fresh processes; prints the "Tracking
    overhead" section."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=main.__doc__)
    lvl = p.add_mutually_exclusive_group()
    lvl.add_argument("--quick", action="store_true")
    lvl.add_argument("--tiny", action="store_true")
    p.add_argument("--no-scaling", action="store_true", help="skip the chain scaling jobs")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the transformer's steps on the GPU too (transformer_cuda)")
    p.add_argument("--parts", help=f"only these parts, comma-separated ({', '.join(PARTS + CUDA_PARTS)})")
    args = p.parse_args(argv)
    level = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    wanted = set(args.parts.split(",")) if args.parts else None
    if wanted and not wanted <= set(PARTS + CUDA_PARTS):
        p.error(f"--parts: unknown {', '.join(sorted(wanted - set(PARTS + CUDA_PARTS)))}")
    from . import report, scaling
    from .worker import run_isolated

    todo = [j for j in jobs(level, args.device) if wanted is None or j["part"] in wanted]
    todo += [] if args.no_scaling else scaling.jobs(level, 1, shapes=["chain"])
    print(f"graphprune: {gp.__file__}", file=sys.stderr)
    results = []
    for job in todo:
        t0 = time.perf_counter()
        results.append(run_isolated(job))
        print(f"{job['kind']}/{job.get('part', job.get('nodes'))}: {time.perf_counter() - t0:.1f} s "
              f"{'' if results[-1].get('ok') else results[-1].get('error')}", file=sys.stderr)
    print("\n".join(report.overhead_section(results)))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
