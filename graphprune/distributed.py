"""Per-task backward passes for models wrapped in DDP or FSDP2, one gradient sync per step.

``DistributedDataParallel`` takes one backward pass per forward (pytorch#47260). With
several passes from one forward of a two-head model, on torch 2.13: the default
raises "Expected to mark a variable ready only once" (marked as ready twice);
``static_graph=True`` raises "training graph has changed"; ``find_unused_parameters=True``
raises "gradient which is undefined, but still allreduced" or, when the forward returns
both heads' outputs, raises nothing and leaves the later passes' gradients
unsynchronised (each rank's own). :func:`backward_each` runs one
:func:`graphprune.backward` pass per task loss, each freeing its own head as it goes,
and makes the last pass the one the wrapper synchronises, with every parameter in it
once, so that DDP's bucketed all-reduce (FSDP2's reduce-scatter) runs during that pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import PruneReport, backward, grad, last_report  # public names, but for the graph's walk
from ._graph import is_accumulator, walk

__all__ = ["backward_each"]

_CALL = "graphprune.distributed.backward_each"


def backward_each(model: nn.Module, losses: Sequence[torch.Tensor], grad_tensors=None, *,
                  keep=None) -> list[PruneReport]:
    """One :func:`graphprune.backward` pass per loss; the wrapper syncs gradients once.

    Run the forward as usual (under :func:`graphprune.track`, *not* under ``no_sync()``),
    then call this instead of ``sum(losses).backward()``. Each pass frees what only
    its loss needs (its head) during the pass; the trunk stays for the later losses
    (``keep=None``: see :func:`graphprune.prune_after`). ``.grad`` ends up as after
    one backward of ``sum(losses)``, synchronised across ranks.

    NOTE [ DDP: the last pass covers every parameter once ]
    DDP's reducer is armed by the *forward* (``no_sync()`` acts there: a backward pass
    inside it syncs or not as its forward did), and then counts one autograd hook per
    parameter, fired by the parameter's ``AccumulateGrad`` node; a second firing in the
    same iteration is "marked as ready twice". So:

    1. Every pass but the last is :func:`graphprune.grad` with the parameters as
       ``inputs``: autograd returns their gradients without running ``AccumulateGrad``,
       DDP's hooks do not fire, and the gradients are added to ``.grad`` here.
    2. The last pass is :func:`graphprune.backward` from the last loss and from one
       extra root whose backward gives an all-zero gradient (a zero-stride tensor) to
       every parameter the earlier losses reached. Autograd runs each parameter's
       ``AccumulateGrad`` once per pass, summing what reaches it, so DDP sees each
       parameter used by any loss exactly once, reading a ``.grad`` that already holds
       the earlier passes' sum; its buckets are all-reduced as they fill during this
       pass: the overlap of plain DDP. Without that zero root, with
       ``find_unused_parameters=False``, a head the last loss does not reach fires no
       hook: its ``.grad`` stays each rank's own and DDP raises "Expected to have
       finished reduction" at the next forward. With ``True`` DDP's output node
       (``_DDPSink``) already sends the last pass into every head of the forward's
       outputs with undefined gradients, which fires their hooks, and the hooks read
       ``.grad`` (the earlier passes' sum); the zero root changes nothing there but
       covers parameters an earlier loss reached outside DDP's outputs.
    3. Parameters no loss reaches get no hook, as in a plain single pass: with
       ``find_unused_parameters=True`` DDP handles them (they must be unused in the
       forward's outputs too), without it DDP raises its usual error.
    4. The earlier passes' ``inputs`` are every leaf the losses' graphs reach that
       requires grad, the model's parameters and any other (a learned loss weight kept
       outside the wrapper: uncertainty weighting), so each gets its gradient from every
       loss. A reentrant ``checkpoint`` in the graph is refused: ``autograd.grad`` does
       not run its region for the parameters inside, whose gradients would be lost.

    On 2 shared CPU cores with gloo (``python -m benchmarks.ddp_overlap``) plain DDP
    hides none of its all-reduce either, and a step takes what the manual pattern's
    takes (every pass under ``no_sync()``, then one all-reduce by hand).

    With ``find_unused_parameters=True`` the earlier passes free less: DDP's output
    node joins every output of the forward, and graphprune follows a gradient through
    a node it does not know into all its inputs, so a head whose output went through
    it stays until the last pass (gradients are not affected).

    ``static_graph=True`` is refused: its first iteration queues the all-reduce at the
    end of the first pass that runs through DDP's output node, which here is the first
    task's. A forward run under ``no_sync()`` (gradient accumulation) works: nothing is
    synchronised, the passes accumulate. Parameter hooks that fire on accumulation
    (``register_post_accumulate_grad_hook``) fire once, in the last pass.

    NOTE [ FSDP2 ]
    For a ``fully_shard`` model every pass is :func:`graphprune.backward`; all but the
    last run with ``set_requires_gradient_sync(False)`` (FSDP2 keeps the unsharded
    gradients), the last with the settings the model had, so it reduce-scatters the
    sum. FSDP2's end-of-backward callback runs the post-backward of every parameter
    group, so a group that only an earlier loss reached is reduced too.

    Args:
        model: the ``DistributedDataParallel`` wrapper (not its ``.module``) or the
            root ``fully_shard`` module whose forward made the losses.
        losses: the task losses, in pass order (at least one); the last is the
            synchronised pass.
        grad_tensors: ``None``, or one gradient (or ``None``) per loss, as
            ``torch.autograd.backward`` takes for a non-scalar output.
        keep: passed to each pass (see :func:`graphprune.backward`); ``None`` keeps
            the trunk for the losses not backpropagated yet.

    Returns:
        The :class:`~graphprune.PruneReport` of each pass, in order.

    Raises:
        TypeError: ``model`` is no DDP or FSDP2 module; ``losses`` is no sequence of
            tensors.
        ValueError: ``losses`` is empty, a loss has no ``grad_fn``, is given twice or
            is no scalar and has no ``grad_tensors`` entry, ``grad_tensors`` has
            another length, or DDP was built with ``static_graph=True``.

    Example (under ``torchrun --nproc_per_node=2``; ``examples/ddp_multitask.py``)::

        ddp = DistributedDataParallel(model)
        for images, masks, labels in loader:
            with graphprune.track():
                feat = ddp(images)           # a trunk and two heads
                seg_loss = bce(feat["seg"], masks)
                cls_loss = cross_entropy(feat["cls"], labels)
            graphprune.distributed.backward_each(ddp, [seg_loss, cls_loss])
            optimizer.step()
            optimizer.zero_grad()

    Misuse says what to pass:

        >>> import torch, graphprune.distributed as gpd
        >>> w = torch.ones(2, requires_grad=True)
        >>> gpd.backward_each(torch.nn.Linear(2, 2), [(w * 2).sum()])
        Traceback (most recent call last):
        ...
        TypeError: graphprune.distributed.backward_each: model must be the DistributedDataParallel wrapper ...
    """
    losses = _check_losses(losses)
    grad_tensors = _check_grad_tensors(grad_tensors, len(losses))
    _check_passes(losses, grad_tensors)
    kind = _kind_of(model)
    if kind == "ddp":
        if getattr(model, "static_graph", False):
            raise ValueError(
                f"{_CALL}: DistributedDataParallel(static_graph=True) is not supported: its first "
                "iteration all-reduces at the end of the first pass through the model's output, "
                "before the other tasks' gradients exist. Build DDP without static_graph "
                "(find_unused_parameters=True or False both work)."
            )
        return _ddp_passes(model, losses, grad_tensors, keep)
    return _fsdp_passes(model, losses, grad_tensors, keep)


def _kind_of(model) -> str:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    fsdp_module = _fsdp_module_class()
    if fsdp_module is not None and isinstance(model, fsdp_module):
        return "fsdp2"
    hint = ""
    if isinstance(model, nn.Module) and any(
        isinstance(m, DistributedDataParallel) or (fsdp_module and isinstance(m, fsdp_module))
        for m in model.modules()
    ):
        hint = " (it contains one: pass that module)"
    raise TypeError(
        f"{_CALL}: model must be the DistributedDataParallel wrapper (not its .module) or a "
        f"module made by torch.distributed.fsdp.fully_shard, got {type(model).__name__}{hint}. "
        "Without a distributed wrapper, call graphprune.backward(loss) once per loss."
    )


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed, or before FSDP2 was public (2.6)
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def _check_losses(losses) -> list[torch.Tensor]:
    if isinstance(losses, torch.Tensor) or not isinstance(losses, Sequence):
        got = "a tensor" if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise TypeError(
            f"{_CALL}: losses must be a list or tuple of the task losses, got {got}; for one "
            "loss pass [loss], for a stacked tensor list(losses.unbind())"
        )
    if not losses:
        raise ValueError(f"{_CALL}: losses is empty; pass the task losses, one backward pass each")
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{_CALL}: losses[{i}] must be a torch.Tensor, got {type(loss).__name__}")
        if loss.grad_fn is None:
            raise ValueError(
                f"{_CALL}: losses[{i}] has no grad_fn ("
                + ("it is a leaf" if loss.requires_grad else "it does not require grad: made under "
                   "torch.no_grad() or torch.inference_mode(), or from tensors that do not require grad")
                + "); there is no backward pass to run from it"
            )
    return list(losses)


def _check_passes(losses: list, grad_tensors: list) -> None:
    """What would fail in a later pass, after the earlier ones released their heads and
    wrote ``.grad``: a loss of more than one element with no gradient given, a loss
    given twice (its first pass releases its branch)."""
    seen: dict[int, int] = {}
    for i, (loss, gt) in enumerate(zip(losses, grad_tensors)):
        if gt is None and loss.numel() != 1:
            raise ValueError(f"{_CALL}: losses[{i}] has shape {tuple(loss.shape)}: a gradient can be made "
                             "implicitly only for a scalar; pass its entry of grad_tensors")
        first = seen.setdefault(id(loss), i)
        if first != i:
            raise ValueError(f"{_CALL}: losses[{i}] is losses[{first}]: pass it once (its pass releases its "
                             "branch), with torch.tensor(2.0) as its grad_tensors entry to count it twice")


def _check_grad_tensors(grad_tensors, count: int) -> list:
    if grad_tensors is None:
        return [None] * count
    if isinstance(grad_tensors, torch.Tensor) or len(grad_tensors) != count:
        got = "a tensor" if isinstance(grad_tensors, torch.Tensor) else f"{len(grad_tensors)} item(s)"
        raise ValueError(f"{_CALL}: grad_tensors must hold one entry per loss ({count}), got {got}")
    return list(grad_tensors)


def _ddp_passes(ddp, losses, grad_tensors, keep) -> list[PruneReport]:
    """NOTE [ DDP: the last pass covers every parameter once ]"""
    params = {id(p): p for p in ddp.module.parameters() if p.requires_grad}
    for node in walk([loss.grad_fn for loss in losses[:-1]]):  # 4. of the NOTE: the other leaves too
        if node.name().endswith("CheckpointFunctionBackward"):
            raise ValueError(
                f"{_CALL}: the graph has a reentrant checkpoint (checkpoint(..., use_reentrant=True)), "
                "whose region torch.autograd.grad, every pass but the last, does not run for the "
                "parameters inside: their gradients from the earlier losses would be lost. Use "
                "checkpoint(..., use_reentrant=False).")
        if is_accumulator(node) and node.variable.requires_grad:
            params.setdefault(id(node.variable), node.variable)
    params = list(params.values())
    reports, reached = [], {}
    for loss, gt in zip(losses[:-1], grad_tensors[:-1]):
        grads = grad(loss, params, gt, allow_unused=True, keep=keep)
        reports.append(last_report())
        for p, g in zip(params, grads):
            if g is not None:
                _accumulate(p, g)
                reached[id(p)] = p, g.sparse_dim() if g.layout is torch.sparse_coo else None
    roots, root_grads = [losses[-1]], [grad_tensors[-1]]
    if reached:
        sparse_dims = tuple(dims for _, dims in reached.values())
        roots.append(_ZeroGradients.apply(sparse_dims, *(p for p, _ in reached.values())))
        root_grads.append(None)
    reports.append(backward(roots, root_grads, keep=keep))
    return reports


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad += g`` as ``AccumulateGrad`` does it: take ``g`` when it is a tensor of
    its own laid out like ``p``, else copy it into one."""
    if g.layout is not torch.strided:  # a sparse embedding's: summed as AccumulateGrad sums them
        p.grad = g if p.grad is None else p.grad + g
    elif p.grad is not None:
        p.grad.add_(g)
    elif g._base is None and g.stride() == p.stride() and g.storage_offset() == 0:
        p.grad = g
    else:
        p.grad = torch.empty_like(p).copy_(g)


class _ZeroGradients(torch.autograd.Function):
    """A scalar root whose backward sends an all-zero gradient to each input: one pass
    from it runs each input's ``AccumulateGrad`` (and DDP's hook on it) once. An input
    whose gradients are sparse (``nn.Embedding(sparse=True)``: ``sparse_dims`` says how
    many sparse dims, else ``None``) gets a sparse zero, which DDP expects of it."""

    @staticmethod
    def forward(ctx, sparse_dims, *params):
        ctx.meta = [(p.shape, p.dtype, p.device, dims) for p, dims in zip(params, sparse_dims)]
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *(torch.zeros((), dtype=dtype, device=device).expand(shape) if dims is None else
                        torch.sparse_coo_tensor(torch.empty((dims, 0), dtype=torch.long, device=device),
                                                torch.empty((0, *shape[dims:]), dtype=dtype, device=device),
                                                shape, check_invariants=True)  # empty: nothing to check
                        for shape, dtype, device, dims in ctx.meta))


def _fsdp_passes(model, losses, grad_tensors, keep) -> list[PruneReport]:
    """NOTE [ FSDP2 ]"""
    groups = _fsdp_groups(model)
    before = [(g.reduce_grads, g.all_reduce_grads) for g in groups]
    reports = []
    try:
        model.set_requires_gradient_sync(False)
        for loss, gt in zip(losses[:-1], grad_tensors[:-1]):
            reports.append(backward(loss, gt, keep=keep))
    finally:
        for g, (reduce, all_reduce) in zip(groups, before):
            g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
    reports.append(backward(losses[-1], grad_tensors[-1], keep=keep))
    return reports


def _fsdp_groups(model) -> list:
    """The parameter groups whose sync flags ``set_requires_gradient_sync`` sets, to put
    back what the user had (FSDP2 has a setter and no getter)."""
    fsdp_module = _fsdp_module_class()
    groups = []
    for module in model.modules():
        if isinstance(module, fsdp_module):
            state = module._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):  # torch >= 2.10: several groups per module
                groups.extend(state._fsdp_param_groups)
            elif getattr(state, "_fsdp_param_group", None) is not None:
                groups.append(state._fsdp_param_group)
    return groups
