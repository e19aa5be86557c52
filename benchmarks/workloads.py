"""Workloads and strategies.

Every workload is a *trunk* (a list of blocks, run in order) and *heads*; head ``k``
reads the output of trunk block ``tap[k]`` (and the input) and returns
``(y_k, loss_k)``.  A step computes the gradients of every loss, one backward per
loss (or one summed backward), in one of three modes:

* ``lazy``   -- the seed pattern: trunk, then for each head: build it, backward it;
* ``eager``  -- multi-task: every head built first, then one backward each;
* ``pcgrad`` -- eager, and each loss's gradient of the shared (trunk) parameters is
  collected separately with ``torch.autograd.grad``, then combined PCGrad-style.

Heads run deepest tap first (that is the order in which a finished branch can free
the most).  Every strategy holds what real training code holds: each loss tensor is
kept for logging and each head output ``y_k`` for a metric until the step ends --
except ``drop_refs``, whose whole point is to drop them (it keeps detached copies).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import graphprune as gp

STRATEGIES = [
    "retain",
    "drop_refs",
    "summed",
    "recompute",
    "manual_cut",
    "checkpoint",
    "gp_prune",
    "gp_backward",
    "gp_each",
]
SEED_STRATEGIES = [
    "seed_2fwd_2bwd",
    "seed_2fwd_summed",
    "seed_2fwd_2bwd_retained",
    "seed_2fwd_summed_retained",
]

DESCRIPTION = {
    "retain": "`backward(retain_graph=True)` for every loss, the last one included",
    "drop_refs": "`retain_graph=True` but the last; after each backward every Python reference "
    "to the branch (loss, output) is dropped by hand, detached copies kept for logging",
    "summed": "all heads built, `sum(losses).backward()` once",
    "recompute": "the trunk is run again for every head; plain `backward()` each time",
    "manual_cut": "`d = x.detach().requires_grad_()`, heads on `d`, plain backward per head, "
    "then `x.backward(d.grad)` (one cut per tap point)",
    "checkpoint": "every trunk block under `torch.utils.checkpoint(use_reentrant=False)`; "
    "`retain_graph=True` but the last",
    "gp_prune": "under `graphprune.track()`: `backward(retain_graph=True)` then "
    "`graphprune.prune_after(loss, keep=x)`; plain backward for the last loss",
    "gp_prune_auto": "as gp_prune but `prune_after(loss)` with the default `keep=None` (protect the "
    "graphs of the live outputs no pass has run through: the heads not backpropagated yet); eager "
    "mode only, since a head built after the prune needs `keep=x`",
    "gp_backward": "under `graphprune.track()`: `graphprune.backward(loss, keep=x)` "
    "(`graphprune.grad` in pcgrad mode); plain backward for the last loss",
    "gp_each": "`graphprune.backward_each` (`graphprune.grads_each` in pcgrad mode), no `keep=`: lazy "
    "modes (and pcgrad) pass each head as a callable, built when its turn comes; eager mode passes the "
    "losses. backward_each runs each head down to where it meets the trunk and the trunk once",
    "torchjd": "torchjd 0.18: heads built first, `mtl_backward(losses, features)` (a vmapped Jacobian "
    "of the shared parameters), then `jac_to_grad(shared, PCGrad())`; pcgrad mode only",
    "seed_2fwd_2bwd": "seed func1: `loss1(model(x)).backward(); loss2(model(x)).backward()`",
    "seed_2fwd_summed": "seed func2: `(loss1(model(x)) + loss2(model(x))).backward()`",
    "seed_2fwd_2bwd_retained": "seed func3: as func1 with `retain_graph=True`",
    "seed_2fwd_summed_retained": "seed func4: as func2 with `retain_graph=True`",
    "floor": "probe: trunk + the largest head only, one plain backward",
}


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------
class Model:
    def __init__(self, blocks, heads, taps, inp, name):
        self.blocks = nn.ModuleList(blocks)
        self.heads = nn.ModuleList(heads)
        self.taps = list(taps)
        self.inp = inp
        self.name = name
        self.shared = [p for p in self.blocks.parameters()]
        order = sorted(range(len(heads)), key=lambda k: -self.taps[k])  # deepest tap first
        self.order = order

    def to(self, device):
        self.blocks.to(device)
        self.heads.to(device)
        self.inp = self.inp.to(device).detach().requires_grad_(self.inp.requires_grad)
        self.shared = [p for p in self.blocks.parameters()]
        return self

    def params(self):
        return list(self.blocks.parameters()) + list(self.heads.parameters())

    def zero_grad(self):
        """Gradients stay allocated between steps (``zero_grad(set_to_none=False)``), so
        the step's peak is activations and temporaries, not first-time .grad buffers."""
        for p in self.params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        if self.inp.requires_grad:
            self.inp.grad = None


class MLPHead(nn.Module):
    def __init__(self, width_in, width, depth, out):
        super().__init__()
        layers = []
        w = width_in
        for _ in range(depth):
            layers += [nn.Linear(w, width), nn.ReLU()]
            w = width
        layers += [nn.Linear(w, out)]
        self.net = nn.Sequential(*layers)

    def forward(self, f, inp):
        y = self.net(f)
        return y, (y * y).mean()


class SeedLoss(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.offset = offset

    def forward(self, y_pred, x):
        return y_pred, (y_pred * (self.offset - x.clamp(0, 1))).sum()


def seed_mlp(size: dict) -> Model:
    b, d, h = size["seed_batch"], size["seed_in"], size["seed_hidden"]  # the seed: 64/1024/4096
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))
    x = torch.rand(b, d, requires_grad=True)
    return Model([mlp], [SeedLoss(0.5), SeedLoss(1.0)], [0, 0], x, "seed")


def trunk_heads(size: dict, k: int, unequal: bool, name: str) -> Model:
    b, d, h = size["batch"], size["width"], size["width"]
    torch.manual_seed(0)
    trunk = nn.Sequential(
        nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU()
    )
    heads = []
    for i in range(k):
        w = h if not unequal else int(round(h * (0.5 + 1.5 * i / max(1, k - 1))))
        heads.append(MLPHead(h, w, size["head_depth"], 16))
    x = torch.randn(b, d)
    return Model([trunk], heads, [0] * k, x, name)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class StyleHead(nn.Module):
    """Gatys-style loss at one depth: Gram-matrix style loss, plus a content loss."""

    def __init__(self, channels, content: bool):
        super().__init__()
        self.content = content
        self.proj = nn.Conv2d(channels, channels, 1)  # a learned adapter, as in feature heads

    def forward(self, f, inp):
        g = self.proj(f)
        b, c, hh, ww = g.shape
        m = g.reshape(b, c, hh * ww)
        gram = torch.bmm(m, m.transpose(1, 2)) / (c * hh * ww)
        loss = (gram - 0.01).pow(2).sum()
        if self.content:
            loss = loss + (g - 0.5).pow(2).mean()
        return gram, loss


def style_depth(size: dict) -> Model:
    c, s, b = size["channels"], size["image"], size["img_batch"]
    torch.manual_seed(0)
    blocks = [ConvBlock(3, c)] + [ConvBlock(c, c) for _ in range(4)]
    heads = [StyleHead(c, content=(i == 3)) for i in range(5)]
    x = torch.rand(b, 3, s, s)
    return Model(blocks, heads, list(range(5)), x, "depth")


# --------------------------------------------------------------------------------------
# one step of one strategy
# --------------------------------------------------------------------------------------
def _trunk(model: Model, kind: str = "plain", upto: int | None = None):
    """Run the trunk; return (features, cut_pairs).  ``cut`` detaches at each tap point
    and returns ``[(f_i, d_i)]`` so the caller can backpropagate segment by segment."""
    h = model.inp
    feats, cuts = [], []
    last = len(model.blocks) - 1 if upto is None else upto
    taps = set(model.taps)
    for i, blk in enumerate(model.blocks):
        if i > last:
            break
        if kind == "checkpoint":
            h = checkpoint(blk, h, use_reentrant=False)
        else:
            h = blk(h)
        if kind == "cut" and i in taps:
            d = h.detach().requires_grad_()
            cuts.append((h, d))
            h = d
        feats.append(h)
    return feats, cuts


def _keep(model: Model, feats, remaining):
    seen, keep = set(), []
    for j in remaining:
        t = model.taps[j]
        if t not in seen:
            seen.add(t)
            keep.append(feats[t])
    return keep


def _pcgrad(flats: list[torch.Tensor]) -> torch.Tensor:
    """PCGrad (Yu et al. 2020): project each task gradient off the ones it conflicts with."""
    out = torch.zeros_like(flats[0])
    for i, gi in enumerate(flats):
        g = gi.clone()
        for j, gj in enumerate(flats):
            if i != j:
                dot = torch.dot(g, gj)
                if dot < 0:
                    g -= dot / (gj.norm() ** 2 + 1e-12) * gj
        out += g
    return out


def _task_grads(grad, loss, inputs, **kw):
    """A head tapping the trunk early leaves the deeper blocks' parameters unused: zeros."""
    return grad(loss, inputs, allow_unused=True, materialize_grads=True, **kw)


def _store_task_grads(model, k, grads, flats):
    n = len(model.shared)
    flats.append(torch.cat([g.reshape(-1) for g in grads[:n]]))
    for p, g in zip(model.heads[k].parameters(), grads[n:]):
        p.grad += g


def _finish_pcgrad(model, flats):
    combined = _pcgrad(flats)
    off = 0
    for p in model.shared:
        n = p.numel()
        p.grad += combined[off : off + n].view_as(p)
        off += n


def run_step(model: Model, strategy: str, mode: str, ck) -> dict:
    """One training step; ``ck(label)`` records memory at a checkpoint.

    Returns what the step holds at its end for logging (loss values) and metrics."""
    order = model.order
    K = len(order)
    logs, outs = [], []  # held for logging / metrics until the step ends

    def head(k, feats):
        return model.heads[k](feats[model.taps[k]], model.inp)

    def task_inputs(k):
        return model.shared + list(model.heads[k].parameters())

    if strategy.startswith("seed_"):
        return _seed_step(model, strategy, ck)

    if strategy == "recompute":
        flats = []
        for n, k in enumerate(order):
            feats, _ = _trunk(model, upto=model.taps[k])
            ck(f"fwd{n}")
            y, loss = head(k, feats)
            ck(f"head{n}")
            if mode == "pcgrad":
                _store_task_grads(model, k, _task_grads(torch.autograd.grad, loss, task_inputs(k)), flats)
            else:
                loss.backward()
            logs.append(loss)
            outs.append(y)
            del feats
            ck(f"bwd{n}")
        if mode == "pcgrad":
            _finish_pcgrad(model, flats)
        ck("end")
        return {"logs": logs, "outs": outs}

    if strategy == "summed":
        if mode == "pcgrad":
            raise NotApplicable("one summed loss gives the summed gradient, not one per task")
        feats, _ = _trunk(model)
        ck("fwd")
        pairs = [head(k, feats) for k in order]
        ck("heads")
        total = sum(loss for _, loss in pairs)
        total.backward()
        logs = [loss for _, loss in pairs]
        outs = [y for y, _ in pairs]
        ck("bwd")
        ck("end")
        return {"logs": logs, "outs": outs}

    if strategy == "manual_cut":
        return _manual_cut(model, mode, ck)
    if strategy == "gp_each":
        return _gp_each(model, mode, ck)
    if strategy == "torchjd":
        return _torchjd(model, mode, ck)

    tracked = strategy in ("gp_prune", "gp_backward", "gp_prune_auto")
    kind = "checkpoint" if strategy == "checkpoint" else "plain"
    ctx = gp.track() if tracked else _null()
    with ctx:
        feats, _ = _trunk(model, kind)
        ck("fwd")
        built = {}
        if mode in ("eager", "pcgrad"):
            for k in order:
                built[k] = head(k, feats)
            ck("heads")
    flats = []
    for n, k in enumerate(order):
        last = n == K - 1
        if k not in built:
            with gp.track() if tracked else _null():
                built[k] = head(k, feats)
            ck(f"head{n}")
        y, loss = built.pop(k)
        retain = (strategy == "retain") or not last
        keep = _keep(model, feats, order[n + 1 :])
        if mode == "pcgrad":
            if strategy == "gp_backward" and not last:
                grads = _task_grads(gp.grad, loss, task_inputs(k), keep=keep)
            else:
                grads = _task_grads(torch.autograd.grad, loss, task_inputs(k), retain_graph=retain)
            _store_task_grads(model, k, grads, flats)
            del grads
        elif strategy == "gp_backward" and not last:
            gp.backward(loss, keep=keep)
        else:
            loss.backward(retain_graph=retain)
        ck(f"bwd{n}")
        if strategy == "gp_prune" and not last:
            gp.prune_after(loss, keep=keep)
            ck(f"prune{n}")
        if strategy == "gp_prune_auto" and not last:
            gp.prune_after(loss)
            ck(f"prune{n}")
        if strategy == "drop_refs":
            logs.append(loss.detach())
            outs.append(y.detach())
            del y, loss
            ck(f"drop{n}")
        else:
            logs.append(loss)
            outs.append(y)
    del built
    if mode == "pcgrad":
        _finish_pcgrad(model, flats)
    ck("end")
    return {"logs": logs, "outs": outs}


def _gp_each(model: Model, mode: str, ck) -> dict:
    order = model.order
    logs, outs = [], []
    with gp.track():
        feats, _ = _trunk(model)
    ck("fwd")

    def build(k):
        def loss():
            y, loss_k = model.heads[k](feats[model.taps[k]], model.inp)
            logs.append(loss_k)
            outs.append(y)
            return loss_k
        return loss

    if mode == "eager":
        with gp.track():
            losses = [build(k)() for k in order]
        ck("heads")
        gp.backward_each(losses)
    elif mode == "pcgrad":
        heads_p = [p for k in order for p in model.heads[k].parameters()]  # into .grad, pass by pass
        rows = gp.grads_each([build(k) for k in order], model.shared, materialize_grads=True,
                             accumulate=heads_p)
        flats = []
        for i in range(len(rows)):
            row, rows[i] = rows[i], None
            flats.append(torch.cat([g.reshape(-1) for g in row]))
            del row
        del rows
        _finish_pcgrad(model, flats)
    else:
        gp.backward_each([build(k) for k in order])
    ck("bwd")
    ck("end")
    return {"logs": logs, "outs": outs}


def _torchjd(model: Model, mode: str, ck) -> dict:
    if mode != "pcgrad":
        raise NotApplicable("torchjd's mtl_backward gives per-task Jacobians: pcgrad mode")
    try:
        from torchjd.aggregation import PCGrad
        from torchjd.autojac import jac_to_grad, mtl_backward
    except ImportError as e:
        raise NotApplicable("torchjd is not installed (pip install -e .[bench])") from e
    if len(set(model.taps)) > 1:
        raise NotApplicable("mtl_backward takes the last shared representation: one tap depth")
    order = model.order
    feats, _ = _trunk(model)
    ck("fwd")
    pairs = [model.heads[k](feats[model.taps[k]], model.inp) for k in order]
    ck("heads")
    features = [feats[t] for t in sorted({model.taps[k] for k in order})]
    mtl_backward([loss for _, loss in pairs], features,
                 tasks_params=[list(model.heads[k].parameters()) for k in order],
                 shared_params=model.shared)
    ck("bwd")
    jac_to_grad(model.shared, PCGrad())
    ck("end")
    return {"logs": [loss for _, loss in pairs], "outs": [y for y, _ in pairs]}


def _manual_cut(model: Model, mode: str, ck) -> dict:
    order = model.order
    logs, outs = [], []
    feats, cuts = _trunk(model, "cut")
    ck("fwd")
    if mode in ("eager", "pcgrad"):
        built = {k: model.heads[k](feats[model.taps[k]], model.inp) for k in order}
        ck("heads")
    else:
        built = {}
    if mode == "pcgrad":
        if len(cuts) != 1:
            raise NotApplicable("per-task gradients through several cuts are not implemented")
        (x, d), = cuts
        flats = []
        for n, k in enumerate(order):
            y, loss = built.pop(k)
            heads_p = list(model.heads[k].parameters())
            g = torch.autograd.grad(loss, [d] + heads_p)
            for p, gh in zip(heads_p, g[1:]):
                p.grad += gh
            shared = torch.autograd.grad(x, model.shared, g[0], retain_graph=n < len(order) - 1)
            flats.append(torch.cat([s.reshape(-1) for s in shared]))
            del g, shared
            logs.append(loss)
            outs.append(y)
            ck(f"bwd{n}")
        _finish_pcgrad(model, flats)
        ck("end")
        return {"logs": logs, "outs": outs}
    for n, k in enumerate(order):
        if k not in built:
            built[k] = model.heads[k](feats[model.taps[k]], model.inp)
            ck(f"head{n}")
        y, loss = built.pop(k)
        loss.backward()
        logs.append(loss)
        outs.append(y)
        ck(f"bwd{n}")
    for i in range(len(cuts) - 1, -1, -1):
        f, d = cuts[i]
        f.backward(d.grad)
        ck(f"seg{i}")
    ck("end")
    return {"logs": logs, "outs": outs}


def _seed_step(model: Model, strategy: str, ck) -> dict:
    mlp = model.blocks[0]
    x = model.inp
    loss1, loss2 = model.heads[0], model.heads[1]
    logs = []
    retain = strategy.endswith("retained")
    if "summed" in strategy:
        _, l1 = loss1(mlp(x), x)
        _, l2 = loss2(mlp(x), x)
        ck("fwd")
        loss = l1 + l2
        loss.backward(retain_graph=retain)
        logs += [l1, l2, loss]
        ck("bwd")
    else:
        _, loss = loss1(mlp(x), x)
        ck("fwd0")
        loss.backward(retain_graph=retain)
        logs.append(loss)
        ck("bwd0")
        _, loss = loss2(mlp(x), x)
        ck("fwd1")
        loss.backward(retain_graph=retain)
        logs.append(loss)
        ck("bwd1")
    ck("end")
    return {"logs": logs, "outs": []}


def floor_step(model: Model, k: int, ck, rows: bool = False) -> dict:
    """The probe behind the floor: the whole trunk and head ``k`` only, one plain pass.
    With ``rows`` (pcgrad mode) it also holds what any per-task method must: one
    flattened gradient of the shared parameters per task."""
    held = [torch.zeros(sum(p.numel() for p in model.shared)) for _ in model.heads] if rows else []
    feats, _ = _trunk(model)
    ck("fwd")
    y, loss = model.heads[k](feats[model.taps[k]], model.inp)
    ck("head")
    loss.backward()
    ck("bwd")
    ck("end")
    return {"logs": [loss], "outs": [y], "rows": held}


def graph_accounting(model: Model) -> dict:
    """Saved-tensor bytes read off the graph as it is built: the trunk's, and what each
    head alone adds.  Storages are counted once; parameter storages (a Linear saves its
    weight) are left out, since they live in the baseline whatever happens to the graph."""
    params = {p.untyped_storage().data_ptr() for p in model.params()}
    seen: dict[int, int] = {}
    phase = ["trunk"]
    added: dict = {}

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in params and key not in seen:
            seen[key] = st.nbytes()
            added[phase[0]] = added.get(phase[0], 0) + st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        feats, _ = _trunk(model)
        held = []
        for k in range(len(model.heads)):
            phase[0] = k
            held.append(model.heads[k](feats[model.taps[k]], model.inp))
    heads = {k: added.get(k, 0) for k in range(len(model.heads))}
    out = {"trunk_bytes": added.get("trunk", 0), "head_bytes": heads, "all_bytes": sum(seen.values())}
    del held, feats
    return out


class NotApplicable(Exception):
    pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# --------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------
SIZES = {
    "full": dict(seed_batch=32, seed_in=1024, seed_hidden=4096, batch=2048, width=320, head_depth=2,
                 channels=32, image=64, img_batch=8),
    "quick": dict(seed_batch=16, seed_in=1024, seed_hidden=2048, batch=1024, width=256, head_depth=2,
                  channels=16, image=48, img_batch=4),
    "tiny": dict(seed_batch=4, seed_in=64, seed_hidden=128, batch=32, width=32, head_depth=1,
                 channels=4, image=8, img_batch=2),
}


def configs(level: str) -> list[dict]:
    """(workload config, strategies) pairs of the suite."""
    out = []
    out.append(dict(workload="seed", mode="lazy", k=2, unequal=False,
                    strategies=SEED_STRATEGIES + STRATEGIES))
    if level == "full":
        lazy = [(k, u) for u in (False, True) for k in (2, 4, 8)]
    else:
        lazy = [(2, False), (4, True)]
    for k, unequal in lazy:
        out.append(dict(workload="lazy", mode="lazy", k=k, unequal=unequal, strategies=STRATEGIES))
    out.append(dict(workload="eager", mode="eager", k=4, unequal=False,
                    strategies=STRATEGIES + ["gp_prune_auto"]))
    out.append(dict(workload="pcgrad", mode="pcgrad", k=4, unequal=False,
                    strategies=[s for s in STRATEGIES if s != "summed"] + ["torchjd"]))
    out.append(dict(workload="depth", mode="lazy", k=5, unequal=False, strategies=STRATEGIES))
    out.append(dict(workload="depth", mode="pcgrad", k=5, unequal=False,  # no single cut: 5 tap depths
                    strategies=["retain", "recompute", "gp_backward", "gp_each"]))
    return out


def config_name(cfg: dict) -> str:
    if cfg["workload"] == "seed":
        return "seed"
    if cfg["workload"] == "depth":
        return "depth" if cfg["mode"] == "lazy" else f"depth-{cfg['mode']}"
    return f"{cfg['workload']}-K{cfg['k']}-{'unequal' if cfg['unequal'] else 'equal'}"


def build(cfg: dict, size: dict) -> Model:
    if cfg["workload"] == "seed":
        return seed_mlp(size)
    if cfg["workload"] == "depth":
        return style_depth(size)
    return trunk_heads(size, cfg["k"], cfg["unequal"], config_name(cfg))


_ = math  # kept for future size rules
