"""PCGrad with assigned losses, as multi-task trainers write it: ``losses = torch.zeros(T);
losses[i] = loss_i``, then one backward per task collecting the shared gradients.

Run: ``python examples/pcgrad_assigned.py``. Plain PyTorch keeps every head until the
last task's pass (``retain_graph=True``). ``gp.backward(losses[i])`` (no ``keep=``: the
entries of ``losses`` no pass has run through keep the trunk) frees head ``i`` during
its own pass; ``gp.grads_each(losses, params)`` does the same for the whole loop. The
script checks both against plain PyTorch and prints the bytes the saved tensors hold
after each task's pass.
"""

import torch
from _mtl import T, flat_grads, grads, mib, model, report, set_flat_grads, task_loss

import graphprune as gp


def pcgrad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Project each task's gradient off the others it conflicts with (Yu et al., 2020); sum."""
    out = []
    for i, g in enumerate(rows):
        g = g.clone()
        for j, other in enumerate(rows):
            dot = g @ other
            if j != i and dot < 0:
                g -= dot / other.square().sum() * other
        out.append(g)
    return torch.stack(out).sum(0)


def step(mode: str, timeline=None):
    """One PCGrad step; ``mode`` is "plain", "backward" (gp.backward per task) or "grads_each"."""
    trunk, heads, inputs, targets = model()
    shared = list(trunk.parameters())
    with gp.track(timeline=timeline) if timeline or mode != "plain" else torch.enable_grad():
        feats = trunk(inputs)
        losses = torch.zeros(T)
        for i, head in enumerate(heads):
            losses[i] = task_loss(head, feats, targets[i])
    rows, freed, held = [], [], []
    if mode == "grads_each":
        params = shared + list(heads.parameters())
        for row in gp.grads_each(losses, params, allow_unused=True):
            rows.append(torch.cat([g.flatten() for g in row[:len(shared)]]))
            for p, g in zip(params[len(shared):], row[len(shared):]):
                if g is not None and g.any():  # head i's own parameters
                    p.grad = g if p.grad is None else p.grad + g
    else:
        for i in range(T):
            if mode == "plain":
                losses[i].backward(retain_graph=i + 1 < T)
            else:
                freed.append(mib(gp.backward(losses[i]).bytes_freed))
            held.append(mib(timeline.bytes) if timeline else None)
            rows.append(flat_grads(shared))
            for p in shared:
                p.grad = None
    set_flat_grads(shared, pcgrad(rows))
    return grads(trunk, heads), freed, held


if __name__ == "__main__":
    want, _, _ = step("plain")
    plain = gp.Timeline("plain")
    _, _, held_plain = step("plain", plain)
    pruned = gp.Timeline("graphprune")
    got, freed, held = step("backward", pruned)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(step("grads_each")[0], want)
    report("pcgrad_assigned", freed_per_pass_mib=freed, held_after_each_pass_mib_plain=held_plain,
           held_after_each_pass_mib_graphprune=held, peak_mib_plain=mib(plain.peak),
           peak_mib_graphprune=mib(pruned.peak))
