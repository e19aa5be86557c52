"""``track()``: saved-tensor hooks and an output recorder around forward passes."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import weakref
from typing import NamedTuple

import networkx as nx
import torch
from torch.overrides import TorchFunctionMode

from ._graph import MODEL, pending_handles, stamp
from ._saved import SavedHandle

__all__ = ["Tape", "track", "LIVE", "LiveTensor"]

_tape_ids = itertools.count(1)
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


class LiveTensor(NamedTuple):
    """A tensor created under ``track()``: a weak reference and the line that made it."""

    ref: weakref.ref
    where: tuple[str, int]

    def describe(self) -> str:
        t = self.ref()
        path, line = self.where
        shape = "?" if t is None else tuple(t.shape)
        dtype = "?" if t is None else t.dtype
        return f"tensor of shape {shape}, {dtype}, created at {os.path.basename(path)}:{line}"


class _LiveTensors:
    """Weak references to every tensor with a ``grad_fn`` that a tape saw created."""

    def __init__(self) -> None:
        self._by_id: dict[int, LiveTensor] = {}

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._by_id.get(key)
        if entry is not None and entry.ref is ref:
            del self._by_id[key]

    def _entry(self, t: torch.Tensor) -> LiveTensor | None:
        entry = self._by_id.get(id(t))  # ids are reused: check it is still this tensor
        return entry if entry is not None and entry.ref() is t else None

    def add(self, t: torch.Tensor, where: tuple[str, int]) -> None:
        if self._entry(t) is None:
            key = id(t)
            self._by_id[key] = LiveTensor(weakref.ref(t, functools.partial(self._forget, key)), where)

    def has(self, t: torch.Tensor) -> bool:
        return self._entry(t) is not None

    def roots(self, exclude: tuple = ()) -> list[tuple[int, LiveTensor]]:
        """``(node id, entry)`` of each live tensor not in ``exclude`` that still
        protects something: its graph is found again through its current
        ``grad_fn`` (in-place ops move it), and an output already pruned (its node
        finished) protects nothing."""
        out = []
        for entry in list(self._by_id.values()):
            t = entry.ref()
            if t is None or any(t is e for e in exclude):
                continue
            fn = t.grad_fn
            if fn is not None and (n := stamp(fn)) not in MODEL.finished:
                out.append((n, entry))
        return out

    def describe(self, t: torch.Tensor) -> str:
        entry = self._entry(t)
        return entry.describe() if entry else f"tensor of shape {tuple(t.shape)}, {t.dtype}"


LIVE = _LiveTensors()
_library_file: dict[str, bool] = {}  # co_filename -> inside torch or graphprune
_active = threading.local()  # .tapes: this thread's open tapes, innermost last


def _caller() -> tuple[str, int]:
    """``(file, line)`` of the first frame outside torch and graphprune."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        inside = _library_file.get(path)
        if inside is None:
            inside = _library_file[path] = path.startswith((_TORCH_DIR, _OWN_DIR))
        if not inside:
            return path, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def _open_tapes() -> list:
    tapes = getattr(_active, "tapes", None)
    if tapes is None:
        tapes = _active.tapes = []
    return tapes


def _owner_seq(t: torch.Tensor, seq: int) -> int:
    """Sequence number of the node that saves ``t``: the last one built (DESIGN.md
    fact 4), with two exceptions where ``t``'s own node was built after the saver.

    - In-place ops that save their input as it was (``mul_``, ``clamp_min_``) save a
      clone, whose CloneBackward0 came after them.
    - In-place ops on a view that save their result (``h[1:3].sigmoid_()``) save the
      view after autograd rebuilt its ``grad_fn``, a view replay over the
      ``CopySlices`` that runs the op; the replay saves nothing itself.
    """
    fn = t.grad_fn
    if fn is None or fn._sequence_nr() != seq:
        return seq
    if fn.name() == "CloneBackward0":
        return seq - 1
    if t._is_view():
        base = fn.next_functions[0][0] if fn.next_functions else None
        if base is not None and base.name().endswith("CopySlices"):
            return base._sequence_nr()
    return seq


def _is_own_hook(hooks) -> bool:
    return hooks is not None and getattr(hooks[0], "__graphprune__", False)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


class _OutputRecorder(TorchFunctionMode):
    """Sees every Python-level torch call under the tape and records its tensors."""

    def __init__(self, tape: Tape):
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tape = self.tape
        if _open_tapes()[-1] is not tape:  # an inner tape records this call
            return func(*args, **(kwargs or {}))
        first = torch._C._autograd._get_sequence_nr()
        out = func(*args, **(kwargs or {}))
        outs = _tensors(out)
        if outs:
            tape._record(outs, range(first, torch._C._autograd._get_sequence_nr()))
        tape._record_inputs(args)
        return out


class Tape:
    """The record of forward passes run inside one ``with graphprune.track():``.

    Use :func:`track` to make one. Holding a tape keeps no tensor and no node alive.
    """

    def __init__(self) -> None:
        self.id = next(_tape_ids)
        self.saved_count = 0
        self._first_seq = 0
        self._thread = None
        self._hooks = None
        self._mode = None

    # -- hooks ---------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> SavedHandle:
        seq = _owner_seq(t, torch._C._autograd._get_sequence_nr() - 1)
        handle = SavedHandle(t, seq, self.id)
        pending = pending_handles()
        pending.setdefault(seq, []).append(weakref.ref(handle))
        self.saved_count += 1
        if len(pending) > 65536:
            _forget_dead(pending)
        return handle

    def _record(self, outs: list[torch.Tensor], window: range) -> None:
        """Stamp the nodes a torch call made and note its outputs as live tensors."""
        where = None
        for t in outs:
            fn = t.grad_fn
            if fn is None:
                continue
            if where is None:
                where = _caller()
                top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            stamp(fn, self.id, foreign=not _is_own_hook(top), since=self._first_seq, window=window)
            LIVE.add(t, where)

    def _record_inputs(self, args) -> None:
        """Note tensors the recorder never saw made: outputs of ``autograd.Function``
        (custom ops, reentrant checkpoint), whose ``apply`` is no torch call."""
        for a in args:
            for t in _tensors(a):
                if LIVE.has(t):
                    continue
                fn = t.grad_fn
                if fn is not None and fn._sequence_nr() >= self._first_seq:
                    stamp(fn, self.id, since=self._first_seq)
                    LIVE.add(t, _caller())

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Tape:
        if self._hooks is not None:
            raise RuntimeError("graphprune.track: this tape is already active; use a new track()")
        self._thread = threading.get_ident()
        self._first_seq = torch._C._autograd._get_sequence_nr()
        pack = self._pack
        unpack = SavedHandle.unpack

        def pack_hook(t):
            return pack(t)

        pack_hook.__graphprune__ = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack)
        self._mode = _OutputRecorder(self)
        self._hooks.__enter__()
        try:
            self._mode.__enter__()
        except BaseException:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            raise
        _open_tapes().append(self)
        return self

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError("graphprune.track: a tape must be closed in the thread that opened it")
        try:
            _open_tapes().remove(self)
            self._mode.__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            self._hooks = self._mode = None

    # -- inspection ----------------------------------------------------------------------
    def graph(self) -> nx.DiGraph:
        """A snapshot of this tape's live ``grad_fn`` graph as a ``networkx.DiGraph``.

        Nodes are integer ids with attributes ``op`` (e.g. ``"MulBackward0"``),
        ``saved_bytes`` (unique storage still held), ``saved_tensors`` and ``state``:
        ``"trunk"`` (a live tensor created under ``track()`` still reaches it),
        ``"branch"`` (none does), ``"released"`` (graphprune freed its saved tensors)
        or ``"untracked"`` (built outside ``track()`` or under other saved-tensor
        hooks). Edges follow ``next_functions``. The snapshot holds only ints and
        strings, never a node or a tensor.

        Example::

            >>> import torch, graphprune as gp
            >>> w = torch.ones(3, requires_grad=True)
            >>> with gp.track() as tape:
            ...     y = (w * 2).exp().sum()
            >>> g = tape.graph()
            >>> sorted(d["op"] for _, d in g.nodes(data=True))
            ['AccumulateGrad', 'ExpBackward0', 'MulBackward0', 'SumBackward0']
        """
        from ._report import snapshot

        return snapshot(tape_id=self.id)

    def __repr__(self) -> str:
        state = "active" if self._hooks is not None else "closed"
        return f"<graphprune.Tape {self.id} {state}, {self.saved_count} tensors saved>"


def _forget_dead(pending: dict) -> None:
    for seq in [s for s, refs in pending.items() if all(r() is None for r in refs)]:
        del pending[seq]


def track() -> Tape:
    """Record the forward passes run in a ``with`` block, so that they can be pruned.

    Inside the block, graphprune's saved-tensor hooks hold every tensor that
    autograd saves, and an output recorder notes (weakly) every tensor created.
    Hooks are per thread and innermost-wins: a ``checkpoint`` or ``save_on_cpu``
    region inside the block keeps its own tensors, which graphprune leaves alone.

    Returns:
        A :class:`Tape`: a context manager, and ``tape.graph()`` afterwards.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(3, requires_grad=True)
        >>> with gp.track():
        ...     x = w + 10
        ...     y1 = (x * x).sum()
        >>> y1.backward(retain_graph=True)
        >>> gp.prune_after(y1).released_tensors
        2
        >>> (x.sqrt().sum()).backward()   # x's graph is still there
    """
    return Tape()

