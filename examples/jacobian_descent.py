"""Jacobian descent in torchjd's style: the T x P Jacobian of the losses by the shared
parameters, reduced to one update by an aggregator, each head's own gradient as usual.

Run: ``python examples/jacobian_descent.py``. Three runs of one step, checked equal:

- torchjd 0.18's own ``mtl_backward(losses, features=feats)`` then
  ``jac_to_grad(shared, aggregator)``, plain;
- the same calls, unmodified, with ``gp.track()`` around the forward and
  ``gp.pruning()`` around them. torchjd passes ``retain_graph=False`` (each head's
  pass frees it, the vmap'd Jacobian pass frees the trunk), so ``pruning()`` routes
  none of its calls and graphprune frees nothing that PyTorch does not; its saved
  tensors are unpacked under ``torch.vmap`` as usual. With
  ``parallel_chunk_size=1`` (no vmap) the rows but the last retain the graph and are
  routed; each needs the trunk for the next, so they free nothing either;
- the Jacobian's rows from ``gp.grads_each``, the heads given as callables, so each is
  built after the previous one was freed: the peak is the trunk and one head, where
  torchjd's forward holds every head.
"""

import torch
from _mtl import grads, lazy_rows, mib, model, report, task_loss
from torchjd.aggregation import IMTLG
from torchjd.autojac import jac_to_grad, mtl_backward

import graphprune as gp


def torchjd_step(mode: str = "plain", timeline=None, chunk=None):
    """torchjd's MTL step; ``mode`` is "plain" or "pruning" (its calls inside ``gp.pruning()``)."""
    trunk, heads, inputs, targets = model()
    with gp.track(timeline=timeline) if timeline or mode != "plain" else torch.enable_grad():
        feats = trunk(inputs)
        losses = [task_loss(head, feats, target) for head, target in zip(heads, targets)]
    with gp.pruning() if mode == "pruning" else torch.enable_grad() as p:
        mtl_backward(losses, features=feats, parallel_chunk_size=chunk)
        jac_to_grad(list(trunk.parameters()), IMTLG())
    return grads(trunk, heads), p


def graphprune_step(timeline=None):
    """The Jacobian's rows from ``grads_each``, heads built one at a time."""
    trunk, heads, shared, params, rows = lazy_rows(timeline)
    jacobian = torch.stack([torch.cat([g.flatten() for g in row[:len(shared)]]) for row in rows])
    update = IMTLG()(jacobian)
    offset = 0
    for p in shared:
        p.grad = update[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    for k, p in enumerate(params[len(shared):], start=len(shared)):
        p.grad = sum(row[k] for row in rows)  # only its own head's row is non-zero
    return grads(trunk, heads)


if __name__ == "__main__":
    want, _ = torchjd_step()
    got, p = torchjd_step("pruning")
    torch.testing.assert_close(got, want)
    routed_vmap, plain_vmap = len(p.reports), len(p.passed)
    got, p = torchjd_step("pruning", chunk=1)
    torch.testing.assert_close(got, want)
    routed_rows = [mib(r.bytes_freed) for r in p.reports]
    torch.testing.assert_close(graphprune_step(), want)
    plain, pruned = gp.Timeline("torchjd"), gp.Timeline("graphprune")
    torchjd_step(timeline=plain)
    graphprune_step(pruned)
    report("jacobian_descent", torchjd_vmap_routed=routed_vmap, torchjd_vmap_plain_calls=plain_vmap,
           torchjd_chunk1_routed_freed_mib=routed_rows, peak_mib_torchjd=mib(plain.peak),
           peak_mib_graphprune=mib(pruned.peak), held_at_end_mib_torchjd=mib(plain.bytes),
           held_at_end_mib_graphprune=mib(pruned.bytes))
