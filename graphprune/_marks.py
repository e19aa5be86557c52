"""The marks graphprune leaves on autograd nodes, as keys of ``node.metadata``.

``node.metadata`` is a dict that lives and dies with the C++ node, so a mark costs
no object of graphprune's own and can never outlive the node (DESIGN.md fact 3).
"""

from __future__ import annotations

__all__ = ["RELEASED", "FINISHED", "GUARDED", "STRAYS", "node_name"]

RELEASED = "graphprune.released"  # lost saved tensors to a prune; the value says which call
FINISHED = "graphprune.finished"  # the root of a pruned output: it protects nothing any more
GUARDED = "graphprune.guarded"  # zero-gradient passes may run it (NOTE in _zero.py)
STRAYS = "graphprune.strays"  # a CopySlices: weak references to its hidden node's handles


def node_name(node) -> str:
    """``MulBackward0``, ``CopySlices`` (``node.name()`` without a C++ namespace)."""
    return "an autograd node" if node is None else node.name().rsplit("::", 1)[-1]
