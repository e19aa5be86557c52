"""Later passes that reach a released node with an all-zero gradient.

NOTE [ Zero-gradient passes through released nodes ]
Losses stacked with ``torch.stack`` (or summed with weights that are zero for a
task) make ``losses[1].backward()`` run head 0's nodes too, with all-zero incoming
gradients (DESIGN.md fact 9). Plain PyTorch computes zeros there; a released node
has no tensors left. Backward functions are linear in the incoming gradient, so
zero in means zero out: the unpack hook hands a guarded node a placeholder for each
released tensor, and the node's post-hook, which sees the incoming gradients,
replaces its outputs with zeros (the placeholder may give NaN, as in Div or Log) or,
if any incoming gradient is non-zero, raises :class:`ReleasedTensorError`: never a
wrong gradient. One post-hook per node, a plain function shared by all nodes: a
closure that held the node's wrapper would be a reference cycle through C++.
Placeholders of floating tensors are zero-stride (no memory); integer ones (LU
pivots, indices) are contiguous ones, which the kernels that read them accept.
"""

from __future__ import annotations

import torch

from ._marks import GUARDED, RELEASED
from .errors import ReleasedTensorError, released_message

__all__ = ["guard_released", "placeholder"]


def _all_zero(grads) -> bool:
    return all(g is None or not bool(g.any()) for g in grads)


def _zero_in_zero_out(grad_inputs, grad_outputs):
    """The post-hook of every released node (one function, no closure: DESIGN.md fact 9)."""
    if _all_zero(grad_outputs):
        return tuple(None if g is None else torch.zeros_like(g) for g in grad_inputs)
    node = torch._C._current_autograd_node()
    raise ReleasedTensorError(released_message(node.name(), node.metadata.get(RELEASED)))


def guard_released(node) -> None:
    """Let zero-gradient passes through ``node`` (a wrapper); once per node."""
    md = node.metadata
    if GUARDED not in md:
        md[GUARDED] = True
        node.register_hook(_zero_in_zero_out)


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """What a released node gets in a zero-gradient pass instead of its tensor."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    return torch.ones(shape, dtype=dtype, device=device)
