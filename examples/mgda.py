"""MGDA (Sener & Koltun, 2018): each task's gradient of the shared parameters, the min-norm
weights of their convex hull, then the weighted sum of the losses backpropagated.

Run: ``python examples/mgda.py``. Three ways, checked against each other:

- plain PyTorch: ``torch.autograd.grad(loss_i, shared, retain_graph=True)`` per task,
  then ``(weights * losses).sum().backward()``: every head and the trunk live until
  that last pass;
- the same loop with ``gp.grad``: each pass frees its head, so the weighted sum's
  pass, which runs every head again, meets ``ReleasedTensorError`` naming the call that
  freed what it needs (never a wrong gradient);
- the memory-optimal form: the weighted sum's gradient *is* ``sum_i weights_i *
  grad_i``, so take every parameter's per-task gradient from ``gp.grads_each`` and
  combine them, with no second pass. Heads given as callables are built one at a time,
  after the previous one was freed: the peak is the trunk and one head.
"""

import torch
from _mtl import grads, lazy_rows, mib, model, report, task_loss

import graphprune as gp


def min_norm_weights(rows: torch.Tensor, iters: int = 50) -> torch.Tensor:
    """Frank-Wolfe on the Gram matrix: the convex combination of ``rows`` of least norm."""
    gram = rows @ rows.t()
    a = torch.full((len(rows),), 1.0 / len(rows))
    for _ in range(iters):
        d = torch.nn.functional.one_hot(torch.argmin(gram @ a), len(rows)).to(a) - a
        curvature = d @ gram @ d
        if curvature <= 0:
            break
        a = a + (-(d @ gram @ a) / curvature).clamp(0, 1) * d
    return a


def plain_step(timeline=None):
    trunk, heads, inputs, targets = model()
    shared = list(trunk.parameters())
    with gp.track(timeline=timeline) if timeline else torch.enable_grad():
        feats = trunk(inputs)
        losses = [task_loss(head, feats, target) for head, target in zip(heads, targets)]
    rows = [torch.cat([g.flatten() for g in torch.autograd.grad(loss, shared, retain_graph=True)])
            for loss in losses]
    weights = min_norm_weights(torch.stack(rows))
    (weights * torch.stack(losses)).sum().backward()
    return grads(trunk, heads), weights


def naive_graphprune_step():
    """The plain loop with ``gp.grad``: the last pass needs the heads it freed."""
    trunk, heads, inputs, targets = model()
    shared = list(trunk.parameters())
    with gp.track():
        feats = trunk(inputs)
        losses = [task_loss(head, feats, target) for head, target in zip(heads, targets)]
    rows = [torch.cat([g.flatten() for g in gp.grad(loss, shared)]) for loss in losses]
    weights = min_norm_weights(torch.stack(rows))
    (weights * torch.stack(losses)).sum().backward()


def optimal_step(timeline=None):
    """Every parameter's per-task gradient from ``grads_each``, heads built one at a time."""
    trunk, heads, shared, params, rows = lazy_rows(timeline)
    freed = mib(gp.last_report().bytes_freed)
    jacobian = torch.stack([torch.cat([g.flatten() for g in row[:len(shared)]]) for row in rows])
    weights = min_norm_weights(jacobian)
    for k, p in enumerate(params):
        p.grad = sum(w * row[k] for w, row in zip(weights, rows))
    return grads(trunk, heads), weights, freed


if __name__ == "__main__":
    want, want_weights = plain_step()
    try:
        naive_graphprune_step()
        raise AssertionError("the weighted sum's pass ran through freed heads")
    except gp.ReleasedTensorError as e:
        print(f"as expected: ReleasedTensorError: {str(e)[:150]}...")
    got, weights, last_freed = optimal_step()
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(got, want)
    plain, pruned = gp.Timeline("plain"), gp.Timeline("graphprune")
    plain_step(plain)
    optimal_step(pruned)
    report("mgda", weights=[round(w, 4) for w in weights.tolist()], last_pass_freed_mib=last_freed,
           peak_mib_plain=mib(plain.peak), peak_mib_graphprune=mib(pruned.peak),
           held_at_end_mib_plain=mib(plain.bytes), held_at_end_mib_graphprune=mib(pruned.bytes))
