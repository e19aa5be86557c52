"""What a prune released and kept, and why; graph snapshots for inspection."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import networkx as nx
import torch

from ._graph import TRACKED, UNTRACKED, children, is_accumulator, name, reach, saved
from ._marks import RELEASED
from ._outputs import live_roots
from ._saved import SavedHandle, storage_of

__all__ = [
    "PruneReport", "KeptReason", "storages", "storage_bytes", "unique_bytes", "exclusive_keys",
    "held_elsewhere", "nothing_released",
    "format_bytes", "snapshot",
]


def storages(handles, grouped: bool = True) -> dict:
    """``{key: [bytes, handle, ...]}``: the live ``handles`` grouped by the storage
    behind them (``storage_of``'s key), with the most bytes one of them spans
    (``grouped=False``: ``{key: bytes}``, no list per storage). The storage of several
    views (``q``, ``k``, ``v`` of one projection, a weight and its transpose) is asked
    its size once."""
    out: dict = {}
    address = torch._C._storage_address
    view_bytes: dict[int, int] = {}
    for h in handles:
        t = h.tensor
        if t is None:  # released since it was found live: another thread's prune or pass
            continue
        try:  # storage_of's common cases, without the call
            if h.view:
                key = address(t)
                nbytes = view_bytes.get(key)
                if nbytes is None:
                    nbytes = view_bytes[key] = t.untyped_storage().nbytes()
            elif t.is_contiguous():
                key, nbytes = address(t), t.nbytes
                offset = t.storage_offset()  # 0 but for a tensor set_() on part of a storage
                if offset:
                    nbytes += offset * t.element_size()
            else:
                key, nbytes = storage_of(h)
        except (RuntimeError, NotImplementedError):
            key, nbytes = storage_of(h)
        if not grouped:
            if nbytes > out.get(key, -1):
                out[key] = nbytes
            continue
        entry = out.get(key)
        if entry is None:
            out[key] = [nbytes, h]
        else:
            if nbytes > entry[0]:
                entry[0] = nbytes
            entry.append(h)
    return out


def storage_bytes(handles) -> dict[int, int]:
    """``{key: bytes}`` of the distinct storages behind live ``handles`` (:func:`storages`)."""
    return storages(handles, grouped=False)


def unique_bytes(handles: list[SavedHandle]) -> int:
    """Bytes of the distinct storages behind ``handles`` (live ones)."""
    return sum(storage_bytes(handles).values())


def exclusive_keys(by_storage: dict[int, list]) -> list[int]:
    """The keys of ``by_storage`` (:func:`storages`) whose storages nothing but their
    handles uses: what dropping the handles gives back."""
    keys = []
    refcount, uses = sys.getrefcount, torch._C._storage_Use_Count
    for key, entry in by_storage.items():
        if len(entry) == 2:  # held_elsewhere's common case, without the call and the list
            h = entry[1]
            if refcount(h.tensor) > 2:  # the handle, getrefcount's argument
                continue
            if key >= 0:  # a negative key: no storage address
                extra = uses(key) - 1 - h.view  # storages() made a view's storage object
                if extra == 1 and not h.view or extra == 0 and h.view:  # the storage's Python
                    extra = _other_uses(h.tensor, key, 1, h.view)  # object, or one other use
                if extra > 0:
                    continue
            keys.append(key)
        elif not held_elsewhere(entry[1:], key, made=True):
            keys.append(key)
    return keys


def held_elsewhere(group: list[SavedHandle], address: int | None = None, made: bool = False) -> bool:
    """Whether anything but ``group`` uses the storage its handles share (at
    ``address``, found if ``None``): another reference to a tensor a handle holds as
    it is (a leaf: a parameter, an input), or another tensor on the storage (the
    output a handle's detached alias came from). ``made``: :func:`storages` grouped
    them, so a view among them made the storage's Python object."""
    if len(group) == 1:  # the common case, without the dict
        h = group[0]
        if sys.getrefcount(h.tensor) > 2:  # the handle, getrefcount's argument
            return True
        distinct = 1
    else:
        tensors = {id(h.tensor): h.tensor for h in group}
        distinct = len(tensors)
        for t in tensors.values():
            mine = sum(h.tensor is t for h in group)
            if sys.getrefcount(t) - mine - 3 > 0:  # 3: the dict, the loop, getrefcount's argument
                return True
    try:
        if address is None:
            address = torch._C._storage_address(group[0].tensor)
    except (RuntimeError, NotImplementedError):  # sparse, nested
        return False
    if address < 0:  # storage_of's key of a tensor without a storage address
        return False
    return _other_uses(group[0].tensor, address, distinct, made and any(h.view for h in group)) > 0


def _other_uses(t: torch.Tensor, address: int, distinct: int, made: bool) -> int:
    """Uses of the storage at ``address`` (behind ``t``) besides ``distinct`` tensors
    of one group. The storage's Python object, once made (``made``: by
    :func:`storages`, for a view; or by an earlier prune, the user's
    ``untyped_storage()``), counts one use for as long as the storage lives; so a
    count one over is read again with the object surely made (``untyped_storage()``
    returns it, or makes it)."""
    uses = torch._C._storage_Use_Count
    extra = uses(address) - distinct - made
    if extra == 1 and not made:
        storage = t.untyped_storage()
        extra = uses(address) - distinct - 1
    elif extra == 0 and made:
        storage = t.untyped_storage()
    else:
        return extra
    if extra == 0 and sys.getrefcount(storage) > _STORAGE_OBJECT_REFS:  # the program holds it
        return 1  # (``s = t.untyped_storage()``): what it holds stays
    return extra


def _storage_object_refs() -> int:
    """``sys.getrefcount`` of a storage's Python object that one local name holds and
    nothing else does but the storage itself (PyTorch keeps it for the storage's life)."""
    t = torch.empty(1)
    storage = t.untyped_storage()
    return sys.getrefcount(storage)


_STORAGE_OBJECT_REFS = _storage_object_refs()


@dataclass(frozen=True)
class KeptReason:
    """Nodes of the pruned graph that keep their saved tensors, and why."""

    reason: str
    nodes: int
    saved_bytes: int | None  # None: held by PyTorch or other hooks, not measured
    node_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    def __str__(self) -> str:
        held = "bytes unknown" if self.saved_bytes is None else format_bytes(self.saved_bytes)
        return f"{self.nodes} node(s), {held}: {self.reason}"


@dataclass(frozen=True)
class PruneReport:
    """The outcome of :func:`~graphprune.prune_after`, :func:`~graphprune.backward`,
    :func:`~graphprune.grad` or :func:`~graphprune.explain` (``dry_run=True``), or of
    one pass of :func:`~graphprune.backward_each`, :func:`~graphprune.grads_each` or a
    call that :func:`~graphprune.pruning` routed.

    Byte counts are of unique storages: ``bytes_freed`` counts only storages that
    nothing but the released handles used, ``bytes_kept`` the storages the kept part
    of the graph (the trunk) still holds: what it saved, and the tensors without a
    graph that only it holds (dropout masks, RNN workspaces); parameters and inputs
    that something else holds left out.

    ``released_ids`` and each :class:`KeptReason`'s ``node_ids`` are the nodes' ids
    as :meth:`Tape.graph` numbers them (``id`` of the ``grad_fn``), to colour it by;
    ``output_ids`` those of the nodes the call started from (its outputs' ``grad_fn``,
    its gradient edges' nodes), which tell its part of a wider picture.
    """

    call: str
    dry_run: bool
    released_nodes: dict[str, int]
    released_tensors: int
    bytes_freed: int
    bytes_kept: int
    kept: tuple[KeptReason, ...] = field(default=())
    released_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    output_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    strategy: str | None = None  # how a per-loss helper ran its passes

    @property
    def released_node_count(self) -> int:
        return sum(self.released_nodes.values())

    def __str__(self) -> str:
        verb = "would release" if self.dry_run else "released"
        ops = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in self.released_nodes.items())
        lines = [
            f"{self.call} {verb} {self.released_tensors} saved tensor(s) of "
            f"{self.released_node_count} node(s): {format_bytes(self.bytes_freed)} freed",
            f"  nodes: {ops or '-'}",
            f"  kept by the trunk: {format_bytes(self.bytes_kept)}",
        ]
        lines += [f"  kept {r}" for r in self.kept]
        if self.strategy:
            lines.append(f"  strategy: {self.strategy}")
        return "\n".join(lines)


def nothing_released(call: str, strategy: str | None = None) -> PruneReport:
    """The report of a pass with no graph to prune (a leaf's: it only writes ``.grad``)."""
    return PruneReport(call=call, dry_run=False, released_nodes={}, released_tensors=0, bytes_freed=0,
                       bytes_kept=0, strategy=strategy)


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest unit that leaves at least 1 at one decimal.

    Example::

        >>> format_bytes(512), format_bytes(1536), format_bytes(1048575), format_bytes(3 << 30)
        ('512 B', '1.5 KiB', '1.0 MiB', '3.0 GiB')
    """
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if abs(round(value, 1)) < 1024:  # 1048575 B is 1024.0 KiB at one decimal: 1.0 MiB
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _untracked_below(mine: dict) -> dict:
    """``{node: (handles, UNTRACKED)}`` of the graph below ``mine`` that no ``track()``
    built: the nodes whose saved tensors PyTorch holds, and those that save nothing on
    the way to one (``w.exp() + 1``: the add, then the exp). A node that saved
    graphprune's handles is another tape's: the walk stops there."""
    out: dict = {}
    state: dict = {}  # node -> True (untracked), False (not), None (saves nothing: its children decide)
    stack = [(child, False) for node in mine for child in children(node) if child not in mine]
    while stack:
        node, settled = stack.pop()
        if settled:  # its children were seen: untracked if one of them is
            if any(state.get(child) for child in children(node)):
                state[node] = True
                out[node] = ([], UNTRACKED)
            else:
                state[node] = False
            continue
        if node in state or node in mine:
            continue
        handles, kind = saved(node)
        if kind == UNTRACKED:
            state[node] = True
            out[node] = (handles, kind)
            stack += [(child, False) for child in children(node)]
        elif handles or kind != TRACKED or is_accumulator(node):
            state[node] = False
        else:
            state[node] = None
            stack.append((node, True))
            stack += [(child, False) for child in children(node)]
    return out


def snapshot(tape) -> nx.DiGraph:
    """Copy the live graph of ``tape``'s forwards into a plain ``DiGraph``: the nodes
    that the live tracked tensors reach and that the tape built, and below them those
    that no ``track()`` built (``x = w.exp()`` before the block: PyTorch holds what they
    saved)."""
    trunk = reach(live_roots(), through_released=False)
    mine = {}
    for node in reach(live_roots(finished=True)):
        handles, kind = saved(node)
        if tape.owns(node, handles, kind):
            mine[node] = (handles, kind)
    mine.update(_untracked_below(mine))
    for node in list(mine):  # the leaves it accumulates into
        for child in children(node):
            if child not in mine and name(child) == "AccumulateGrad":
                mine[child] = ([], TRACKED)
    out = nx.DiGraph()
    for node, (handles, kind) in mine.items():
        live = [h for h in handles if h.tensor is not None]
        if RELEASED in node.metadata:
            state = "released"
        elif kind != TRACKED:
            state = "untracked"
        else:
            state = "trunk" if node in trunk else "branch"
        out.add_node(id(node), op=name(node), saved_tensors=len(live), saved_bytes=unique_bytes(live),
                     state=state)
    out.add_edges_from((id(node), id(child)) for node in mine for child in children(node) if child in mine)
    return out
