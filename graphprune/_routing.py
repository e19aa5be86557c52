"""Gradient routing: which children of a node can receive a non-zero gradient.

NOTE [ Gradient routing ]
Losses gathered into one tensor (``losses = torch.stack([l0, l1, l2])``, or
``losses[i] = l_i``) and backpropagated one at a time (``losses[1].backward()``)
reach every head through ``Stack``/``Select``/``CopySlices`` nodes, but only head 1
gets a non-zero gradient: the others get zeros. A walk that follows every edge would
count every head as part of ``losses[1]``'s graph. So a walk carries, for the few
node types that select or assemble slices, the *support* of the gradient that
flows into each of their outputs: ``ALL`` (any element may be non-zero) or
``(dim, indices)`` (only those indices along ``dim`` may be). Every other node
passes ``ALL`` to all its children: conservative, never wrong.

A routing rule maps a node's incoming supports (by output number) to the
``(child, child's output number, support)`` of each child that may receive a
non-zero gradient. Rules read what the node saved (``_saved_dim``, ...; ints, not
tensors: no unpack hook runs) and ``_input_metadata`` (the shapes of the node's
forward outputs). ``CopySlices`` exposes no geometry: the output recorder stamps
the index ``Tensor.__setitem__`` wrote on it (:func:`stamp_setitem`). A rule that
cannot read what it needs passes ``ALL`` to every child.

NOTE [ Long dims are not routed ]
A support names its indices one by one (a ``frozenset``: ~64 bytes an index), and a
walk leaves supports on the nodes it met (the trunk's walk, the finished marks of
live vectors). Losses gathered into a vector have a few to a few hundred entries; a
slice of a long feature (``y[: n // 2]`` of a million-entry ``y``) would make sets of a
million indices at each prune, seconds of work and tens of MiB held with the graph.
So a slice, a split or an item assignment along a dim of more than
``ROUTED_AT_MOST`` entries is not routed, as an op the walk does not know is not: it
counts as a pass through every entry (a later pass from another part of it is
protected while its loss lives, and meets a released node otherwise: an error that
names ``keep=``, never a wrong gradient). A ``select`` names one index, and is routed
on any dim; what is left of a long vector after a pass took some of its entries is
the whole vector (``complement``), which stays protected whole while it is pending.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "ROUTED_AT_MOST", "ALL", "NOTHING", "WRITTEN", "rule_for", "merge", "widen", "overlap", "every_output",
    "complement", "stamp_setitem", "index_text",
]

ROUTED_AT_MOST = 4096  # entries of a dim a support names one by one: NOTE [ Long dims are not routed ]
ALL = None  # the support "any element may be non-zero"
NOTHING = ()  # the support "every element is zero"
WRITTEN = "graphprune.written"  # CopySlices metadata: (dim, indices written, size along dim)
_U64 = 1 << 64


def merge(a, b):
    """The union of two supports (``ALL`` absorbs; different dims give ``ALL``)."""
    if a == NOTHING:
        return b
    if b == NOTHING:
        return a
    if a is ALL or b is ALL or a[0] != b[0]:
        return ALL
    return (a[0], a[1] | b[1])


def widen(supports: dict, nr: int, support) -> bool:
    """Merge ``support`` into ``supports[nr]``; whether it grew."""
    old = supports.get(nr, NOTHING)
    new = merge(old, support)
    if new == old:
        return False
    supports[nr] = new
    return True


def overlap(a, b) -> bool:
    """Whether two supports share an element (different dims: assume they do)."""
    if a == NOTHING or b == NOTHING:
        return False
    if a is ALL or b is ALL or a[0] != b[0]:
        return True
    return not a[1].isdisjoint(b[1])


def every_output(node) -> dict:
    """``{output number: ALL}`` for each output of ``node``."""
    try:
        return dict.fromkeys(range(len(node._input_metadata)), ALL)
    except RuntimeError:
        return {0: ALL}


def complement(support, size: int):
    """What of ``range(size)`` along the support's dim is not in it (``NOTHING`` if
    nothing is left, ``ALL`` if the support was ``NOTHING``)."""
    if support is ALL:
        return NOTHING
    if support == NOTHING or size > ROUTED_AT_MOST:  # NOTE [ Long dims are not routed ]
        return ALL
    rest = frozenset(range(size)) - support[1]
    return (support[0], rest) if rest else NOTHING


def _signed(v: int) -> int:
    return v - _U64 if v >= 1 << 63 else v


def _dim(d: int, ndim: int) -> int:
    d = _signed(d)
    return d + ndim if d < 0 else d


def _edges(node) -> list:
    return [(c, nr) for c, nr in node.next_functions if c is not None]


def _every_child(node) -> list:
    """Every child, with ``ALL``: what a node that does not route passes on."""
    return [(c, nr, ALL) for c, nr in _edges(node)]


def _along(supports: dict, d: int):
    """The indices along ``d`` where output 0's support may be non-zero, or ``None``
    when it is not constrained along ``d``."""
    incoming = supports.get(0, ALL)
    return None if incoming is ALL or incoming[0] != d else incoming[1]


def _out_ndim(node, nr: int = 0) -> int:
    return len(node._input_metadata[nr].shape)


def _select(node, supports):
    sizes = node._saved_self_sym_sizes
    d = _dim(node._saved_dim, len(sizes))
    return [(c, nr, (d, frozenset((_signed(node._saved_index) % sizes[d],)))) for c, nr in _edges(node)]


def _slice(node, supports):
    sizes = node._saved_self_sym_sizes
    d = _dim(node._saved_dim, len(sizes))
    bounds = slice(_signed(node._saved_start), _signed(node._saved_end), node._saved_step)
    picked = range(*bounds.indices(sizes[d]))
    incoming = _along(supports, d)
    if incoming is None and sizes[d] > ROUTED_AT_MOST:  # NOTE [ Long dims are not routed ]
        return _every_child(node)
    if incoming is not None:
        indices = frozenset(picked[i] for i in incoming if i < len(picked))
    else:
        indices = frozenset(picked)
    return [(c, nr, (d, indices)) for c, nr in _edges(node)] if indices else []


def _unbind(node, supports):
    d = _dim(node._saved_dim, _out_ndim(node) + 1)
    return [(c, nr, (d, frozenset(supports))) for c, nr in _edges(node)]


def _split(node, supports):
    sizes = node._saved_self_sym_sizes
    d = _dim(node._saved_dim, len(sizes))
    if hasattr(node, "_saved_split_sizes"):
        parts = list(node._saved_split_sizes)
    else:
        step = node._saved_split_size
        parts = [min(step, sizes[d] - start) for start in range(0, sizes[d], step)]
    if sizes[d] > ROUTED_AT_MOST:  # NOTE [ Long dims are not routed ]
        return _every_child(node)
    offsets = [sum(parts[:k]) for k in range(len(parts))]
    indices = set()
    for k, support in supports.items():  # a part keeps the input's dims: an index along d shifts
        within = range(parts[k]) if support is ALL or support[0] != d else support[1]
        indices.update(offsets[k] + j for j in within if j < parts[k])
    return [(c, nr, (d, frozenset(indices))) for c, nr in _edges(node)] if indices else []


def _stack(node, supports):
    incoming = _along(supports, _dim(node._saved_dim, _out_ndim(node)))
    if incoming is None:
        return _every_child(node)
    return [(c, nr, ALL) for i, (c, nr) in enumerate(node.next_functions) if c is not None and i in incoming]


def _cat(node, supports):
    d = _dim(node._saved_dim, _out_ndim(node))
    incoming = _along(supports, d)
    pairs = node.next_functions
    if incoming is None or any(c is None for c, _ in pairs):  # an input's size is unknown
        return _every_child(node)
    out, start = [], 0
    for c, nr in pairs:
        n = c._input_metadata[nr].shape[d]
        part = frozenset(i - start for i in incoming if start <= i < start + n)
        if part:
            out.append((c, nr, (d, part)))
        start += n
    return out


def _copy_slices(node, supports):
    written = node.metadata.get(WRITTEN)
    if written is None:
        return _every_child(node)
    d, indices, size = written
    incoming = _along(supports, d)
    if incoming is None and size > ROUTED_AT_MOST:  # NOTE [ Long dims are not routed ]
        return _every_child(node)
    wanted = frozenset(range(size)) if incoming is None else incoming
    out = []
    pairs = node.next_functions
    (base, base_nr), rest = pairs[0], pairs[1:]
    kept = wanted - indices  # the base's gradient is zero where the write landed
    if base is not None and kept:
        out.append((base, base_nr, (d, kept)))
    hit = wanted & indices
    if hit:  # the written value gets the gradient of its region: L[0:2] = stack([l0, l1])
        rank = {k: j for j, k in enumerate(sorted(indices))}  # a slice's step is positive
        positions = (d, frozenset(rank[k] for k in hit)) if hit != indices else ALL
        ndim = _out_ndim(node)
        out += [(c, nr, positions if positions is ALL or _fills(c, nr, d, len(indices), ndim) else ALL)
                for c, nr in rest if c is not None]
    return out


def _fills(child, nr: int, d: int, n: int, ndim: int) -> bool:
    """Whether a value written into ``n`` entries along ``d`` of an ``ndim``-dim tensor
    (``child``'s output ``nr``) spans them one by one, not broadcast: region entry
    ``j`` along ``d`` is its entry ``j``."""
    shape = child._input_metadata[nr].shape
    return len(shape) == ndim and shape[d] == n


_RULES: dict[str, Callable] = {
    "SelectBackward0": _select,
    "SliceBackward0": _slice,
    "UnbindBackward0": _unbind,
    "SplitBackward0": _split,
    "SplitWithSizesBackward0": _split,
    "StackBackward0": _stack,
    "CatBackward0": _cat,
    "CopySlices": _copy_slices,
}
BY_TYPE: dict[type, Callable | None] = {}  # filled by rule_for
UNKNOWN = object()  # BY_TYPE.get's default: a node type rule_for has not seen yet


def rule_for(node_type: type) -> Callable | None:
    """The routing rule of a node type, or ``None`` (every child gets ``ALL``)."""
    try:
        return BY_TYPE[node_type]
    except KeyError:
        rule = BY_TYPE[node_type] = _safe(_RULES.get(node_type.__name__.rsplit("::", 1)[-1]))
        return rule


def _safe(rule):
    if rule is None:
        return None

    def routed(node, supports):
        try:
            return rule(node, supports)
        except (RuntimeError, AttributeError, IndexError, TypeError, ValueError, ZeroDivisionError):
            return _every_child(node)  # what it needs is unreadable

    return routed


# -- CopySlices: what Tensor.__setitem__ wrote --------------------------------------------
def stamp_setitem(target: torch.Tensor, key, before) -> None:
    """Stamp the ``CopySlices`` that ``target[key] = value`` made with the index it
    wrote, when the key is plain (ints and slices); otherwise leave it unrouted."""
    fn = target.grad_fn
    if fn is None or fn is before or fn.name().rsplit("::", 1)[-1] != "CopySlices":
        return
    where = _written(key, tuple(target.shape))
    if where is not None:
        fn.metadata[WRITTEN] = where


def _written(key, shape: tuple):
    """``(dim, indices, size)`` of the one constrained dim of a basic index, or ``None``:
    also where another dim is constrained too (``M[0, 1] = v`` writes one entry of row 0,
    not the row)."""
    items = key if isinstance(key, tuple) else (key,)
    d = 0
    for i, k in enumerate(items):
        if d >= len(shape):
            return None
        if isinstance(k, slice) and k == slice(None):
            d += 1
            continue
        if shape[d] > ROUTED_AT_MOST:  # NOTE [ Long dims are not routed ]
            return None
        try:
            if not isinstance(k, slice):
                if isinstance(k, (bool, np.bool_, torch.Tensor)) or not hasattr(k, "__index__"):
                    return None  # masks, tensors, lists, None, Ellipsis: not worth routing
                # (numpy 1.x gives np.bool_ an __index__: 1 for the mask PyTorch takes it as)
                k = operator.index(k)
                indices = frozenset((k % shape[d],)) if -shape[d] <= k < shape[d] else None
            else:
                indices = frozenset(range(*k.indices(shape[d])))
        except (TypeError, ValueError):  # __index__ that refuses (a numpy array)
            return None  # PyTorch took the key as an index array or a mask: not routed
        if not all(r is Ellipsis or (isinstance(r, slice) and r == slice(None)) for r in items[i + 1:]):
            return None  # a block of the dim's entries, not whole ones: not routed
        return None if not indices else (d, indices, shape[d])
    return None  # the whole tensor was written


def index_text(name: str, support, size: int = 0) -> str:
    """``losses[2:]``, ``losses[1]``, ``[losses[0], losses[2:]]``: the part of ``name``
    (of ``size`` along the support's dim) that a support covers, as ints and slices,
    which routing follows (a list index is a tensor index, which it does not)."""
    if support is ALL:
        return name
    d, indices = support
    runs: list[list[int]] = []
    for k in sorted(indices):
        if runs and runs[-1][-1] + 1 == k:
            runs[-1].append(k)
        else:
            runs.append([k])
    parts = [str(run[0]) if len(run) == 1 else f"{run[0] or ''}:{'' if run[-1] + 1 == size else run[-1] + 1}"
             for run in runs]
    texts = [f"{name}[{':, ' * d}{part}]" for part in parts]
    return texts[0] if len(texts) == 1 else f"[{', '.join(texts)}]"
