"""What ``prune_after`` and ``explain`` cost as the graph grows.

Three graph shapes of ``n`` autograd nodes (about half trunk, half branch), built
under ``graphprune.track()`` on small tensors so that graph bookkeeping, not
arithmetic, dominates (the worst case for graphprune's relative cost):

* ``chain``       -- a deep chain: ``n/2`` ``sin`` ops to ``x``, ``n/2`` more to ``y``;
* ``fanout``      -- a wide fan-out: ``n/2`` independent ``(x * c_i).sin()`` terms summed;
* ``transformer`` -- a stack of small transformer encoder layers; ``keep`` is the
  output of the middle layer, ``y`` the sum of the last layer's output.

For each: the tracked forward vs an untracked one; on one tracked graph
``y.backward(retain_graph=True)`` and ``prune_after(y, keep=x)`` alone (the row's
``backward_s`` and ``prune_s``); on a second, after its own backward,
``explain(y, keep=x)`` and then ``prune_after(y, keep=x)`` (``prune_after_explain_s``:
``explain`` left it the trunk's walk and measure, NOTE [ The trunk walked once ] in
``graphprune/_trunk.py``); microseconds per node. Beside them, on the second graph,
the machine's floor (:func:`floor_walk`): a walk that reads each node's saved objects
and does nothing else.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn as nn

import graphprune as gp

SHAPES = ["chain", "fanout", "transformer"]


def _chain(w, n):
    h = w
    for _ in range(n // 2):
        h = h.sin()
    x = h
    for _ in range(n - n // 2):
        h = h.sin()
    return x, h.sum()


def _fanout(w, n):
    x = w.sin()
    terms = [(x * (1.0 + i * 1e-4)).sin() for i in range(max(1, n // 2 - 1))]
    return x, torch.stack(terms).sum()


class _Stack:
    def __init__(self, d=16):
        torch.manual_seed(0)
        self.layers = [
            nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(4)
        ]
        self.nodes_per_layer = None

    def run(self, w, n_layers):
        h = w
        x = None
        for i in range(n_layers):
            h = self.layers[i % 4](h)
            if i == n_layers // 2 - 1:
                x = h
        return (x if x is not None else w), h.sum()


_SAVED_ATTRS: dict[type, list[str]] = {}  # a node type's _raw_saved_* names, found once per process


def floor_walk(root) -> int:
    """The least a prune that reads the graph when asked does per node, on this machine:
    visit each node once (a queue over ``next_functions``) and read what it saved
    without unpacking it (``_raw_saved_*``'s ``.data``, the names found once per node
    type and process, as graphprune finds them), nothing else. Returns the number of
    nodes visited.

    Example::

        >>> import torch
        >>> w = torch.ones(3, requires_grad=True)
        >>> floor_walk(w.sin().cos().sum().grad_fn)  # sum, cos, sin, w's AccumulateGrad
        4
    """
    attrs = _SAVED_ATTRS
    saved_tensor = torch._C._autograd.SavedTensor
    seen, queue = {root}, [root]
    read = []
    for node in queue:
        names = attrs.get(type(node))
        if names is None:
            names = attrs[type(node)] = [a for a in dir(type(node)) if a.startswith("_raw_saved_")]
        for name in names:
            value = getattr(node, name)
            if type(value) is saved_tensor:
                read.append(value.data)
            else:
                read += [v.data for v in value]
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return len(queue)


def jobs(level: str, threads: int, shapes=SHAPES) -> list[dict]:
    """The scaling jobs of a suite level: every shape at every size of the level."""
    sizes = {"full": [1000, 10000, 100000], "quick": [1000, 10000], "tiny": [200, 1000]}[level]
    # measured runs after the warm-up one: more where a run is short, so that the
    # median stands clear of a run that met noise from the rest of the machine (on a
    # shared machine a 10k-node run's plain forward alone varied 15 to 27 ms in one job)
    repeats = {"full": {1000: 9, 10000: 9, 100000: 3}, "quick": {1000: 3, 10000: 1}, "tiny": {}}[level]
    return [dict(kind="scaling", shape=shape, nodes=n, threads=threads, repeats=repeats.get(n, 0))
            for shape in shapes for n in sizes]


def _count(tape) -> int:
    return tape.graph().number_of_nodes()


SPREAD = ("prune_s", "explain_s", "fwd_plain_s")  # the row keys whose fastest and slowest run are kept


def bound_key(key: str, bound: str) -> str:
    """The result key of ``key``'s fastest (``bound="min"``) or slowest (``"max"``) run:
    ``bound_key("prune_s", "min") == "prune_min_s"``."""
    return f"{key.removesuffix('_s')}_{bound}_s"


def run_scaling(job: dict) -> dict:
    torch.set_num_threads(job.get("threads", 1))
    shape, n = job["shape"], job["nodes"]
    repeats = job["repeats"]
    stack = _Stack() if shape == "transformer" else None
    if shape == "transformer":
        w = torch.randn(2, 4, 16, requires_grad=True)
        counts = []
        for layers in (4, 8):
            with gp.track() as tape:
                held = stack.run(w, layers)
            counts.append(_count(tape))
            del held
            gc.collect()
        per_layer = max(1, (counts[1] - counts[0]) // 4)
        n_layers = max(2, n // per_layer)

        def build():
            return stack.run(w, n_layers)

    else:
        w = torch.randn(64, requires_grad=True)
        fn = _chain if shape == "chain" else _fanout

        def build():
            return fn(w, n)

    rows = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        x, y = build()
        t_plain_fwd = time.perf_counter() - t0
        del x, y
        gc.collect()
        t0 = time.perf_counter()
        with gp.track() as tape:
            x, y = build()
        t_fwd = time.perf_counter() - t0
        if rep == 0:
            n_nodes = _count(tape)
        nodes = n_nodes
        t0 = time.perf_counter()
        y.backward(retain_graph=True)
        t_bwd = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = gp.prune_after(y, keep=x)  # alone, as a step runs it
        t_prune = time.perf_counter() - t0
        released = report.released_tensors
        del x, y, report
        gc.collect()
        w.grad = None
        with gp.track():
            x, y = build()
        y.backward(retain_graph=True)
        t0 = time.perf_counter()
        rep_explain = gp.explain(y, keep=x)
        t_explain = time.perf_counter() - t0
        t0 = time.perf_counter()
        gp.prune_after(y, keep=x)
        t_prune_after_explain = time.perf_counter() - t0
        t0 = time.perf_counter()
        floor_walk(y.grad_fn)  # after the prune: the wrappers made, a lower bound
        t_floor = time.perf_counter() - t0
        row = dict(
            nodes=nodes,
            fwd_plain_s=t_plain_fwd,
            fwd_tracked_s=t_fwd,
            backward_s=t_bwd,
            explain_s=t_explain,
            prune_s=t_prune,
            prune_after_explain_s=t_prune_after_explain,
            floor_s=t_floor,
            released=released,
            explain_released=rep_explain.released_tensors,
        )
        del x, y, rep_explain
        gc.collect()
        w.grad = None
        if rep > 0 or repeats == 0:  # the first run warms up
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for key in SPREAD:  # the runs' spread: how noisy the machine was
        med[bound_key(key, "min")] = min(r[key] for r in rows)
        med[bound_key(key, "max")] = max(r[key] for r in rows)
    med["runs"] = len(rows)
    return dict(job=job, ok=True, scaling=med, rows=rows)
