"""``render``: the ``grad_fn`` graph behind an output, coloured by what a prune of it does.

NOTE [ What a picture shows ]
The colours come from a :class:`PruneReport` (``explain(y, keep=keep)``'s, or the one a
call returned), so the picture says exactly what that prune does: its
``released_ids`` are "released", each ``KeptReason``'s ``node_ids`` one "kept" colour
with the reason in the legend. What the report leaves out is read from the node:
built outside ``track()`` or saved under other hooks, released by an earlier call, on
``y``'s graph but off its gradient's route (a stacked loss's other entries: nothing
reaches them but zeros), in the branch with nothing saved (drawn as released), outside
the call's graph where ``y`` is wider than what the report's call was given (another
head, not backpropagated yet: the report's ``output_ids`` tell the call's part), or
saving only boolean masks, which no prune releases (NOTE [ Masks stay ] in ``_zero.py``).

A picture of thousands of nodes stays readable: runs of single-parent, single-child
nodes of one colour (and one module) collapse into one box with a count, and
``by_module=`` merges the nodes each module built (``track(modules=...)``).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence

import networkx as nx
import torch
from torch.autograd.graph import GradientEdge, Node

from ._graph import FOREIGN, UNTRACKED, _is_router, along_every_edge, children, name, reach, saved
from ._marks import RELEASED
from ._modules import module_of, parameter_names
from ._plan import as_outputs, listed
from ._report import PruneReport, format_bytes, unique_bytes
from ._routing import ALL, widen
from ._warn import warn_at_caller

__all__ = ["render", "model", "STATES"]

# state -> (fill colour, legend text); "keep" states are numbered, one per KeptReason
STATES = {
    "release": ("#e8827f", "released by this call"),
    "released": ("#c9b79c", "already released by an earlier call"),
    "foreign": ("#f5b971", "saved under other hooks (checkpoint, save_on_cpu): left to them"),
    "untracked": ("#bdbdbd", "built outside track(): PyTorch holds its saved tensors"),
    "offroute": ("#ffffff", "off y's gradient route (only zeros reach it): left alone"),
    "outside": ("#fdf3d6", "outside this call's graph: left alone"),
    "masks": ("#d4cce6", "saved only boolean masks, which no prune releases: kept"),
}
KEEP_COLOURS = ("#7fb3e0", "#8fd19e", "#b6a6e0", "#f2cf72", "#8fd6d0", "#e0a6c8")
AUTO_COLLAPSE = 60  # nodes; above this, chains collapse into boxes


_SUFFIXES = (".svg", ".png", ".pdf", ".dot")


def render(
    y: torch.Tensor | Sequence[torch.Tensor],
    keep=None,
    path: str = "graph.svg",
    *,
    report: PruneReport | None = None,
    collapse: bool | None = None,
    by_module: int | None = None,
    title: str | None = None,
) -> PruneReport:
    """Draw the ``grad_fn`` graph behind ``y``, each node coloured by what a prune of
    ``y`` (with ``keep``) would do, to ``path``: ``.svg``, ``.png``, ``.pdf`` (drawn with
    matplotlib, no Graphviz needed) or ``.dot`` (Graphviz source, written by hand).

    Nodes are labelled with their op and the bytes they save; ``y``'s nodes have a
    thick border, ``keep``'s a dashed one; the legend names each colour, and each
    reason something is kept (NOTE [ What a picture shows ]). ``y`` is at the top, the
    leaves it accumulates into at the bottom.

    Args:
        y, keep: as for :func:`~graphprune.explain`, which is asked (a dry run).
        path: where to write; the suffix picks the format.
        report: colour by this report instead (one a call returned: after
            ``r = gp.backward(y1)``, ``render(y1, report=r)`` shows what it freed).
        collapse: collapse chains; ``None`` does above 60 nodes.
        by_module: merge the nodes built by one module, named to this many parts
            (``1``: ``trunk``, ``2``: ``trunk.0``); needs ``track(modules=...)``.
        title: the picture's title; by default the report's first line.

    Returns:
        The :class:`PruneReport` the colours come from.

    Example::

        >>> import os, tempfile, torch, graphprune as gp
        >>> w = torch.ones(3, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     y1 = (x * x).sum()
        >>> path = os.path.join(tempfile.mkdtemp(), "graph.dot")
        >>> gp.render(y1, keep=x, path=path).released_nodes
        {'MulBackward0': 1}
        >>> with open(path) as f:
        ...     print(f.readline().strip())
        digraph graphprune {
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"graphprune.render: path must be a file name (.svg, .png, .pdf, .dot), "
                        f"got {type(path).__name__}")
    if os.path.splitext(os.fspath(path))[1].lower() not in _SUFFIXES:  # before the graph's walk
        raise ValueError(f"graphprune.render: cannot draw {os.fspath(path)!r}: the suffix must be one of "
                         f"{', '.join(_SUFFIXES)}")
    if by_module is not None and (type(by_module) is not int or by_module < 1):
        raise ValueError("graphprune.render: by_module must be a number of name parts, 1 or more (1: "
                         f"'trunk', 2: 'trunk.0'), got {by_module!r}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"graphprune.render: title must be a str, got {type(title).__name__}")
    if report is not None and not isinstance(report, PruneReport):
        raise TypeError("graphprune.render: report must be a PruneReport (what prune_after, backward or "
                        f"explain returned), got {type(report).__name__}")
    y = listed(y)  # a generator: read by the plan, then by the drawing
    if report is None:  # explain's dry run, without becoming last_report()
        from ._plan import Plan

        report = Plan("graphprune.render", y, keep).report("graphprune.render", dry_run=True)
    nodes = model(y, keep, report)
    if by_module is not None and all(d["module"] is None for _, d in nodes.nodes(data=True)):
        warn_at_caller("graphprune.render: by_module= merges nothing: no node of the graph has a module "
                       "name; build the graph under graphprune.track(modules=model)")
    boxes, legend = _boxes(nodes, report, collapse, by_module)
    heading = title if title is not None else str(report).splitlines()[0]
    if os.path.splitext(path)[1].lower() == ".dot":
        from ._dot import write_dot

        write_dot(boxes, legend, heading, path)
    else:
        from ._draw import draw_graph

        draw_graph(boxes, legend, heading, path)
    return report


def model(y, keep, report: PruneReport) -> nx.DiGraph:
    """The graph behind ``y`` (every edge, breadth-first), one node per ``grad_fn``
    (key ``id``) with ``op``, ``state``, ``reason`` (the ``KeptReason``'s index for
    ``"keep"``: the rank of its ``KeptReason`` among those drawn, listed in
    ``graph["kept"]``), ``bytes``, ``module``, ``mark`` (``"y"``, ``"keep"``) and ``detail``."""
    tensors, edges = as_outputs(y, "graphprune.render", "y")
    roots = [(t.grad_fn, t.output_nr) for t in tensors] + [(e.node, e.output_nr) for e in edges]
    fns = [fn for fn, _ in roots]
    marks = {id(fn): "y" if len(roots) == 1 else f"y[{i}]" for i, fn in enumerate(fns)}
    single = isinstance(keep, GradientEdge) or not isinstance(keep, (list, tuple))
    for i, k in enumerate(() if keep is None else [keep] if single else keep):
        if isinstance(k, GradientEdge):
            k = k.node
        fn = k if isinstance(k, Node) else getattr(k, "grad_fn", None)
        if fn is not None:
            marks.setdefault(id(fn), "keep" if single else f"keep[{i}]")
    reason_of = {nid: i for i, r in enumerate(report.kept) for nid in r.node_ids}
    routed = {id(n) for n in _routed(roots)}
    params = parameter_names()
    g = nx.DiGraph()
    order = list(along_every_edge(fns))
    starts = [n for n in order if id(n) in report.output_ids]
    # the call's part as its prune walked it, routing too: a stack's entry reaches one head, not every head
    in_call = {id(n) for n in reach(starts)} if starts else None  # None: a report that does not say
    for node in order:
        handles, kind = saved(node)
        live = [h for h in handles if h.tensor is not None]
        state, reason = _state(node, kind, report, reason_of, routed, in_call,
                               any(h.tensor.dtype is not torch.bool for h in live))
        if state == "release" and live and id(node) not in report.released_ids and all(
                h.tensor.dtype is torch.bool for h in live):
            state = "masks"  # kept by every prune: NOTE [ Masks stay ] in _zero.py
        g.add_node(id(node), op=name(node), state=state, reason=reason, bytes=unique_bytes(live),
                   handles=live, module=module_of(node), mark=marks.get(id(node)),
                   detail=_detail(node, params))
    g.add_edges_from((id(n), id(c)) for n in order for c in children(n))
    used = sorted({d["reason"] for _, d in g.nodes(data=True) if d["state"] == "keep"})
    rank = {i: k for k, i in enumerate(used)}  # keep colours in report order, for the reasons drawn
    for _, d in g.nodes(data=True):
        if d["state"] == "keep":
            d["reason"] = rank[d["reason"]]
    g.graph["kept"] = [report.kept[i] for i in used]
    return g


def _state(node, kind: str, report: PruneReport, reason_of: dict, routed: set,
           in_call: set | None, holds: bool) -> tuple[str, int | None]:
    nid = id(node)
    if nid in report.released_ids:
        return "release", None
    if kind == FOREIGN:
        return "foreign", None
    if kind == UNTRACKED:
        return "untracked", None
    if nid in reason_of:
        return "keep", reason_of[nid]
    if RELEASED in node.metadata:
        return "released", None
    if nid not in routed:
        return "offroute", None
    if in_call is not None and nid not in in_call or holds:  # holds: not released, not kept, so the
        return "outside", None  # call left it alone (its outputs are entries of y, above the graph drawn)
    return "release", None  # in the branch, with nothing saved


def _routed(roots: list) -> dict:
    """The nodes a non-zero gradient from ``roots`` (``(node, output number)``) can
    reach, as the prune walks them (NOTE [ Gradient routing ] in ``_routing.py``): the
    report names only those of them that saved something or are kept."""
    supports: dict = {}
    for fn, nr in roots:
        if _is_router(fn):
            widen(supports.setdefault(fn, {}), nr, ALL)
    return reach([fn for fn, _ in roots], supports=supports)


def _detail(node, params: dict) -> str:
    """A leaf's parameter name (``trunk.0.weight``, when known) or shape."""
    var = getattr(node, "variable", None)
    if not isinstance(var, torch.Tensor):
        return ""
    return params.get(id(var)) or str(tuple(var.shape))


# -- boxes: what is drawn --------------------------------------------------------------
def _boxes(g: nx.DiGraph, report: PruneReport, collapse: bool | None, by_module: int | None):
    """The boxes to draw (a ``DiGraph`` with ``label``, ``fill``, ``state``, ``border``,
    ``count``) and the legend (``[(fill, text)]``, the colours present)."""
    key = {n: _group_key(d, by_module) for n, d in g.nodes(data=True)}
    group = {n: n for n in g}
    if by_module is not None:
        firsts: dict = {}
        for n in g:
            if key[n][1] is not None:  # merge by (colour, module)
                group[n] = firsts.setdefault(key[n], n)
        if not _acyclic(g, group):  # a module's nodes on both sides of another colour
            group = {n: n for n in g}
    if collapse or (collapse is None and g.number_of_nodes() > AUTO_COLLAPSE):
        _collapse_chains(g, key, group)
    members: dict = collections.defaultdict(list)
    for n, gid in group.items():
        members[gid].append(n)
    boxes = nx.DiGraph()
    for gid, ns in members.items():
        boxes.add_node(gid, **_box(g, ns, {key[n][1] for n in ns}))
    boxes.add_edges_from((group[u], group[v]) for u, v in g.edges if group[u] != group[v])
    return boxes, _legend(boxes, report, g.graph["kept"])


def _group_key(d: dict, by_module: int | None) -> tuple:
    module = d["module"]
    if by_module is not None and module is not None:
        module = ".".join(module.split(".")[:by_module])
    return (d["state"], d["reason"]), module


def _acyclic(g: nx.DiGraph, group: dict) -> bool:
    merged = nx.DiGraph((group[u], group[v]) for u, v in g.edges if group[u] != group[v])
    return nx.is_directed_acyclic_graph(merged)


def _find(group: dict, n):
    while group[n] != n:
        group[n] = group[group[n]]
        n = group[n]
    return n


def _collapse_chains(g: nx.DiGraph, key: dict, group: dict) -> None:
    """Merge each run of nodes linked by edges ``u -> v`` where ``u`` has one child and
    ``v`` one parent, of one colour and module, neither of them ``y`` or ``keep``:
    contracting such an edge makes no cycle."""
    for u, v in g.edges:
        marked = g.nodes[u]["mark"] or g.nodes[v]["mark"]
        if g.out_degree(u) == 1 and g.in_degree(v) == 1 and key[u] == key[v] and not marked:
            ru, rv = _find(group, u), _find(group, v)
            if ru != rv:
                group[rv] = ru
    for n in group:
        group[n] = _find(group, n)


def _box(g: nx.DiGraph, ns: list, modules: set) -> dict:
    data = [g.nodes[n] for n in ns]
    first = data[0]
    ops = collections.Counter(d["op"] for d in data)
    if len(ns) == 1:
        lines = [first["op"]] + ([first["detail"]] if first["detail"] else [])
    else:
        top = [f"{op} x{k}" if k > 1 else op for op, k in ops.most_common(2)]
        more = len(ops) - len(top)
        lines = [f"{len(ns)} nodes: {top[0]}"] + top[1:] + ([f"+{more} more op(s)"] if more else [])
    nbytes = unique_bytes([h for d in data for h in d["handles"]])
    if nbytes:
        lines.append(format_bytes(nbytes))
    modules.discard(None)
    if len(modules) == 1:
        lines.append(f"in {modules.pop()}")
    mark = next((d["mark"] for d in data if d["mark"]), None)
    if mark:
        lines.insert(0, f"[{mark}]")
    state = first["state"] + ("" if first["reason"] is None else str(first["reason"]))
    border = None if mark is None else ("root" if mark.startswith("y") else "keep")
    return dict(label="\n".join(lines), fill=_fill(state), state=state, border=border, count=len(ns),
                bytes=nbytes)


def _fill(state: str) -> str:
    if state.startswith("keep"):
        return KEEP_COLOURS[int(state[4:]) % len(KEEP_COLOURS)]
    return STATES[state][0]


def _legend(boxes: nx.DiGraph, report: PruneReport, kept: list) -> list[tuple[str, str]]:
    present = {d["state"] for _, d in boxes.nodes(data=True)}
    out = []
    for state, (fill, text) in STATES.items():
        if state in present:
            if state == "release" and report.dry_run:
                text = "would be released by this prune"
            out.append((fill, text))
    for i, reason in enumerate(kept):
        if f"keep{i}" in present:
            held = "bytes unknown" if reason.saved_bytes is None else format_bytes(reason.saved_bytes)
            out.append((_fill(f"keep{i}"), f"kept ({held}): {_shorten(reason.reason)}"))
    return out


def _shorten(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
