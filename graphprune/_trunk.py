"""The trunk a prune keeps, walked once: within a prune, and across the prunes of the
heads built on it.

NOTE [ The trunk walked once ]
``keep=x`` protects ``x``'s graph, the trunk, which the walk from ``y`` also runs
through: walked twice per prune, and again at the next head's prune. So the trunk is
walked first (the protected walk), and the walk from ``y`` stops where it meets it.
What the walk from ``y`` would have found is then exactly the two walks together when
``x``'s node is among the nodes it met, with the support the trunk's walk started
from (``x`` a slice of a ``stack``: the part it covers), every other routing node of the
trunk it met with no more support than the trunk's walk gave it, and the trunk's walk
stopped at no released node (a walk from ``y`` goes on through one). Otherwise the
whole walk from ``y`` runs, as it does for several protected roots (``keep=None``'s
pending losses, a list). A trunk node that does not route passes ``ALL`` on whatever
it got, so the walks below it are the same, but the support it got is what a pass ran
through of a vector of losses there (NOTE [ Supports at every node a router feeds ] in
``_graph.py``): it keeps the support of both walks (``L = torch.stack(losses) * 1.0``,
``x = L[1]`` and ``y = L[0] + x + L[2]``: every entry of ``L``).

The trunk's walk is left in ``x``'s node's metadata for the next prune with the same
``keep=x``: the nodes below ``x``'s node (never that node itself: its metadata holding
its own wrapper would be a reference cycle through C++) and the routing supports the
walk found. The edges below a node never change, and prunes only ever add released
marks, so it stays exact while no node of it has been released since (each release
tells the walks left, ``released``). A walk of more than ``LEAVE_AT_MOST`` nodes is not
left: what it holds (~150 B a node, with the measure below) stays bounded. Holding the
wrappers changes no teardown: the root's node dies first, with its metadata, and a
200k-node chain tore down safely with its walk left (``tests/test_depth.py``).

What the trunk keeps (its nodes and bytes by reason, for the report) is measured by
the first prune and left with the walk: a later head's prune (or ``prune_after`` after
``explain``) reads its head only. It holds the handles weakly (~0.1 µs a handle, what
a graph pruned once pays for it): a pass that did not retain the graph frees some with
no mark, and the next prune measures again.
"""

from __future__ import annotations

import itertools
import weakref

from ._graph import LOCK, TRACKED, _is_router, reach
from ._marks import RELEASED, weakly_add
from ._report import storage_bytes
from ._routing import widen

__all__ = ["walk_trunk_once", "released"]

_TRUNK = "graphprune.trunk"  # node.metadata key: the protected walk below this node
LEAVE_AT_MOST = 1 << 16  # nodes of a walk left for later prunes


class _Walked:
    """A protected walk, kept on its root's metadata (without the root), and what its
    nodes keep, once a prune has measured it."""

    __slots__ = ("start", "below", "supports", "own_support", "stale", "kept", "__weakref__")

    def __init__(self, root, start, protected: dict, supports: dict) -> None:
        self.start = start  # the output number the walk started on, or None: every output
        self.below = dict.fromkeys(protected, 0)
        self.below.pop(root, None)
        self.supports = {node: dict(s) for node, s in supports.items() if node is not root}
        own = supports.get(root)
        self.own_support = None if own is None else dict(own)  # no node in it
        self.stale = False  # a node of it was released since it ran (``released``)
        self.kept: _Kept | None = None
        with LOCK:
            weakly_add(_walks, self)

    def measured(self, classify, foreign) -> _Kept:
        """What the nodes below the root keep, by reason: measured again only where a
        handle it counted has gone since (released, or freed by a pass that did not
        retain the graph). ``classify`` is ``_plan._classify_kept``: the walk labels
        every node below the root with the root's number, 0; ``foreign`` is the reason
        it gives the nodes whose tensors other saved-tensor hooks hold."""
        kept = self.kept
        if kept is None or not kept.valid():
            part = classify(self.below, 0)
            # a node whose tensors other hooks or PyTorch hold has no handle to tell
            # that a plain pass freed them: such a trunk is measured at every prune
            kept = _Kept(part, held=part.kinds <= {TRACKED}, foreign=foreign)
            if kept.held:
                self.kept = kept
        return kept

    def walk(self, root) -> tuple[dict, dict]:
        supports = {node: dict(s) for node, s in self.supports.items()}
        if self.own_support is not None:
            supports[root] = dict(self.own_support)
        return {root: 0, **self.below}, supports


class _Kept:
    """The kept part of a ``_plan._Part`` of nodes below a root: counts and node ids by
    reason, the bytes of the storages behind its handles that are no parameter or input
    (stable while the handles live), the handles that are (whether the graph alone
    holds one is read again each time). ``held`` (kept for later prunes): those
    handles weakly, and a weak reference to every handle, to tell that none has gone."""

    __slots__ = ("counts", "ids", "storages", "held", "_leaves", "_refs", "_gone", "kinds", "foreign")

    def __init__(self, part, held: bool, foreign) -> None:
        self.counts = {key: len(nodes) for key, nodes in part.kept_nodes.items()}
        self.ids = {key: frozenset(map(id, nodes)) for key, nodes in part.kept_nodes.items()}
        self.storages, self._leaves, self._refs, self.held = {}, {}, [], held
        gone = self._gone = [False]  # a handle died: a closure, no cycle through self

        def died(_ref, gone=gone):
            gone[0] = True

        for key in part.kept_nodes:
            live = part.kept_by.get(key, ())
            leaves = [h for h in live if h.leaf]
            self.storages[key] = storage_bytes([h for h in live if not h.leaf] if leaves else live)
            if held:
                self._leaves[key] = [weakref.ref(h) for h in leaves]
                self._refs += map(weakref.ref, live, itertools.repeat(died))
            else:  # read once, by this prune
                self._leaves[key] = leaves
        self.kinds = set(part.kinds)
        self.foreign = part.kept_nodes.get(foreign, [])

    def valid(self) -> bool:
        """Whether every handle it counted is still there: none died (a pass that did
        not retain the graph freed it). One released is a node marked released, which
        made the walk stale (``released``), and this with it."""
        return not self._gone[0]

    def leaves(self) -> dict:
        """``{reason: [handle, ...]}`` of the parameters, inputs and masks it holds."""
        if not self.held:
            return {key: leaves for key, leaves in self._leaves.items() if leaves}
        return {key: [ref() for ref in refs] for key, refs in self._leaves.items() if refs}


_walks: set = set()  # weak references to the walks left on nodes (``_marks.weakly_add``)


def released(nodes) -> None:
    """``nodes`` were just marked released: the walks left that hold one are stale."""
    with LOCK:
        for ref in list(_walks):
            walk = ref()
            if walk is not None and not walk.stale and not walk.below.keys().isdisjoint(nodes):
                walk.stale = True


def _trunk_walk(fn, nr, start_supports: dict) -> tuple[dict, dict, _Walked | None]:
    """``(protected, supports, walk)`` of the walk from ``fn`` that stops at released
    nodes, from the walk left on ``fn`` where it is still exact; ``walk`` is ``None``
    where it stopped at a released node."""
    with LOCK:
        md = fn.metadata
        left = md.get(_TRUNK)  # the root released since: never walked through (``reach``)
        if left is not None and left.start == nr and not left.stale and RELEASED not in md:
            return (*left.walk(fn), left)
        skipped: list = []
        protected = reach([fn], through_released=False, supports=start_supports, skipped=skipped)
        if skipped:
            return protected, start_supports, None
        walked = _Walked(fn, nr, protected, start_supports)
        if len(protected) <= LEAVE_AT_MOST:
            md[_TRUNK] = walked
        return protected, start_supports, walked


def walk_trunk_once(tops: list, root: tuple, start_supports: dict, y_supports: dict) -> tuple:
    """``(reach, protected, walk, head)`` of a prune from ``tops`` (``(node, output
    number)``) whose one protected root is ``root`` (``(node, output number or None,
    text)``), its walk starting with ``start_supports``; ``(None, protected, None,
    None)`` where the walk from ``tops`` needs the whole graph after all. ``walk``
    measures the trunk below the root; ``head`` is the rest, the root among it.
    ``y_supports`` is filled as the walk from ``tops`` fills it (NOTE [ The trunk
    walked once ])."""
    fn, nr, _ = root
    protected, trunk_supports, walk = _trunk_walk(fn, nr, start_supports)
    if walk is None:
        return None, protected, None, None
    supports = {node: dict(s) for node, s in y_supports.items()}
    walked = reach([f for f, _ in tops], supports=supports, stop=protected)
    if fn not in walked:
        return None, protected, None, None
    for node, support in supports.items():
        if node in protected and _is_router(node) and not _within(support, trunk_supports.get(node),
                                                                    exactly=node is fn):
            return None, protected, None, None
    head = [node for node in walked if node not in protected or node is fn]
    walked.update(protected)  # the labels of a reach are not read: its nodes, in order
    y_supports.update(supports)
    for node, support in trunk_supports.items():  # a trunk node both walks met has both supports
        met = supports.get(node)
        if met is None:
            y_supports[node] = support
        else:  # a node a router feeds (``L = torch.stack(losses) * w``, ``x = L[1]``): what the pass
            both = dict(support)  # from y runs through of L is read there (``_plan._split_live``)
            for nr, s in met.items():
                widen(both, nr, s)
            y_supports[node] = both
    return walked, protected, walk, head


def _within(support: dict, trunk: dict | None, exactly: bool) -> bool:
    """Whether a routing node's ``support`` from the walk from ``y`` is no more than the
    trunk's walk gave it (``exactly``: the same)."""
    if trunk is None:
        return False
    if exactly:
        return support == trunk
    return not any(widen(dict(trunk), nr, s) for nr, s in support.items())
