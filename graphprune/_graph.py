"""A networkx model of the ``grad_fn`` graph, built without holding the graph alive.

Every node graphprune has seen carries a :class:`NodeRecord` in ``node.metadata``.
The model (a ``networkx.DiGraph`` of integer ids; edges follow ``next_functions``)
holds no wrapper and no tensor, only ids, names and weak references to the
:class:`~graphprune._saved.SavedHandle` objects a node owns. When the C++ node dies,
its metadata dies with it and the record's ``__del__`` tells the model.

NOTE [ Deep graphs and Python wrappers ]
On torch 2.13 a ``grad_fn`` wrapper, once created, is kept by its C++ node, and a
chain of wrapped nodes is destroyed by recursing through the wrappers' deallocs:
~50k nodes overflow the C stack (DESIGN.md fact 12). Walking the graph needs the
wrappers, so each record also holds its children's wrappers, and when it dies it
hands them to a thread-local queue that one loop drains. Each node then dies
alone, as PyTorch's own iterative teardown would have it.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from ._saved import SavedHandle

__all__ = ["NodeRecord", "GraphModel", "MODEL", "record_of", "stamp", "walk"]

_KEY = "graphprune"
_ids = itertools.count(1)
_local = threading.local()


def _teardown_queue() -> collections.deque:
    queue = getattr(_local, "teardown", None)
    if queue is None:
        queue = _local.teardown = collections.deque()
        _local.draining = False
    return queue


def pending_handles() -> dict[int, list[weakref.ref]]:
    """This thread's saved handles not yet claimed by a node, by sequence number."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = {}
    return pending


class NodeRecord:
    """What graphprune knows about one autograd node; lives in ``node.metadata``."""

    __slots__ = ("id", "name", "children", "guarded")

    def __init__(self, node_id: int, name: str, children: list):
        self.id = node_id
        self.name = name
        self.children = children  # wrappers; see NOTE [ Deep graphs and Python wrappers ]
        self.guarded = False  # zero-pass hooks registered; see _zero.py

    def __del__(self) -> None:
        try:
            MODEL.mark_dead(self.id)
            queue = _teardown_queue()
            queue.append(self.children)
            self.children = None
            if _local.draining:
                return
            _local.draining = True
            try:
                while queue:
                    queue.popleft()
            finally:
                _local.draining = False
        except Exception:  # interpreter shutdown: module globals may be gone
            pass


def walk(roots):
    """Every node reachable from ``roots`` (wrappers), once each; a stack, never recursion."""
    seen = set()
    stack = [n for n in roots if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:  # a wrapper stays the same object while its node lives
            continue
        seen.add(id(node))
        yield node
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def record_of(node) -> NodeRecord | None:
    """The record stamped on ``node``, or ``None`` if graphprune has not seen it."""
    return node.metadata.get(_KEY)


class GraphModel:
    """The live tracked graph of this process, keyed by node id."""

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self.lock = threading.RLock()
        self._dead: collections.deque[int] = collections.deque()
        self.released: set[int] = set()  # nodes that lost saved tensors to a prune
        self.finished: set[int] = set()  # root nodes of pruned outputs

    def mark_dead(self, node_id: int) -> None:
        self._dead.append(node_id)  # atomic; may run in any thread, inside any call

    def purge(self) -> None:
        """Forget the nodes whose C++ node has died."""
        with self.lock:
            while self._dead:
                node_id = self._dead.popleft()
                if node_id in self.graph:
                    self.graph.remove_node(node_id)
                self.released.discard(node_id)
                self.finished.discard(node_id)

    def add(self, nodes: list[tuple[int, dict, list[int]]]) -> None:
        """Add new nodes ``(id, attributes, child ids)``; each child is new or known.

        This runs for every autograd node built under ``track()``, so it fills
        networkx's adjacency dicts directly (the layout ``DiGraph`` documents:
        ``_node``, ``_succ``, ``_pred``) instead of paying ``add_node``/``add_edge``.
        """
        g = self.graph
        node, succ, pred = g._node, g._succ, g._pred
        with self.lock:
            if len(self._dead) > 4096:
                self.purge()
            for n, attrs, _ in nodes:
                node[n] = attrs
                succ[n] = {}
                pred[n] = {}
            for n, _, children in nodes:
                out = succ[n]
                for child in children:
                    out[child] = pred[child][n] = {}
            nx._clear_cache(g)

    def reach(self, sources: Iterable[int], through_released: bool = True) -> dict[int, int]:
        """Nodes reachable from ``sources`` (themselves included), each with the
        first source that reached it (breadth-first, sources in the given order).

        With ``through_released=False`` the walk stops at nodes that lost saved
        tensors: a pass that reaches one with a non-zero gradient raises, so nothing
        behind it can be used that way (a zero-gradient pass needs nothing kept).
        """
        succ = self.graph._succ
        stop = () if through_released else self.released
        owner: dict[int, int] = {}
        queue = collections.deque()
        for s in sources:
            if s in succ and s not in owner and s not in stop:
                owner[s] = s
                queue.append(s)
        while queue:
            n = queue.popleft()
            label = owner[n]
            for m in succ[n]:
                if m not in owner and m not in stop:
                    owner[m] = label
                    queue.append(m)
        return owner

    def live_handles(self, node_id: int) -> list[SavedHandle]:
        refs = self.graph._node[node_id]["handles"]
        return [h for h in (r() for r in refs) if h is not None and not h.released]

    def attach(self, node_id: int, refs: list[weakref.ref]) -> None:
        """Give ``node_id`` handles that no node's sequence number claimed."""
        attrs = self.graph._node[node_id]
        attrs["handles"] = [*attrs["handles"], *refs]
        attrs["foreign"] = False


MODEL = GraphModel()


def stamp(
    root, tape_id: int | None = None, foreign: bool = False, since: int = 0, window: range = range(0)
) -> int:
    """Record ``root`` and every node below it not seen before; return ``root``'s id.

    Nodes are walked with a stack, never recursion. A node gets the saved handles
    this thread packed under its sequence number (DESIGN.md fact 4), so a node must
    first be seen in the thread that built it. ``tape_id`` is the tape whose forward
    built the node if its sequence number is at least ``since`` (older nodes were
    built before the tape opened); ``None`` leaves nodes untracked unless they own
    handles. ``foreign`` marks nodes built while other hooks were innermost.
    ``window`` holds the sequence numbers of the torch call that made ``root``:
    handles packed in it that no visible node claims belong to the ``CopySlices``
    it made (which hides the in-place op on a view that saved them), else to
    ``root`` (an in-place op whose saved clone took the next sequence number).
    """
    rec = root.metadata.get(_KEY)
    if rec is not None:  # the common case: seen before
        return rec.id
    with MODEL.lock:  # two threads may reach the same unstamped nodes
        return _stamp_new(root, tape_id, foreign, since, window)


def _stamp_new(root, tape_id, foreign, since, window) -> int:
    found = []
    stack = [root]
    while stack:
        node = stack.pop()
        if _KEY in node.metadata:
            continue
        children = [fn for fn, _ in node.next_functions if fn is not None]
        rec = NodeRecord(next(_ids), node.name().rsplit("::", 1)[-1], children)
        node.metadata[_KEY] = rec
        found.append((rec, node, children))
        stack.extend(children)
    pending = pending_handles()
    new = []
    for rec, node, children in found:
        seq = node._sequence_nr()
        handles = _alive(pending.pop(seq, ())) or ()
        for ref in handles:
            ref().node_name = rec.name
        if handles:
            owner_tape = handles[0]().tape_id
        else:
            owner_tape = tape_id if seq >= since else None
        attrs = {"op": rec.name, "tape": owner_tape, "handles": handles, "foreign": foreign and not handles}
        new.append((rec.id, attrs, [c.metadata[_KEY].id for c in children]))
    MODEL.add(new)
    owner = _stray_owner(found, root, window)
    if owner is not None:
        stray = [r for seq in window for r in _alive(pending.pop(seq, ()))]
        if stray:
            for ref in stray:
                ref().node_name = owner.name
            MODEL.attach(owner.id, stray)
    return root.metadata[_KEY].id


def _stray_owner(found: list, root, window: range) -> NodeRecord | None:
    """The new node that owns the handles of a call that no node claimed."""
    for rec, node, _ in found:
        if rec.name == "CopySlices" and node._sequence_nr() in window:
            return rec
    if found and root._sequence_nr() in window:
        return found[0][0]
    return None


def _alive(refs) -> list[weakref.ref]:
    return [r for r in refs if r() is not None]
