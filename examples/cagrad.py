"""CAGrad (Liu et al., 2021): per-task passes with ``retain_graph=True``, the last one plain,
then a conflict-averse combination of the shared gradients.

Run: ``python examples/cagrad.py``. The training step is written for plain PyTorch
and left as it is; graphprune goes where a user would put it: ``gp.track()`` around
the forward and ``gp.pruning()`` around the step, which runs each
``retain_graph=True`` pass as ``gp.backward`` (each head freed during its own pass,
the trunk kept for the losses not run yet) and leaves the last pass, and the small
backward of CAGrad's own weight solve, to PyTorch.
"""

import torch
from _mtl import T, flat_grads, grads, mib, model, report, set_flat_grads, task_loss

import graphprune as gp


def cagrad(rows: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """The update of CAGrad's official implementation, its simplex solve done by a few SGD
    steps on softmax weights (as in its toy example) instead of scipy."""
    gram = rows @ rows.t()
    c = alpha * (gram.mean() + 1e-8).sqrt()
    mean = torch.full((T,), 1.0 / T)
    w = torch.zeros(T, requires_grad=True)
    opt = torch.optim.SGD([w], lr=25, momentum=0.5)
    for _ in range(20):
        opt.zero_grad()
        ww = torch.softmax(w, 0)
        objective = ww @ gram @ mean + c * (ww @ gram @ ww + 1e-8).sqrt()
        objective.backward()  # plain: no retain_graph, so pruning() leaves it to PyTorch
        opt.step()
    gw = torch.softmax(w.detach(), 0) @ rows
    g = rows.mean(0) + c / (gw.norm() + 1e-8) * gw
    return g / (1 + alpha**2)


def train_step(trunk, heads, losses, probe=lambda: None):
    """The step as written for plain PyTorch (``probe`` reads memory after each pass)."""
    shared = list(trunk.parameters())
    rows = []
    for i, loss in enumerate(losses):
        loss.backward(retain_graph=i + 1 < len(losses))
        probe()
        rows.append(flat_grads(shared))
        for p in shared:
            p.grad = None
    set_flat_grads(shared, cagrad(torch.stack(rows)))


def step(with_graphprune: bool, timeline=None):
    trunk, heads, inputs, targets = model()
    with gp.track(timeline=timeline) if timeline else torch.enable_grad():
        feats = trunk(inputs)
        losses = [task_loss(head, feats, target) for head, target in zip(heads, targets)]
    held = []

    def probe():
        held.append(mib(timeline.bytes) if timeline else None)

    if with_graphprune:
        with gp.pruning() as p:
            train_step(trunk, heads, losses, probe)
        freed = [mib(r.bytes_freed) for r in p.reports]
        plain_calls = len(p.passed)
    else:
        train_step(trunk, heads, losses, probe)
        freed, plain_calls = [], None
    return grads(trunk, heads), freed, held, plain_calls


if __name__ == "__main__":
    want = step(False)[0]
    plain = gp.Timeline("plain")
    _, _, held_plain, _ = step(False, plain)
    pruned = gp.Timeline("graphprune")
    got, freed, held, plain_calls = step(True, pruned)
    torch.testing.assert_close(got, want)
    report("cagrad", freed_per_pass_mib=freed, plain_calls=plain_calls,
           held_after_each_pass_mib_plain=held_plain, held_after_each_pass_mib_graphprune=held)
