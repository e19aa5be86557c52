"""The autograd graph as graphprune sees it, read from the nodes when a prune needs it.

NOTE [ Lazy records ]
The forward builds nothing per node (NOTE [ What the forward pays ] in ``_saved.py``).
A prune, ``explain`` or ``graph()`` walks the ``grad_fn`` wrappers and reads what it
needs from the nodes themselves:

- a node's saved tensors from ``node._raw_saved_*``, which returns the pack hook's
  object without unpacking it (under ``checkpoint`` nothing is recomputed, DESIGN.md
  fact 13); read again on every walk, never cached: a handle cached on the node
  would outlive a plain ``backward()`` that freed it, and keep its tensor;
- its children from ``next_functions``, on every walk: edges never change, and
  reading them costs less than a cache of them would (a deep walk leaves one, for
  the teardown, below);
- the marks prunes leave (released, finished, guarded) as metadata keys.

Each walked node costs its wrapper: no record object, no tensor, nothing that
outlives the node. A node is identified by its wrapper, which
stays the same object while the node lives.

``CopySlices`` (an in-place op on a view) hides the node that saved the tensors;
the output recorder collects the handles packed during such a call and gives them
to the CopySlices it made (``attach_hidden``), in its metadata.

NOTE [ Deep graphs and Python wrappers ]
On torch 2.13 a ``grad_fn`` wrapper, once created, is kept by its C++ node, and a
chain of wrapped nodes is destroyed by recursing through the wrappers' deallocs:
~50k nodes overflow the C stack (DESIGN.md fact 12). Walking the graph creates the
wrappers, so a walk of ``DEEP`` nodes or more leaves in each node's metadata dict
its children's wrappers (``children``): a node's death then goes through a dict
dealloc, which CPython's trashcan defers once 50 of them are nested, and the
teardown unwinds instead of recursing 200k levels.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from . import _routing
from ._marks import RELEASED, STRAYS, node_name, none_released
from ._routing import ALL
from ._saved import SavedHandle

if TYPE_CHECKING:
    from torch.autograd.graph import Node

__all__ = [
    "LOCK", "TRACKED", "FOREIGN", "UNTRACKED", "NOTHING_SAVED", "children", "saved", "saved_attributes",
    "saves_nothing", "saves_one", "is_accumulator",
    "live_handles", "saves_its_output", "was_freed", "reach", "walk", "along_every_edge",
    "name", "attach_hidden",
]

_CHILDREN = "graphprune"
_saved_names: dict[type, tuple[str, ...]] = {}
NOTHING_SAVED: tuple = ()  # saved() of a node type that saves nothing: no list made
saves_nothing: set[type] = set()  # the node types saved_attributes found no _raw_saved_* on
saves_one: dict[type, str] = {}  # the node types that save one tensor: where
_first = operator.itemgetter(0)
_SavedTensor = torch._C._autograd.SavedTensor
LOCK = threading.RLock()  # two threads may walk the same nodes

TRACKED, FOREIGN, UNTRACKED = "tracked", "foreign", "untracked"
_SCALAR_DTYPES = (torch.float64, torch.int64, torch.complex128, torch.bool)


def children(node) -> tuple:
    """``node``'s children (wrappers), left in its metadata on the first call (NOTE
    [ Deep graphs and Python wrappers ]): a lone child as itself, so that a chain
    costs no tuple per node."""
    md = node.metadata
    kids = md.get(_CHILDREN)
    if kids is not None:
        return kids if type(kids) is tuple else (kids,)
    return _leave_children(md, node.next_functions)


def _leave_children(md: dict, edges: tuple) -> tuple:
    """Leave the children of the node whose ``metadata`` is ``md``, from its
    ``next_functions`` ``edges``, there; return them."""
    if len(edges) == 1 and edges[0][0] is not None:  # a chain's node: no tuple to make
        md[_CHILDREN] = child = edges[0][0]
        return (child,)
    kids = tuple(filter(None, map(_first, edges)))
    md[_CHILDREN] = kids[0] if len(kids) == 1 else kids
    return kids


name = node_name


def reach(roots, through_released: bool = True, supports: dict | None = None, stop=None,
          skipped: list | None = None) -> dict[Node, int]:
    """Every node reachable from ``roots`` (wrappers; ``None`` skipped), breadth-first,
    each with the index of the first root that reached it.

    Edges that can only carry zeros are not followed (NOTE [ Gradient routing ] in
    ``_routing.py``): ``supports`` maps a routing node to ``{output number: support}``;
    given, it says on which outputs (and where) the routing roots start (a routing
    root missing from it starts on every output), and it is filled with what the walk
    found: for the routing nodes, and for every other node a routing node feeds
    (NOTE [ Supports at every node a router feeds ]); a node missing from it got
    ``ALL`` on every output the walk reached.

    With ``through_released=False`` the walk stops at nodes that lost saved tensors:
    a pass that reaches one with a non-zero gradient raises, so nothing behind it
    can be used that way (a zero-gradient pass needs nothing kept); ``skipped``, if
    given, gets each node it did not enter for that. Nodes in ``stop`` are reached
    but not walked through.

    A walk of fewer than ``DEEP`` nodes leaves nothing on the nodes: no chain it
    wrapped can be longer than the walk. A longer walk leaves every node's children
    in its metadata (NOTE [ Deep graphs and Python wrappers ]), from the edges it read
    (``next_functions`` makes a tuple per edge: read once a node).
    """
    out: dict = {}
    sup: dict = {} if supports is None else supports
    queue: list = []  # breadth-first: read in order while the walk appends
    read: list = []  # the edges of queue[:len(read)] (None: not read), while the walk is not deep
    deep = False
    limit = DEEP  # the walk's size at which it turns deep; then never again
    rule_of = _routing.BY_TYPE.get  # rule_for, its cache read inline: one lookup per node
    rule_for = _routing.rule_for
    unknown = _routing.UNKNOWN
    add = queue.append
    never_released = saves_nothing
    stopping = stop is not None
    with LOCK:
        if not through_released and none_released():  # no metadata to read: NOTE [ No node released ]
            through_released = True
        for i, node in enumerate(roots):
            if node is not None and node not in out:
                if not through_released and RELEASED in node.metadata:
                    if skipped is not None:
                        skipped.append(node)
                    continue
                out[node] = i
                add(node)
                if node not in sup and _is_router(node):
                    sup[node] = _routing.every_output(node)
        for node in queue:
            if stopping and node in stop:
                if not deep:
                    read.append(None)
                continue
            label = out[node]
            rule = rule_of(type(node), unknown)
            if rule is unknown:
                rule = rule_for(type(node))
            if rule is None:
                edges = node.next_functions  # no cache read: the edges never change
                if deep:
                    md = node.metadata
                    if _CHILDREN not in md:
                        _leave_children(md, edges)
                else:
                    read.append(edges)
                for child, _ in edges:
                    if child is None:
                        continue
                    if child not in out:
                        # a node type that saves nothing is never released: no metadata dict made
                        if through_released or type(child) in never_released or RELEASED not in (
                                child.metadata):
                            out[child] = label
                            add(child)
                            child_rule = rule_of(type(child), unknown)
                            if child_rule is unknown:
                                child_rule = rule_for(type(child))
                            if child_rule is not None:
                                sup[child] = dict.fromkeys(_edge_numbers(node, child), ALL)
                        elif skipped is not None:
                            skipped.append(child)
                    elif child in sup and _widen_all(sup[child], _edge_numbers(node, child)) and (
                            rule_of(type(child)) is not None):
                        add(child)
            else:
                if deep:
                    children(node)
                else:
                    read.append(None)  # the rule reads them
                for child, nr, support in rule(node, sup[node]):
                    if child not in out:
                        if through_released or RELEASED not in child.metadata:
                            out[child] = label
                            add(child)
                            sup[child] = {nr: support}  # a node that does not route too: NOTE [ Supports
                        elif skipped is not None:  # at every node a router feeds ]
                            skipped.append(child)
                    elif child in sup and _routing.widen(sup[child], nr, support) and (
                            rule_of(type(child)) is not None):  # a node that does not route passes ALL on
                        add(child)  # whatever its support: walked again for nothing
            if len(out) >= limit:
                deep, limit = True, float("inf")
                for walked, edges in zip(queue, read):  # those whose edges it read
                    md = walked.metadata
                    if _CHILDREN not in md:
                        if edges is None:
                            children(walked)
                        else:
                            _leave_children(md, edges)
                for walked in queue[len(read):]:  # not read yet
                    children(walked)
                read = None
    return out


# NOTE [ Supports at every node a router feeds ]
# A node that does not route passes ``ALL`` to its children whatever it gets, so the
# walk needs the supports of routing nodes only. But what a pass ran through of a live
# tensor is read from the support at its node (``_plan._split_live``), and a routing
# node's child may be such a tensor's node without routing itself: ``L = buf[1:]``
# item-assigned (the view's node is an ``AsStridedBackward0`` over the base's
# ``CopySlices``), or ``L = torch.stack(losses) * w``; a pass from ``L[0]`` runs
# through entry 0 of ``L`` only, and the rest of ``L`` is a later pass's start. Read
# as ``ALL``, it would have been counted finished, and its graph released. So the walk
# keeps the support every node a routing node feeds got, widened to ``ALL`` where
# another edge reaches it; below such a node the walk goes on with ``ALL``. Only a
# 1-d tensor is read so (a vector of losses): a pass from ``logits[:, :-1]`` (a causal
# LM's shift) runs through the held logits, whose last position no later pass starts
# from.


def _is_router(node) -> bool:
    return _routing.rule_for(type(node)) is not None


def _edge_numbers(parent, child) -> list[int]:
    """The outputs of ``child`` that ``parent``'s edges feed."""
    return [nr for c, nr in parent.next_functions if c is child]


def _widen_all(supports: dict, numbers) -> bool:
    grew = False
    for nr in numbers:
        grew = _routing.widen(supports, nr, ALL) or grew
    return grew


DEEP = 4096  # a chain of 20k wrapped nodes was torn down safely (DESIGN.md fact 12)


def walk(roots) -> list:
    """Every node reachable from ``roots`` (wrappers), once each; a queue, never recursion."""
    return list(reach(roots))


def along_every_edge(roots, stop=frozenset()) -> dict:
    """Every node below ``roots`` along every edge, as the engine runs them (a routing
    node's edges that can only carry zeros included, where :func:`reach` does not follow
    them), breadth-first, as the keys of a dict; nodes in ``stop`` neither entered nor
    counted. ``children`` caches each node's children on it (NOTE [ Deep graphs and
    Python wrappers ])."""
    seen = dict.fromkeys(node for node in roots if node is not None and node not in stop)
    queue = list(seen)
    for node in queue:
        for child in children(node):
            if child not in seen and child not in stop:
                seen[child] = None
                queue.append(child)
    return seen


# -- saved tensors --------------------------------------------------------------------
def is_accumulator(node) -> bool:
    """Whether ``node`` is a leaf's ``AccumulateGrad`` (it has the leaf as ``variable``)."""
    return hasattr(node, "variable")


def saved(node) -> tuple[list[SavedHandle], str]:
    """The handles ``node`` saved (live or released), and its kind: ``"tracked"``
    (graphprune holds its saved tensors, or it saved none), ``"foreign"`` (other
    saved-tensor hooks hold them: checkpoint, save_on_cpu) or ``"untracked"`` (built
    outside ``track()``: PyTorch holds them)."""
    names = _saved_names.get(type(node))
    if names is None:
        names = saved_attributes(type(node))
    if not names:  # most nodes of a model (views, adds, AccumulateGrad) save nothing
        return NOTHING_SAVED, TRACKED
    if len(names) == 1 and names[0] is not STRAYS:  # one saved tensor, without the loop
        try:
            value = getattr(node, names[0])
        except RuntimeError:  # freed by a pass that did not retain the graph
            return [], TRACKED
        if type(value) is _SavedTensor and type(p := value.data) is SavedHandle:
            return [p], TRACKED
    handles: list[SavedHandle] = []
    kind = TRACKED
    for attr in names:
        if attr is STRAYS:
            handles += [h for h in (r() for r in node.metadata.get(STRAYS, ())) if h is not None]
            continue
        try:  # what the pack hook returned, without unpacking it
            value = getattr(node, attr)
            if type(value) is _SavedTensor:
                p = value.data
                if type(p) is SavedHandle:  # the common case, without the inner loop
                    if p not in handles:
                        handles.append(p)
                    continue
                packed = (p,)
            else:  # a list of tensors (``_raw_saved_indices``, ``_raw_saved_tensors``)
                packed = [v.data for v in value if v is not None]
        except RuntimeError:  # freed by a pass that did not retain the graph
            continue
        for p in packed:
            if type(p) is SavedHandle:
                if p not in handles:
                    handles.append(p)
            elif p is None:
                continue
            elif isinstance(p, torch.Tensor):
                if kind == TRACKED and not _maybe_wrapped_number(p):
                    kind = UNTRACKED
            else:
                kind = FOREIGN
    return handles, TRACKED if handles else kind


def saved_attributes(node_type: type) -> tuple[str, ...]:
    """Where a node of ``node_type`` keeps what it saved; ``STRAYS`` for a CopySlices."""
    names = _saved_names.get(node_type)
    if names is None:
        if node_type.__name__ == "CopySlices":
            names = (STRAYS,)
        else:
            names = tuple(n for n in dir(node_type) if n.startswith("_raw_saved_"))
        _saved_names[node_type] = names
        if not names:
            saves_nothing.add(node_type)
        elif len(names) == 1 and names[0] is not STRAYS:
            saves_one[node_type] = names[0]
    return names


def live_handles(node) -> list[SavedHandle]:
    return [h for h in saved(node)[0] if h.tensor is not None]


def saves_its_output(node) -> bool:
    """Whether other saved-tensor hooks packed an output of ``node`` as it is: the
    output holds ``node`` as its ``grad_fn`` (NOTE [ Outputs saved as they are ] in
    ``_plan.py``). Read for the nodes graphprune does not hold, after a plan.

    Example::

        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ...     y = x.exp()
        >>> saves_its_output(y.grad_fn), saves_its_output(x.sin().grad_fn)
        (True, False)
    """
    for attr in saved_attributes(type(node)):
        if attr is STRAYS:
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # a custom Function's saved tensors, freed by a pass
            continue
        for saved_tensor in (value,) if type(value) is _SavedTensor else value:
            if saved_tensor is None:
                continue
            packed = saved_tensor.data
            for t in packed if type(packed) in (tuple, list) else (packed,):  # save_on_cpu: (device, t)
                try:
                    if isinstance(t, torch.Tensor) and t.grad_fn is node:
                        return True
                except RuntimeError:  # a view made under no_grad and modified in place
                    continue
    return False


def was_freed(node) -> bool:
    """Whether a pass that did not retain the graph ran ``node``, which held what
    other hooks or PyTorch saved: nothing of it is left to read."""
    for attr in saved_attributes(type(node)):
        if attr is STRAYS:
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # a custom Function's saved tensors, freed
            return True
        values = (value,) if type(value) is _SavedTensor else value
        if any(v is not None and v.data is not None for v in values):
            return False
    return True


def _maybe_wrapped_number(t: torch.Tensor) -> bool:
    """PyTorch saves a Python scalar wrapped into a tensor (``x * 0.5``) without
    calling saved-tensor hooks (``saved_variable.cpp``)."""
    return t.dim() == 0 and not t.requires_grad and t.dtype in _SCALAR_DTYPES


# -- handles hidden inside CopySlices --------------------------------------------------
def attach_hidden(copy_slices, handles: list[SavedHandle]) -> None:
    """Give a ``CopySlices`` node the handles its hidden node saved (NOTE [ Lazy records ]).

    Weak references: PyTorch's own release (a pass without ``retain_graph``) must
    free what the hidden node saved, as it frees every other node's tensors.
    """
    md = copy_slices.metadata
    md[STRAYS] = (*md.get(STRAYS, ()), *(weakref.ref(h) for h in handles))
    children(copy_slices)  # a wrapper made in the forward: NOTE [ Deep graphs and Python wrappers ]
