"""The marks graphprune leaves on autograd nodes, as keys of ``node.metadata``.

``node.metadata`` is a dict that lives and dies with the C++ node, so a mark costs
no object of graphprune's own and can never outlive the node (DESIGN.md fact 3).
"""

from __future__ import annotations

__all__ = ["RELEASED", "FINISHED", "GUARDED"]

RELEASED = "graphprune.released"  # lost saved tensors to a prune; the value says which call
FINISHED = "graphprune.finished"  # the root of a pruned output: it protects nothing any more
GUARDED = "graphprune.guarded"  # zero-gradient passes may run it (NOTE in _zero.py)
