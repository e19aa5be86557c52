"""Later passes that reach a released node with an all-zero gradient.

NOTE [ Zero-gradient passes through released nodes ]
Losses stacked with ``torch.stack`` (or summed with weights that are zero for a
task) make ``losses[1].backward()`` run head 0's nodes too, with all-zero incoming
gradients (DESIGN.md fact 9). Plain PyTorch computes zeros there; a released node
has no tensors left. Backward functions are linear in the incoming gradient, so
zero in means zero out. A released node gets one pre-hook, which sees the incoming
gradients before the node runs: any non-zero one raises
:class:`ReleasedTensorError` there, before a kernel could run on a placeholder, so
never a wrong gradient and never a kernel's own error. All-zero ones mark the node
for this graph task: the unpack hook then hands it a placeholder for each released
tensor, and a post-hook (registered by the pre-hook the first time, the engine
calls it in the same pass) replaces its outputs with zeros, as the placeholder may
give NaN (Div, Log). The hooks are plain functions shared by every node: a closure
that held the node's wrapper would be a reference cycle through C++. The mark is
keyed by (the node's wrapper, graph task), so a pass that raised midway or another
thread's pass never sees a stale mark. Placeholders of floating tensors are
zero-stride (no memory); integer ones (LU pivots, indices) are contiguous ones.
"""

from __future__ import annotations

import threading

import torch

from ._marks import GUARDED, RELEASED
from .errors import ReleasedTensorError, released_message

__all__ = ["guard_released", "in_zero_pass", "placeholder"]

_ZEROING = "graphprune.zeroing"  # node.metadata key: the post-hook is registered
_zero_pass: set[tuple[int, int]] = set()  # (id of the node's wrapper, graph task id)
_lock = threading.Lock()


def _zero_or_raise(grad_outputs) -> None:
    """The pre-hook of every released node."""
    node = torch._C._current_autograd_node()
    if not all(g is None or not bool(g.any()) for g in grad_outputs):
        raise ReleasedTensorError(released_message(node, node.metadata.get(RELEASED)))
    with _lock:
        _zero_pass.add((id(node), torch._C._current_graph_task_id()))
    if _ZEROING not in node.metadata:
        node.metadata[_ZEROING] = True
        node.register_hook(_zero_outputs)


def _zero_outputs(grad_inputs, grad_outputs):
    key = (id(torch._C._current_autograd_node()), torch._C._current_graph_task_id())
    with _lock:
        if key not in _zero_pass:
            return None
        _zero_pass.discard(key)
    return tuple(None if g is None else torch.zeros_like(g) for g in grad_inputs)


def guard_released(node) -> None:
    """Let zero-gradient passes through ``node`` (a wrapper); once per node."""
    md = node.metadata
    if GUARDED not in md:
        md[GUARDED] = True
        node.register_prehook(_zero_or_raise)


def in_zero_pass(node) -> bool:
    """Whether ``node`` (running now) came in with all-zero gradients."""
    return (id(node), torch._C._current_graph_task_id()) in _zero_pass


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """What a released node gets in a zero-gradient pass instead of its tensor."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    return torch.ones(shape, dtype=dtype, device=device)
