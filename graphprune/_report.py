"""What a prune released and kept, and why; graph snapshots for inspection."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import networkx as nx
import torch

from ._graph import MODEL
from ._saved import SavedHandle

__all__ = ["PruneReport", "KeptReason", "unique_bytes", "exclusive_bytes", "snapshot"]


def unique_bytes(handles: list[SavedHandle]) -> int:
    """Bytes of the distinct storages behind ``handles``."""
    return sum({h.storage_key: h.nbytes for h in handles}.values())


def exclusive_bytes(handles: list[SavedHandle]) -> int:
    """Bytes that dropping ``handles`` gives back: storages nothing else uses."""
    by_storage: dict[tuple, list[SavedHandle]] = collections.defaultdict(list)
    for h in handles:
        by_storage[h.storage_key].append(h)
    total = 0
    for group in by_storage.values():
        try:
            storage = group[0].tensor.untyped_storage()
            others = torch._C._storage_Use_Count(storage._cdata) - 1 - len(group)
        except (RuntimeError, NotImplementedError, AttributeError):
            others = 0
        if others <= 0:
            total += group[0].nbytes
    return total


@dataclass(frozen=True)
class KeptReason:
    """Nodes of the pruned graph that keep their saved tensors, and why."""

    reason: str
    nodes: int
    saved_bytes: int | None  # None: held by PyTorch or other hooks, not measured

    def __str__(self) -> str:
        held = "bytes unknown" if self.saved_bytes is None else _fmt_bytes(self.saved_bytes)
        return f"{self.nodes} node(s), {held}: {self.reason}"


@dataclass(frozen=True)
class PruneReport:
    """The outcome of :func:`~graphprune.prune_after`, :func:`~graphprune.backward`,
    :func:`~graphprune.grad` or :func:`~graphprune.explain` (``dry_run=True``).

    Byte counts are of unique storages: ``bytes_freed`` counts only storages that
    nothing but the released handles used, ``bytes_kept`` the storages the kept part
    of the graph (the trunk) still holds, leaves (parameters, inputs) left out.
    """

    call: str
    dry_run: bool
    released_nodes: dict[str, int]
    released_tensors: int
    bytes_freed: int
    bytes_kept: int
    kept: tuple[KeptReason, ...] = field(default=())

    @property
    def released_node_count(self) -> int:
        return sum(self.released_nodes.values())

    def __str__(self) -> str:
        verb = "would release" if self.dry_run else "released"
        ops = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in self.released_nodes.items())
        lines = [
            f"{self.call} {verb} {self.released_tensors} saved tensor(s) of "
            f"{self.released_node_count} node(s): {_fmt_bytes(self.bytes_freed)} freed",
            f"  nodes: {ops or '-'}",
            f"  kept by the trunk: {_fmt_bytes(self.bytes_kept)}",
        ]
        lines += [f"  kept {r}" for r in self.kept]
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def snapshot(tape_id: int | None = None) -> nx.DiGraph:
    """Copy the live model (one tape's nodes, or all) into a plain ``DiGraph``."""
    from ._tape import LIVE

    with MODEL.lock:
        MODEL.purge()
        g = MODEL.graph
        trunk = MODEL.reach((node_id for node_id, _ in LIVE.roots()), through_released=False)
        keep = [n for n, d in g.nodes(data=True) if tape_id is None or d["tape"] == tape_id]
        out = nx.DiGraph()
        for n in keep:
            d = g.nodes[n]
            handles = [h for h in (r() for r in d["handles"]) if h is not None]
            live = [h for h in handles if not h.released]
            if n in MODEL.released:
                state = "released"
            elif d["tape"] is None or d["foreign"]:
                state = "untracked"
            else:
                state = "trunk" if n in trunk else "branch"
            out.add_node(
                n, op=d["op"], saved_tensors=len(live), saved_bytes=unique_bytes(live), state=state
            )
        out.add_edges_from(g.subgraph(keep).edges())
    return out
