"""Later passes that reach a released node with an all-zero gradient.

NOTE [ Zero-gradient passes through released nodes ]
Losses stacked with ``torch.stack`` (or summed with weights that are zero for a
task) make ``losses[1].backward()`` run head 0's nodes too, with all-zero incoming
gradients (DESIGN.md fact 9). Plain PyTorch computes zeros there; a released node
has no tensors left. Backward functions are linear in the incoming gradient, so
zero in means zero out: a prehook notes that every incoming gradient is zero, the
unpack hook then hands the node a zero-stride placeholder instead of raising, and a
post-hook replaces the node's outputs with zeros (the placeholder may give NaN, as
in Div or Log). A non-zero gradient into a released node still raises.
Hooks are keyed by the id of the node's wrapper, which stays the same object while
the node lives: a closure that held the wrapper itself would be a reference cycle
through C++. The zero mark is keyed by (node, graph task), so a
node that raised mid-pass, or another thread's pass, never sees a stale mark.
Placeholders of floating tensors are zero-stride (no memory); integer ones (LU
pivots, indices) are contiguous ones, which the kernels that read them accept.
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["guard_released", "in_zero_pass"]

GUARDED = "graphprune.guarded"  # node.metadata key: the hooks are registered
_zero_pass: set[tuple[int, int]] = set()  # (id of the node's wrapper, graph task id)
_lock = threading.Lock()


def _all_zero(grads) -> bool:
    return all(g is None or not bool(g.any()) for g in grads)


def _prehook(node_id: int, grad_outputs):
    key = (node_id, torch._C._current_graph_task_id())
    with _lock:
        if _all_zero(grad_outputs):
            _zero_pass.add(key)
        else:
            _zero_pass.discard(key)
    return None


def _posthook(node_id: int, grad_inputs, grad_outputs):
    key = (node_id, torch._C._current_graph_task_id())
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
        node.register_prehook(functools.partial(_prehook, id(node)))
        node.register_hook(functools.partial(_posthook, id(node)))


def in_zero_pass() -> bool:
    """Whether the node running now came in with all-zero gradients."""
    node = torch._C._current_autograd_node()
    return node is not None and (id(node), torch._C._current_graph_task_id()) in _zero_pass


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """What a released node gets in a zero-gradient pass instead of its tensor."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    return torch.ones(shape, dtype=dtype, device=device)
