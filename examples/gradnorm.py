"""GradNorm (Chen et al., 2018): learnable task weights, tuned so that the norms of the weighted
losses' gradients at the last shared layer train at a common rate.

Run: ``python examples/gradnorm.py``. The order of its public implementations: the
weighted total backpropagated with ``retain_graph=True``; each weighted loss's
gradient at the last shared layer with ``create_graph=True`` (the norm must be
differentiable in the weights); the GradNorm loss's gradient of the weights.

Every pass but the last needs the whole forward graph, so graphprune frees nothing in
the middle of the step: the total's pass and the per-task passes say ``keep=weighted``
(the per-task passes start from its entries afterwards, and ``weights * losses`` is
one node that every entry's pass runs; without it the second meets
``ReleasedTensorError`` naming ``keep=weighted``).

What it gives is the end of the step: plain PyTorch's last pass runs only the path
to the weights, so the forward graph that ``retain_graph=True`` kept lives on
while the losses are held (for logging) until the next forward; ``gp.grad(...,
keep=[])`` frees it, with the double-backward graph. ``keep=[]``, because ``losses``
and ``weighted`` are gathered losses that the passes kept (``keep=weighted``) rather
than finished, and by the rule of ``keep=None`` they would keep their graphs.
"""

import torch
from _mtl import T, grads, mib, model, report, task_loss

import graphprune as gp

ALPHA = 1.5


def step(with_graphprune: bool, timeline=None):
    trunk, heads, inputs, targets = model()
    last_shared = trunk[2].weight
    weights = torch.ones(T, requires_grad=True)
    freed = []
    with gp.track(timeline=timeline) if timeline or with_graphprune else torch.enable_grad():
        feats = trunk(inputs)
        losses = torch.stack([task_loss(head, feats, target) for head, target in zip(heads, targets)])
        weighted = weights * losses
        total = weighted.sum()
        if with_graphprune:
            freed.append(gp.backward(total, keep=weighted).bytes_freed)
        else:
            total.backward(retain_graph=True)
        weights.grad = None
        norms = []
        for i in range(T):
            if with_graphprune:
                (g,) = gp.grad(weighted[i], last_shared, create_graph=True, keep=weighted)
                freed.append(gp.last_report().bytes_freed)
            else:
                (g,) = torch.autograd.grad(weighted[i], last_shared, retain_graph=True, create_graph=True)
            norms.append(g.norm())
        norms = torch.stack(norms)
        initial = torch.tensor([2.0, 1.0, 0.5]) * losses.detach()  # L_i(0), as if from the first step
        rate = losses.detach() / initial
        target = (norms.mean() * (rate / rate.mean()) ** ALPHA).detach()
        gradnorm_loss = (norms - target).abs().sum()
        if with_graphprune:
            (weights.grad,) = gp.grad(gradnorm_loss, weights, keep=[])
            freed.append(gp.last_report().bytes_freed)
        else:
            (weights.grad,) = torch.autograd.grad(gradnorm_loss, weights)
    held_at_end = timeline.bytes if timeline else None  # total, weighted, losses, norms still held
    return grads(trunk, heads) + [weights.grad.clone()], [mib(b) for b in freed], held_at_end


if __name__ == "__main__":
    want = step(False)[0]
    plain, pruned = gp.Timeline("plain"), gp.Timeline("graphprune")
    _, _, held_plain = step(False, plain)
    got, freed, held = step(True, pruned)
    torch.testing.assert_close(got, want)
    report("gradnorm", freed_per_pass_mib=freed, held_at_end_mib_plain=mib(held_plain),
           held_at_end_mib_graphprune=mib(held), peak_mib_plain=mib(plain.peak),
           peak_mib_graphprune=mib(pruned.peak))
