"""Later passes that reach a released node with an all-zero gradient.

NOTE [ Zero-gradient passes through released nodes ]
Losses stacked with ``torch.stack`` (or summed with weights that are zero for a
task) make ``losses[1].backward()`` run head 0's nodes too, with all-zero incoming
gradients (DESIGN.md fact 9). Plain PyTorch computes zeros there; a released node
has no tensors left. Backward functions are linear in the incoming gradient, so
zero in means zero out: a prehook notes that every incoming gradient is zero, the
unpack hook then hands the node a zero-stride placeholder instead of raising, and a
post-hook replaces the node's outputs with zeros (the placeholder may give NaN, as
in Div or Acos). A non-zero gradient into a released node still raises.
Hooks are keyed by node id: a closure that held the node's own wrapper would be a
reference cycle through C++.
"""

from __future__ import annotations

import functools
import threading

import torch

from ._graph import record_of

__all__ = ["guard_released", "in_zero_pass"]

_zero_pass: set[int] = set()
_lock = threading.Lock()


def _all_zero(grads) -> bool:
    return all(g is None or not bool(g.any()) for g in grads)


def _prehook(node_id: int, grad_outputs):
    if _all_zero(grad_outputs):
        with _lock:
            _zero_pass.add(node_id)
    return None


def _posthook(node_id: int, grad_inputs, grad_outputs):
    with _lock:
        if node_id not in _zero_pass:
            return None
        _zero_pass.discard(node_id)
    return tuple(None if g is None else torch.zeros_like(g) for g in grad_inputs)


def guard_released(nodes) -> None:
    """Let zero-gradient passes through each of ``nodes`` (wrappers), once per node."""
    for node in nodes:
        rec = record_of(node)
        if rec is None or rec.guarded:
            continue
        rec.guarded = True
        node.register_prehook(functools.partial(_prehook, rec.id))
        node.register_hook(functools.partial(_posthook, rec.id))


def in_zero_pass() -> bool:
    """Whether the node running now came in with all-zero gradients."""
    node = torch._C._current_autograd_node()
    rec = None if node is None else record_of(node)
    return rec is not None and rec.id in _zero_pass
