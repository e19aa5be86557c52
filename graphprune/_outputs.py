"""Weak references to the tensors that tracked forwards created, and where.

``keep=None`` protects the graphs of the tensors the program still holds. The
output recorder notes each output with a ``grad_fn`` as one :class:`Output` (a weak
reference with the code object and instruction of the user's frame that made it):
one object per output, no callback, nothing else. Dead references are dropped in
batches: those of the last ``TAIL`` outputs once that many were noted (NOTE [ Records
that die young ]); all of them when the outermost tape closes, if the list has doubled
since the last time (amortized O(1) per output), when it outgrows its limit, and at
each prune.

NOTE [ Records that die young ]
Most outputs of a forward are intermediates that die within a few torch calls (the
graph holds detached copies of what it saves): their records are dead at once, but a
record lives until a compaction drops it. One that outlives two young collections of
Python's cyclic collector joins the old generation, and every full collection then
walks it, or counts it towards the next one (DESIGN.md fact 14): on a chain of tiny
ops, three forwards in a row paid ~1.2 µs per torch call for records already dead.
So every ``TAIL`` records the recorder drops the dead ones among them, before a young
collection (every 700 objects made) is likely to have seen them, and among those that
survived the earlier tails while they are at most ``TAIL`` (the output alive at each
compaction, which dies a call later): a compaction looks at no more than ``2 * TAIL``
records for ``TAIL`` new ones. Past that, the survivors are looked at again once they
have doubled since they last were (amortized O(1) per record): under one tape around
many steps that call no prune, an unrolled RNN's outputs held for a step and then
dropped would otherwise stay, dead, until the whole list reached its limit.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import threading
import types
import weakref

import torch
from torch.autograd.graph import Node

from ._marks import FINISHED

__all__ = [
    "Output", "FirstUse", "note", "note_one", "adopt", "in_library", "live", "live_graphs", "live_roots",
    "hooked_nodes", "output_of", "describe", "facts", "described", "name_in_frames", "settle",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
_LIBRARY_DIRS = tuple(sorted(os.path.join(d, "") for d in {  # with a separator: not graphprune_demo.py
    _TORCH_DIR, _OWN_DIR, *(p for p in (*site.getsitepackages(), site.getusersitepackages()) if p),
    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
} - {""}))


class Output(weakref.ref):
    """A tensor created under ``track()``: a weak reference, and the code and
    instruction of the frame that made it (``code`` is ``None`` where no Python frame
    made it). ``lasti`` is -1 for a tensor made before the tape opened, noted only so
    that it is not looked at again: it protects nothing."""

    __slots__ = ("code", "lasti")
    verb = "created at"  # what where() is, for a message

    @property
    def ours(self) -> bool:
        return self.lasti >= 0

    def where(self) -> str:
        if self.code is None:
            return "<unknown>"
        return _where(self.code, self.lasti)


class FirstUse(Output):
    """A tensor with a graph that no torch call under ``track()`` made (a custom
    ``autograd.Function``'s output: ``apply`` is no torch call), noted where a tracked
    call first used it: its ``where()`` is that call's line, not the line that made it."""

    __slots__ = ()
    verb = "first used at"


_RECORDS = (Output, FirstUse)


def _where(code, lasti: int) -> str:
    """``file.py:line`` of instruction ``lasti`` of ``code``: a scan of its line table
    (~20 µs in a long function), which every prune's reason text asks for, made once.
    Keyed by the code's ``id`` (NOTE [ Code objects as keys ]): two code objects that
    compare equal (one function in two files) are two sites."""
    key = (id(code), lasti)
    made = _where_made.get(key)
    if made is None or made[0]() is not code:  # none, or of a code object that died
        if len(_where_made) > 4096:
            _where_made.clear()
        line = next((ln for start, end, ln in code.co_lines() if start <= lasti < end), None)
        text = f"{os.path.basename(code.co_filename)}:{line or code.co_firstlineno}"
        made = _where_made[key] = (weakref.ref(code), text)
    return made[1]


# (id of code, instruction) -> (a weak reference to the code, "file.py:line"): code made
# per step (eval) is not held
_where_made: dict[tuple[int, int], tuple] = {}

_outputs: list[Output] = []
_weakrefcount = weakref.getweakrefcount
_limit = [1 << 16]
_compacting = threading.Lock()
_library_files: dict[str, bool] = {}  # a code object's file -> inside a library

# NOTE [ Code objects as keys ]
# Hashing a code object is no pointer hash: CPython 3.11 rebuilds its bytecode and
# hashes it with its constants and names on every call (0.9 µs for
# ``Module._call_impl``, 1.6 for ``F.multi_head_attention_forward`` on a slow
# machine), and the recorder looks up one or more frames' code per torch call. So
# the tables that run per call are keyed by ``id(code)``, and hold the code objects
# they have seen weakly, dropping a code's entries as it dies (code made per step by
# ``eval`` is not kept), so that an id is never another code object's while its entry
# lives. Whether a frame is a library's is a property of its file alone: that
# table is keyed by ``co_filename``, a string whose hash is cached (one attribute
# read and no call per frame of the walk ``note_one`` makes up the module stack).


def note(tensors, ours: bool = True) -> None:
    """Note ``tensors``, which no torch call under a tape made, as live: ``ours`` for
    those with a graph built under a tape (a custom ``Function``'s outputs, noted where
    a tracked call first uses them: :class:`FirstUse`), ``ours=False`` for tensors made
    before any tape opened, noted only so that they are not looked at again."""
    for t in tensors:
        if ours:
            note_one(t, record=FirstUse)
        elif not weakref.getweakrefcount(t) or output_of(t) is None:
            ref = Output(t)
            ref.code, ref.lasti = None, -1
            made_before[0] += 1
            _append(ref)


made_before = [0]  # records note(ours=False) made: while none, in-place ops ask nothing (_tape._adopt)


def adopt(ref: Output, frame=None) -> None:
    """``ref``'s tensor, made before a tape (its record protects nothing), was modified
    in place under one, so its graph is the tape's now: it protects it from here on, as
    made at ``frame``'s line (the first frame outside torch and graphprune from it)."""
    while frame is not None and _inside_library(frame.f_code):
        frame = frame.f_back
    ref.code, ref.lasti = (None, 0) if frame is None else (frame.f_code, frame.f_lasti)


def note_one(t: torch.Tensor, frame=None, record=Output) -> None:
    """Note ``t``, made by a torch call under a tape, with the user's frame that made
    it: the first one outside torch and graphprune, from ``frame`` (the torch call's
    caller, if the recorder has it) outwards (none in a TorchScript fork's interop
    thread). This runs for every torch call."""
    if _weakrefcount(t) and output_of(t) is not None:  # an op that returned its
        return  # input (in place, ``contiguous()``): noted once, however often
    if frame is None:
        try:
            frame = sys._getframe(2)  # this, the recorder, then the caller of the torch call
        except ValueError:
            frame = None
    library = _library_files.get  # NOTE [ Code objects as keys ]
    while frame is not None:
        code = frame.f_code
        inside = library(code.co_filename)
        if not inside and (inside is not None or not _inside_library(code)):
            break
        frame = frame.f_back
    ref = record(t)
    if frame is None:
        ref.code, ref.lasti = None, 0
    else:
        ref.code, ref.lasti = code, frame.f_lasti
    _outputs.append(ref)  # _append, inlined
    if len(_outputs) > _next[0]:
        _maintain()


def _inside_library(code) -> bool:
    """Whether ``code`` belongs to torch, graphprune, an installed package or the
    standard library: a creation site is the user's own line, not one of those."""
    file = code.co_filename
    inside = _library_files.get(file)
    if inside is None:
        if len(_library_files) > 65536:  # generated code (torch.fx, exec) makes ever new file names
            _library_files.clear()
        inside = _library_files[file] = file.startswith(_LIBRARY_DIRS)
    return inside


in_library = _inside_library


def _append(ref: Output) -> None:
    _outputs.append(ref)
    if len(_outputs) > _next[0]:
        _maintain()


TAIL = 256  # NOTE [ Records that die young ]


def _maintain() -> None:
    """The list passed ``_next``: compact all of it past its limit, else its tail."""
    if len(_outputs) > _limit[0]:
        _compact()
    else:
        _compact_tail()


def _compact_tail() -> None:
    """Drop the dead references among those noted since the last compaction of any
    kind, and among the survivors of the earlier tails while they are few (NOTE
    [ Records that die young ]); appends from other threads are kept."""
    _drop_dead(whole=False)


def _compact() -> None:
    """Drop dead references; appends from other threads during it are kept. The list
    may then double before an append compacts it again."""
    _drop_dead(whole=True)


def _drop_dead(whole: bool) -> None:
    """Drop the dead references of the whole list, or of its tail (:func:`_compact_tail`)."""
    if not _compacting.acquire(blocking=False):
        return
    try:
        n = len(_outputs)
        survivors = _tail[0] - _kept[0]  # of the earlier tails
        if whole:
            start = 0
        elif survivors <= TAIL or survivors > 2 * _survivors[0]:  # few, or doubled: them too
            start = _kept[0]
        else:
            start = _tail[0]
        _outputs[start:n] = [r for r in _outputs[start:n] if r() is not None]
        _tail[0] = len(_outputs)
        if whole:
            _kept[0] = _tail[0]
            _limit[0] = max(1 << 16, 2 * _kept[0])
        if start <= _kept[0]:
            _survivors[0] = _tail[0] - _kept[0]
        _next[0] = min(_limit[0], _tail[0] + TAIL)
    finally:
        _compacting.release()


_kept = [0]  # the list's length after the last compaction of all of it
_tail = [0]  # its length after the last compaction of any kind: where the tail starts
_next = [TAIL]  # the length past which an append compacts (the tail, or all past the limit)
_survivors = [0]  # the earlier tails' survivors after they were last looked at


def settle() -> None:
    """A tape closed: drop the dead references, of the whole list if it has doubled
    since its last compaction, else of its tail (so amortized O(1) per output, however
    many are held). The records of a forward's intermediates, dead once it returns,
    then do not stay: memory, and objects for every full collection to walk (DESIGN.md
    fact 14)."""
    if len(_outputs) > 2 * _kept[0] + 1024:
        _compact()
    else:
        _compact_tail()


def live(made_before: bool = False) -> list[torch.Tensor]:
    """Every live tensor a tracked forward made (``made_before``: and those made before
    a tape opened that a tracked call used)."""
    _compact()
    return [t for t in (r() for r in list(_outputs) if made_before or r.ours) if t is not None]


def hooked_nodes() -> set:
    """The ``grad_fn`` of each live tensor graphprune has noted (made under a tape, or
    before one and used by a tracked call) that has tensor hooks."""
    out = set()
    for t in live(made_before=True):
        try:
            if t._backward_hooks and t.grad_fn is not None:
                out.add(t.grad_fn)
        except RuntimeError:  # a view made under no_grad and modified in place
            continue
    return out


def output_of(t: torch.Tensor) -> Output | None:
    return next((r for r in weakref.getweakrefs(t) if type(r) in _RECORDS), None)


def describe(t: torch.Tensor) -> str:
    """``tensor of shape (4,), torch.float32, created at model.py:12``."""
    return described(facts(t))


def facts(t: torch.Tensor) -> tuple:
    """What :func:`describe` says of ``t``, read now, to be written out later
    (:func:`described`) if a message needs it: its shape, dtype and record (which
    outlives ``t`` while held)."""
    try:
        shape = t.shape
    except RuntimeError:  # nested tensors have no single shape
        shape = None
    return shape, t.dtype, output_of(t)


def described(read: tuple) -> str:
    """:func:`describe`'s text from what :func:`facts` read."""
    shape, dtype, ref = read
    text = f"tensor of shape {'nested' if shape is None else tuple(shape)}, {dtype}"
    if ref is not None and ref.ours:
        text += f", {ref.verb} {ref.where()}"
    return text


def live_graphs(exclude=()) -> list[tuple[Node, torch.Tensor]]:
    """``(grad_fn, tensor)`` of each live tracked tensor not in ``exclude`` that has a
    graph: found through its current ``grad_fn`` (in-place ops move it)."""
    out = []
    for t in live():
        if any(t is e for e in exclude):
            continue
        try:
            fn = t.grad_fn
        except RuntimeError:  # a view made under no_grad and modified in place
            continue
        if fn is not None:
            out.append((fn, t))
    return out


def live_roots(exclude=(), finished: bool = False) -> list[Node]:
    """The ``grad_fn`` of each live tracked tensor not in ``exclude`` that still
    protects something: an output whose graph a pruned pass ran through in full (its
    node finished) protects nothing (``finished=True`` lists those too)."""
    return [fn for fn, _ in live_graphs(exclude) if finished or fn.metadata.get(FINISHED) is not True]


def name_in_frames(t: torch.Tensor, frames: int = 3, deep: bool = False) -> str | None:
    """A name the user's code has for ``t`` right now, looked up in the locals of the
    first ``frames`` frames outside torch and graphprune: a variable (``logits``), an
    item or attribute of one (``losses[2]``, ``out["logits"]``, ``out.logits``,
    ``self.loss``; ``deep``: an item of an output object's tuple, ``out.hidden_states[0]``),
    then in those frames' modules' globals. ``None`` if none holds it. For messages
    only: it walks frames."""
    frame = sys._getframe(1)
    seen = 0
    modules: dict[int, dict] = {}
    while frame is not None and seen < frames:
        if not _inside_library(frame.f_code):
            seen += 1
            found = _name_in(t, _locals_of(frame), deep)
            if found is not None:
                return found
            modules.setdefault(id(frame.f_globals), frame.f_globals)
        frame = frame.f_back
    for module_globals in modules.values():
        found = _name_in(t, module_globals, deep)
        if found is not None:
            return found
    return None


_SNAPSHOTS = sys.version_info < (3, 13)  # PEP 667: from 3.13 f_locals is a view, no copy
_CO_OPTIMIZED = 0x1


def _locals_of(frame) -> dict:
    """A copy of ``frame``'s locals that leaves nothing behind.

    Before Python 3.13, ``frame.f_locals`` of a function's frame copies its locals into
    a dict the frame keeps until it ends: a tensor the function then ``del``s would
    stay alive through it (its memory, and the graph it holds). So the copy is taken
    and the frame's dict emptied; the next reader (a debugger, ``locals()``) refills it.
    Not where the program holds that dict (``cfg = locals()``: the one dict a frame
    has): it stays, refreshed as a ``locals()`` call would refresh it.
    """
    if not (_SNAPSHOTS and frame.f_code.co_flags & _CO_OPTIMIZED):
        return frame.f_locals
    snapshot = frame.f_locals
    mine = dict(snapshot)
    if sys.getrefcount(snapshot) <= _FRAMES_OWN:
        snapshot.clear()
    return mine


_FRAMES_OWN = 3  # references to a frame's locals dict nobody else holds: the frame's, ours, getrefcount's
_SCAN_AT_MOST = 256  # items of a container name_in_frames looks through: a loss is in a short list


def _name_in(t: torch.Tensor, local_vars, deep: bool = False) -> str | None:
    """The name ``local_vars`` have for ``t``: a variable, or an item or attribute of
    one, or (``deep``: for an error's hint, not a report's text, which every prune
    writes) an item of a sequence an output object holds (``out.hidden_states[-1]``);
    containers of more than ``_SCAN_AT_MOST`` items (a metrics log) are passed over."""
    items = list(local_vars.items())
    for name, value in items:
        if value is t:
            return name
    outputs = []  # objects whose sequences are read next: a model output's tuples
    for name, value in items:
        found = _member_is(value, t)
        if found is not None:
            return name + found
        if deep and (type(value) is not dict and isinstance(value, dict) or (
                _has_attrs(value) and not isinstance(value, _NOT_OUTPUTS))):
            outputs.append((name, value))
    for name, value in outputs:
        members = value if isinstance(value, dict) else vars(value)
        if len(members) > _SCAN_AT_MOST:
            continue
        for key, v in members.items():
            if isinstance(v, (list, tuple)):
                found = _member_is(v, t)
                if found is not None:
                    return name + _suffix(value, key) + found
    return None


_NOT_OUTPUTS = (types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module)


def _has_attrs(value) -> bool:
    return hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type))


def _member_is(value, t: torch.Tensor) -> str | None:
    """The suffix that names ``t`` in ``value`` (``[2]``, ``["logits"]``, ``.loss``): an
    item of a list or tuple, a value of a dict, an attribute of an object; ``None``."""
    if isinstance(value, (list, tuple)):
        if len(value) <= _SCAN_AT_MOST:
            for i, v in enumerate(value):
                if v is t:
                    return f"[{i}]"
    elif isinstance(value, dict):
        if len(value) <= _SCAN_AT_MOST:
            for key, v in value.items():
                if v is t:
                    return _suffix(value, key)
    elif _has_attrs(value):
        attrs = vars(value)
        if len(attrs) <= _SCAN_AT_MOST:
            for attr, v in attrs.items():
                if v is t:
                    return f".{attr}"
    return None


def _suffix(value, key) -> str:
    """``.key`` where ``value`` reads ``key`` as an attribute too (a ``ModelOutput``, an
    object), else ``[key]``."""
    if not isinstance(value, dict):
        return f".{key}"
    as_attr = isinstance(key, str) and getattr(value, key, None) is value[key]
    return f".{key}" if as_attr else f"[{key!r}]"
