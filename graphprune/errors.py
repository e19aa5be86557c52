"""The exceptions graphprune raises: one root, a few precise subclasses."""

from __future__ import annotations

from ._marks import node_name

__all__ = [
    "GraphPruneError", "ReleasedTensorError", "InplaceModifiedError", "GraphPruneWarning", "released_message",
]


class GraphPruneError(RuntimeError):
    """Root of every error graphprune raises about the autograd graph."""


class GraphPruneWarning(UserWarning):
    """A graphprune call that works but will not give what it is for: little or nothing
    freed, or a ``keep=`` that protects nothing. Filed at the line of the call."""


class ReleasedTensorError(GraphPruneError):
    """A backward pass needed a saved tensor that a graphprune call released."""


class InplaceModifiedError(GraphPruneError):
    """A saved tensor was modified in place after it was saved.

    PyTorch skips its own version-counter check while saved-tensor hooks are set
    (``saved_variable.cpp``: "Only check version counter in the case without
    hooks"); graphprune restores it and raises this instead.
    """


def released_message(node, released_by) -> str:
    """The text of :class:`ReleasedTensorError` for a node (its ``grad_fn`` wrapper, or
    ``None``) and the call that released it (a ``Release`` that can name what to keep,
    or text)."""
    hint = getattr(released_by, "hint", None)
    hint = hint(node) if hint is not None else None
    return (
        f"graphprune: a backward pass needs a saved tensor of {node_name(node)} that was "
        f"released by {released_by or 'a graphprune call'}. "
        + (hint or "Pass keep= what a later pass runs through to that call: a later loss, or the "
           "tensor a later step builds on (h, in a loop's h = cell(x, h)); or run this backward "
           "before pruning.")
    )
