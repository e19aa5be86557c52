"""The marks graphprune leaves on autograd nodes, as keys of ``node.metadata``.

``node.metadata`` is a dict that lives and dies with the C++ node, so a mark costs
no object of graphprune's own and can never outlive the node (DESIGN.md fact 3).
"""

from __future__ import annotations

import weakref

__all__ = [
    "RELEASED", "FINISHED", "GUARDED", "STRAYS", "HOOKED", "node_name", "marking_released", "none_released",
    "mark_hooked", "is_hooked", "is_function",
]

RELEASED = "graphprune.released"  # lost saved tensors to a prune; the value says which call
FINISHED = "graphprune.finished"  # the root of a pruned output: it protects nothing any more
GUARDED = "graphprune.guarded"  # zero-gradient passes may run it (NOTE in _zero.py); the value: which call
STRAYS = "graphprune.strays"  # a CopySlices: weak references to its hidden node's handles
HOOKED = "graphprune.hooked"  # a tensor hook was registered on an output of it under track()


# NOTE [ No node released ]
# A walk that stops at released nodes asks each node that saves tensors for its
# metadata, and a node's first ``metadata`` read makes its dict (the walk of a fresh
# small transformer's trunk, 221 nodes: 0.79 ms reading them, 0.65 without). A
# released node's metadata holds the reason it was released under ``RELEASED``, and
# every reason written there is in ``_marked`` (weakly) while it lives: while the set
# is empty no live node carries the mark, and such a walk reads no metadata. Handles
# and plans that hold a reason only keep it longer.
#
# These sets hold weak references, each taken with the set's own ``discard`` as its
# callback, rather than being ``weakref.WeakSet``s: a ``WeakSet`` adds, counts and
# iterates in Python, and a prune asks several of them right after a backward pass,
# when every code path it runs is out of the CPU's caches (NOTE [ What a prune pays
# first ] in ``_plan.py``).
_marked: set = set()


def weakly_add(refs: set, obj) -> None:
    """Add a weak reference to ``obj`` to the set ``refs``; it leaves with ``obj``."""
    refs.add(weakref.ref(obj, refs.discard))


def marking_released(reason) -> None:
    """``reason`` (an object that takes a weak reference) is about to be written on
    nodes as their ``RELEASED`` mark (NOTE [ No node released ])."""
    weakly_add(_marked, reason)


def none_released() -> bool:
    """Whether no live node is marked released (NOTE [ No node released ])."""
    return not _marked


class _Hooked:
    """The mark of a node whose tensors had hooks registered (``register_hook``) under
    ``track()``: held by the node's metadata, and weakly in ``_hooked``, so that "no
    node alive is marked" is one check (as NOTE [ No node released ])."""

    __slots__ = ("__weakref__",)


_hooked: set = set()  # weak references to the live marks (NOTE [ No node released ])


def mark_hooked(node) -> None:
    """A hook was registered on an output of ``node`` (NOTE [ Hooks at the cut ] in
    ``_each.py``): it runs wherever that output's gradient arrives, while the node
    lives, however long the tensor does."""
    md = node.metadata
    if HOOKED not in md:
        md[HOOKED] = mark = _Hooked()
        weakly_add(_hooked, mark)


def is_hooked(node) -> bool:
    """Whether a hook registered under ``track()`` watches an output of ``node``."""
    return bool(_hooked) and HOOKED in node.metadata


def node_name(node) -> str:
    """``MulBackward0``, ``CopySlices`` (``node.name()`` without a C++ namespace)."""
    return "an autograd node" if node is None else node.name().rsplit("::", 1)[-1]


def is_function(node, name: str, module: str) -> bool:
    """Whether ``node`` is the backward of the ``autograd.Function`` ``module.name``
    (told by name: no import of the module for it)."""
    forward = getattr(type(node), "_forward_cls", None)
    return forward is not None and forward.__name__ == name and forward.__module__ == module
