"""A memory timeline: the bytes tracked saved tensors hold over a step, recorded only when asked.

NOTE [ What the timeline counts ]
The distinct storages that the saved tensors of ``track(timeline=tl)`` forwards hold,
parameters and views of them (``weight.t()``) left out: they live whatever the graph
does. A storage counts from the
first pack of a tensor on it until the last handle on it lets go: graphprune's
release, PyTorch's own free at the end of a pass without ``retain_graph``, or the
graph's death. The timeline's pack hook is graphprune's, plus one weak reference with
a callback on the tensor the handle holds (a non-leaf's ``detach()`` alias; for a
leaf that needs no grad, an input or a dropout mask, an alias made here), so the
callback fires when the handle drops it, whichever way. A tensor you hold yourself
(the trunk's output in a local) is counted until the graph lets go of it.

Without a timeline none of this exists: ``track()`` installs the plain pack hook.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from ._saved import SavedHandle, _modes_on, _NoTorchFunction, pack_hook, storage_of

__all__ = ["Timeline", "Event", "plot_timeline"]


class Event(NamedTuple):
    """One point of a :class:`Timeline`: the bytes held right after it."""

    time: float  # seconds since the timeline was made
    bytes: int
    kind: str  # "pack", "free" or "mark"
    label: str  # a mark's label; "" for the others
    in_backward: bool  # inside a backward pass (PyTorch's engine was running)


class Timeline:
    """Bytes held by tracked saved tensors, event by event (NOTE [ What the timeline counts ]).

    Pass it to :func:`~graphprune.track` (``track(timeline=tl)``); it records each
    saved tensor packed in that block and each one let go, whenever that happens;
    :meth:`mark` adds labelled points (the phases of a step). One timeline may
    record several tapes, one after the other. ``label`` names it in
    :func:`plot_timeline`'s legend.

    Example::

        >>> import torch, graphprune as gp
        >>> tl = gp.Timeline("graphprune")
        >>> w = torch.ones(1024, requires_grad=True)
        >>> with gp.track(timeline=tl):
        ...     x = w.exp()
        ...     y = (x * x).sum()
        >>> tl.bytes                   # x, saved by exp (its output) and by mul
        4096
        >>> tl.mark("forward")
        >>> report = gp.backward(y, keep=[])
        >>> tl.bytes, tl.peak, report.bytes_freed
        (0, 4096, 0)
        >>> [e.kind for e in tl.events]  # a free per handle that lets go
        ['pack', 'pack', 'pack', 'mark', 'free', 'free', 'free']

    ``bytes_freed`` is 0 there because ``x`` is still held by the local ``x``; the
    timeline counts what the graph holds.
    """

    def __init__(self, label: str = "graphprune") -> None:
        self.label = label
        self.events: list[Event] = []
        self._t0 = time.perf_counter()
        self._held: dict[int, list[int]] = {}  # storage key -> [bytes, handles holding it]
        self._bytes = 0
        self._peak = 0
        self._refs: set = set()  # the weak references whose callbacks count the frees
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    @property
    def peak(self) -> int:
        """The most bytes held at any event so far."""
        return self._peak

    def mark(self, label: str) -> None:
        """Add a labelled point (``"forward"``, ``"after head 0"``) at the current bytes."""
        with self._lock:
            self._record("mark", label)

    def pack_hook(self, tape: int):
        """The pack hook a tape installs for this timeline: graphprune's, counted."""

        pack = pack_hook(tape)

        def timed_pack(t: torch.Tensor) -> SavedHandle:
            if _modes_on() and type(t) is torch.Tensor:  # NOTE [ Reads no mode sees ] in _saved.py
                with _NoTorchFunction():
                    return counted(t)
            return counted(t)

        def counted(t: torch.Tensor) -> SavedHandle:
            h = pack(t)
            if h.leaf:
                if t.requires_grad:  # a parameter, or a view of one (``weight.t()``): not the graph's memory
                    return h
                h.tensor = t.detach()  # an alias of its own, to see when the handle lets go
            self._add(h)
            return h

        timed_pack.__graphprune__ = True
        return timed_pack

    def _add(self, h: SavedHandle) -> None:
        key, nbytes = storage_of(h)
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                self._held[key] = [nbytes, 1]
                self._bytes += nbytes
            else:
                if nbytes > entry[0]:  # a wider span of a storage already counted
                    self._bytes += nbytes - entry[0]
                    entry[0] = nbytes
                entry[1] += 1
            self._refs.add(weakref.ref(h.tensor, lambda ref, key=key: self._drop(key, ref)))
            self._record("pack", "")

    def _drop(self, key: int, ref) -> None:
        with self._lock:
            self._refs.discard(ref)
            entry = self._held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]
                self._bytes -= entry[0]
            self._record("free", "")

    def _record(self, kind: str, label: str) -> None:
        self._peak = max(self._peak, self._bytes)
        backward = torch._C._current_graph_task_id() != -1
        self.events.append(Event(time.perf_counter() - self._t0, self._bytes, kind, label, backward))

    def __repr__(self) -> str:
        return f"<graphprune.Timeline {self.label!r}: {len(self.events)} events, peak {self.peak} B>"


def plot_timeline(runs, path: str, title: str | None = None) -> None:
    """Draw ``runs`` (a :class:`Timeline` or a list of them) on one plot, one line each,
    and save it to ``path`` (``.png``, ``.svg``, ``.pdf``; needs matplotlib), with
    ``title`` above it if given.

    Where every run has the same marks in the same order (one step, by several
    strategies), the x axis is the phases between the marks, each run's events spread
    by time within a phase, so the phases line up; otherwise it is milliseconds.

    Example::

        >>> import os, tempfile, torch, graphprune as gp
        >>> tl = gp.Timeline()
        >>> with gp.track(timeline=tl):
        ...     y = torch.ones(8, requires_grad=True).exp().sum()
        >>> gp.plot_timeline([tl], os.path.join(tempfile.mkdtemp(), "memory.svg"))
    """
    from ._draw import figure, save

    if isinstance(runs, Mapping) or not isinstance(runs, (Timeline, Iterable)):
        hint = "; pass its timelines: list(d.values())" if isinstance(runs, Mapping) else ""
        raise TypeError("graphprune.plot_timeline: runs must be a graphprune.Timeline or a list of them, "
                        f"got {type(runs).__name__}{hint}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"graphprune.plot_timeline: path must be a file name (.png, .svg, .pdf), "
                        f"got {type(path).__name__}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"graphprune.plot_timeline: title must be a str, got {type(title).__name__}")
    runs = [runs] if isinstance(runs, Timeline) else list(runs)
    if not runs:
        raise ValueError("graphprune.plot_timeline: runs is empty; pass a Timeline or a list of them")
    for i, run in enumerate(runs):
        if not isinstance(run, Timeline):
            raise TypeError(f"graphprune.plot_timeline: runs[{i}] must be a graphprune.Timeline, "
                            f"got {type(run).__name__}")
    marks = [tuple(e.label for e in r.events if e.kind == "mark") for r in runs]
    aligned = bool(marks[0]) and all(m == marks[0] for m in marks)
    fig = figure(8, 4)
    ax = fig.add_subplot()
    for run in runs:
        xs = _phase_x(run.events) if aligned else [1000 * e.time for e in run.events]
        ax.step(xs, [e.bytes / 2**20 for e in run.events], where="post",
                label=f"{run.label} (peak {run.peak / 2**20:.1f} MiB)")
    if aligned:
        ax.set_xticks(range(1, len(marks[0]) + 1), marks[0], rotation=20, ha="right", fontsize=8)
        ax.grid(axis="x", linestyle=":")
        ax.set_xlabel("phase (events spread by time within each)")
    else:
        ax.set_xlabel("time, ms")
    ax.set_ylabel("MiB held by saved tensors")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "memory held by the graph's saved tensors")
    ax.legend(loc="upper right", fontsize=8)
    save(fig, path)


def _phase_x(events: list[Event]) -> list[float]:
    """x of each event: mark ``i`` at ``i``, events between marks spread by time (the
    first phase from the first event)."""
    out: list[float] = []
    start, start_t, pending = 0.0, events[0].time if events else 0.0, []
    for e in events:
        if e.kind != "mark":
            pending.append(e)
            continue
        span = (e.time - start_t) or 1.0
        out += [start + (p.time - start_t) / span for p in pending]
        start, start_t, pending = start + 1, e.time, []
        out.append(start)
    span = (events[-1].time - start_t) if pending else 1.0
    out += [start + (p.time - start_t) / (span or 1.0) for p in pending]
    return out
