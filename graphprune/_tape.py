"""``track()``: saved-tensor hooks and an output recorder around forward passes."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import types
import weakref
from weakref import getweakrefcount

import networkx as nx
import torch
from torch.overrides import TorchFunctionMode

from . import _outputs
from ._graph import attach_hidden, children
from ._marks import mark_hooked
from ._routing import stamp_setitem
from ._saved import SavedHandle, _modes_on, _NoTorchFunction, pack_hook
from ._timeline import Timeline
from ._warn import function_at, is_module_namespace

__all__ = ["Tape", "track"]

_tape_ids = itertools.count(1)
_OWN_FILE = f'"{__file__}"'
_CALL_NAME = ", in _graphprune_call\n"
_OVERRIDES_FILE = f'"{torch.overrides.__file__}"'
_HANDLER_NAME = ", in handle_torch_function\n"
_NoSubclassDispatch = torch._C.DisableTorchFunctionSubclass
# torch.compiler.is_compiling() in two reads where this torch has them: False, or
# True where Dynamo traces the recorder (it folds is_dynamo_compiling) or export runs
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_compiler = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else types.SimpleNamespace(
    _is_compiling_flag=False)
_anomaly_enabled = torch.is_anomaly_enabled
_note_one = _outputs.note_one
_made_before = _outputs.made_before
_getframe = sys._getframe
_local = threading.local()  # .tapes: this thread's open tapes, innermost last
_Tensor = torch.Tensor
_NO_KWARGS: dict = {}
_Size = torch.Size
_TENSOR_OR_SEQUENCE = (_Tensor, tuple, list)  # a tuple's subclass too: torch.return_types.max
_Parameter = torch.nn.Parameter  # dispatches no __torch_function__ of its own: read as a plain tensor
_REGISTERS_A_HOOK = "registers a hook"  # truthy: _inplace_funcs' rare branch
_ADDS_A_HOOK = "adds a hook"  # a tensor hook of another kind: nothing to mark
# func -> whether it modifies its first argument in place, or _REGISTERS_A_HOOK, _ADDS_A_HOOK
_HOOK_FUNCS = {torch.Tensor.register_hook: _REGISTERS_A_HOOK, torch.Tensor.retain_grad: _ADDS_A_HOOK,
               torch.Tensor.register_post_accumulate_grad_hook: _ADDS_A_HOOK}
_inplace_funcs: dict = dict(_HOOK_FUNCS)
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                            "and", "or", "xor", "lshift", "rshift", "matmul")
)


def _open_tapes() -> list:
    tapes = getattr(_local, "tapes", None)
    if tapes is None:
        tapes = _local.tapes = []
    return tapes


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "").split(".")[0]  # an aten overload's: add_.Tensor
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _lives_on(func) -> bool:
    """Whether ``func`` lives as long as the program whether graphprune holds it or
    not: a C function or a descriptor of a module or a class, or a function of a
    library's module (torch's ``F.*``, and the closures its decorators made once), an
    aten operator. A user's overridable function (``handle_torch_function(f, ...)``) may
    be made per call, closing over what it uses, or live in a namespace that dies
    (``runpy``): it is asked at each call (~0.5 µs)."""
    kind = type(func)
    if kind is types.FunctionType:  # a library's closures are its decorators' (Tensor.__rsub__, F.max_pool2d)
        return _outputs.in_library(func.__code__) and is_module_namespace(func.__globals__)
    if kind in _UNBOUND_KINDS or kind in _OPS:
        return True
    return kind in _BOUND_KINDS and (func.__self__ is None or isinstance(func.__self__, _LASTING_OWNERS))


_UNBOUND_KINDS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType)
_BOUND_KINDS = (types.BuiltinFunctionType, types.MethodWrapperType)  # torch.mul; a property's __get__
_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)  # torch.ops.aten.add_.Tensor, kept by torch
_LASTING_OWNERS = (types.ModuleType, type, types.GetSetDescriptorType, types.MemberDescriptorType, property)


def _own_pack_hook():
    """This thread's innermost pack hook if it is graphprune's, else ``None``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top[0] if top is not None and getattr(top[0], "__graphprune__", False) else None


# NOTE [ Modes below the recorder ]
# Inside a mode's ``__torch_function__`` the mode is off, and the modes below it on the
# stack are on: graphprune's own reads of a call's tensors (``is_leaf``,
# ``requires_grad``, ``grad_fn``) would reach a user's mode entered outside ``track()``
# (a logging mode, ``torch.device(...)``) as calls the program never made. With a mode
# below, the recorder runs with torch-function dispatch off, and the call itself in the
# state its caller had: the modes below see the calls a plain run makes, and only those.
# (The pack hook's reads are kept from them the same way: NOTE [ Reads no mode sees ].)
_torch_function_state = torch._C._get_torch_function_state
_set_torch_function_state = torch._C._set_torch_function_state
_ALL_DISABLED = torch._C._TorchFunctionState.ALL_DISABLED


class _OutputRecorder(TorchFunctionMode):
    """Sees every Python-level torch call under a tape and notes its outputs.

    NOTE [ What the forward pays ]: one weak reference per output with a ``grad_fn``
    (``is_leaf`` asks without creating a ``grad_fn`` wrapper). Inputs that the
    recorder never saw made (an ``autograd.Function``'s outputs: ``apply`` is no
    torch call) are noted when a later call uses them: a tensor with no weak
    reference at all cannot have been noted, so the check is one C call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = _NO_KWARGS  # unpacked by every callee, never changed
        if _dynamo_compiling() or _compiler._is_compiling_flag:  # traced (Dynamo, export):
            return func(*args, **kwargs)  # stay out of the compiled graph
        try:  # the caller's call site: NOTE [ Warnings at the caller's line ]
            frame = _getframe(1)
        except ValueError:  # no Python caller: a TorchScript fork's interop thread
            frame = None
            call = _call_directly
        else:
            caller = frame
            if frame.f_code is _HANDLE_TORCH_FUNCTION and frame.f_back is not None:
                caller = frame.f_back.f_back or frame
            call = _call_sites.get((id(caller.f_code), caller.f_lasti)) or _call_site(caller)
        if _modes_on():  # NOTE [ Modes below the recorder ]
            state = _torch_function_state()
            with _NoTorchFunction():
                return _record(func, args, kwargs, _in_state(call, state), frame)
        return _record(func, args, kwargs, call, frame)


def _record(func, args, kwargs, call, frame):
    """Make the call through ``call`` (the caller's call site) and note what it made."""
    if func is _SETITEM and args and type(args[0]) is _Tensor:
        return _call_setitem(call, func, args, kwargs, frame)
    try:
        inplace = _inplace_funcs.get(func)
    except TypeError:  # an unhashable callable that overrides (a dataclass instance): plain PyTorch never
        inplace = _is_inplace(func)  # hashes it; asked at each call, never cached
    if inplace is None:
        inplace = _is_inplace(func)
        if _lives_on(func):  # not a user's function or bound method made per call: its captures would stay
            if len(_inplace_funcs) > 65536:  # a library that makes ever new ones
                _inplace_funcs.clear()
                _inplace_funcs.update(_HOOK_FUNCS)
            _inplace_funcs[func] = inplace
    if inplace:  # rare: an in-place method, or a tensor hook's registration
        if inplace is _REGISTERS_A_HOOK:
            return _call_registering_hook(call, func, args, kwargs)
        if inplace is _ADDS_A_HOOK:
            _before_a_hook(call)
        elif args and isinstance(args[0], _Tensor):
            if _is_view(args[0]):
                return _call_inplace_on_view(call, func, args, kwargs, frame)
            if _made_before[0]:  # else no record to adopt: the common path below
                return _call_inplace(call, func, args, kwargs, frame)
    out = call(func, args, kwargs)
    if type(out) is _Tensor:  # the common case, inlined
        try:
            if not out.is_leaf:
                _note_one(out, frame)
            for a in args:
                if type(a) is _Tensor:
                    if not getweakrefcount(a) and a.requires_grad and not a.is_leaf:
                        _note_unseen(a)
                elif isinstance(a, (tuple, list)):
                    _note_unseen_in(a)
            if kwargs:  # torch.isfinite(input=loss)
                _note_unseen_in(_tensors_in(kwargs))
        except RuntimeError:  # a view made under no_grad, modified in place: its
            return out  # grad_fn raises, and plain PyTorch would never have read it
        if _anomaly_enabled():
            _drop_own_frames(out)
    elif len(args) == 1 and not kwargs and (
            (kind := type(a := args[0])) is _Tensor or kind is _Parameter) and (
            type(out) is _Size or not isinstance(out, _TENSOR_OR_SEQUENCE)):  # a plain
        try:  # tensor's property, size or dim: no tensor made, no subclass to keep out
            if not getweakrefcount(a) and a.requires_grad and not a.is_leaf:
                _note_unseen(a)
        except RuntimeError:  # a view made under no_grad, modified in place
            pass
    else:
        _note_safely(out, args, frame, kwargs)
    return out


def _in_state(call, state):
    """``call``, run with the torch-function state ``state`` (the caller's), from a block
    that turned torch-function dispatch off (NOTE [ Modes below the recorder ])."""
    def restored(func, args, kwargs):
        _set_torch_function_state(state)
        try:
            return call(func, args, kwargs)
        finally:
            _set_torch_function_state(_ALL_DISABLED)

    return restored


def _call_site(frame):
    """The ``_graphprune_call`` for the instruction ``frame`` is at, made and filed.

    NOTE [ Warnings at the caller's line ]
    Python attributes a warning raised inside a torch call to the innermost Python
    frame: under a ``TorchFunctionMode`` that is the mode's, not the caller's, which
    changes every warning's file, line, module and once-per-location registry. So the
    recorder makes every call it passes on (an item assignment and an in-place op on
    a view too) through a one-line function compiled as if it stood at the caller's
    line, in the caller's file, with the caller's globals (module and registry): the
    warning is filed exactly where plain PyTorch files it. One function per call
    site (a code object, by id, and instruction: ``f_lasti`` is read in O(1),
    ``f_lineno`` walks the line table), made once. A torch function written in Python
    (``F.softmax``) reaches the mode through ``handle_torch_function``: its caller is
    two frames further out.

    A function is kept only where the caller's globals are a module's namespace, and
    with a small namespace that stands for the module (``_warn.warning_namespace``: its
    name, loader and spec, and the module's own registry), not the module's: a script
    that ``runpy`` or a notebook's ``%run`` ran is in ``sys.modules`` only while it runs,
    and its namespace, and its tensors, would otherwise stay alive with the function.
    The globals of ``exec``'d code (a doctest's) are no module's: such a site keeps its
    code object, and each call makes its function with the globals the frame has
    (~0.1 µs). A site is one code object and instruction: one code object run in the
    namespaces of two modules (a template ``exec``'d into each) files its warnings in
    the module that ran it first.
    """
    key = (id(frame.f_code), frame.f_lasti)
    made = _site_made.get(key)
    if made is None:
        if len(_call_sites) + len(_site_made) > 65536:  # generated code (torch.fx) makes ever new sites
            _call_sites.clear()
            _site_made.clear()
            _site_code.clear()
        code = frame.f_code
        line = max(1, frame.f_lineno or code.co_firstlineno)
        made = _CALL_CODE.replace(co_filename=code.co_filename, co_firstlineno=line)
        _sites_of(code).append(key)
    call, kept = function_at(made, frame.f_globals, _CALL_CODE.co_name)
    if kept:
        _call_sites[key] = call
    else:
        _site_made[key] = made
    return call


def _call_directly(func, args, kwargs):
    """A call with no Python caller to stand for (a TorchScript fork's interop thread)."""
    return func(*args, **kwargs)


def _call_code() -> types.CodeType:
    # one line, so that a call at line 1 is filed at line 1 too
    source = "def _graphprune_call(func, args, kwargs): return func(*args, **kwargs)\n"
    module = compile(source, "<graphprune>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


_CALL_CODE = _call_code()
_HANDLE_TORCH_FUNCTION = torch.overrides.handle_torch_function.__code__
_call_sites: dict = {}  # (id of code, instruction) of a caller in a module -> its _graphprune_call
_site_made: dict = {}  # the same, of a caller whose globals are no module's -> the call's code
_site_code: dict = {}  # id of a code object of those keys -> (a weak reference to it, its keys)


def _sites_of(code) -> list:
    """The keys filed for ``code``'s call sites, to append to. The code is held weakly:
    a code object that dies (made per step by ``eval``, ``exec`` or ``compile``) takes
    its sites with it, before its ``id`` can be another's (NOTE [ Code objects as keys ]
    in ``_outputs.py``)."""
    entry = _site_code.get(id(code))
    if entry is None:
        entry = _site_code[id(code)] = (weakref.ref(code, functools.partial(_forget_code, id(code))), [])
    return entry[1]


def _forget_code(code_id: int, _ref) -> None:
    """A code object with call sites died: drop them."""
    entry = _site_code.pop(code_id, None)
    for key in entry[1] if entry is not None else ():
        _call_sites.pop(key, None)
        _site_made.pop(key, None)


def _is_view(t: torch.Tensor) -> bool:
    with _NoSubclassDispatch():
        return t._is_view()


def _note_safely(out, args, frame=None, kwargs=_NO_KWARGS) -> None:
    """Note a call's tensors without changing what the program sees: a tensor
    subclass's own ``__torch_function__`` is not called for graphprune's reads, and
    anomaly mode's tracebacks do not show graphprune's frame. ``frame``: the torch
    call's caller, where the recorder has it."""
    try:
        if type(out) is _Tensor:
            _note_call(out, args, frame, kwargs)
        else:
            with _NoSubclassDispatch():
                _note_call(out, args, frame, kwargs)
    except RuntimeError:  # a view made under no_grad, modified in place: its
        return  # grad_fn raises, and plain PyTorch would never have read it
    if _anomaly_enabled():
        _drop_own_frames(out)


def _drop_own_frames(out) -> None:
    for t in out if isinstance(out, (tuple, list)) else (out,):
        fn = t.grad_fn if isinstance(t, _Tensor) else None
        if fn is not None:
            children(fn)  # a wrapper made in the forward: NOTE [ Deep graphs and Python wrappers ]
            stack = fn.metadata.get("traceback_")
            if stack:
                fn.metadata["traceback_"] = _as_plain(stack)


def _as_plain(stack: list[str]) -> list[str]:
    """A forward traceback anomaly mode recorded, as a plain run records it: without the
    recorder's frames and its call-site function's, and for a torch function written in
    Python (``F.softmax``), which reached the mode through ``handle_torch_function`` and
    runs again inside it, without that frame and its caller's first run."""
    kept: list[str] = []
    for frame in stack:
        if _OWN_FILE in frame or _CALL_NAME in frame:
            continue
        if _OVERRIDES_FILE in frame and _HANDLER_NAME in frame:
            if kept:
                kept.pop()
            continue
        kept.append(frame)
    return kept


def _note_call(out, args, frame, kwargs) -> None:
    if isinstance(out, _Tensor):
        if not out.is_leaf:
            _note_one(out, frame)
    elif isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, _Tensor) and not t.is_leaf:
                _note_one(t, frame)
    for a in args:
        if isinstance(a, _Tensor):
            if not getweakrefcount(a) and a.requires_grad and not a.is_leaf:
                _note_unseen(a)
        elif isinstance(a, (tuple, list)):
            _note_unseen_in(a)
    if kwargs:
        _note_unseen_in(_tensors_in(kwargs))


def _tensors_in(kwargs) -> list:
    """The tensors a call takes by keyword, alone or in a list or tuple."""
    out = []
    for value in kwargs.values():
        if isinstance(value, _Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out += value
    return out


def _note_unseen_in(tensors) -> None:
    for t in tensors:
        if type(t) is _Tensor:
            if not getweakrefcount(t) and t.requires_grad and not t.is_leaf:
                _note_unseen(t)
        elif isinstance(t, _Tensor):  # a subclass's __torch_function__ is not called for the reads
            with _NoSubclassDispatch():
                if not getweakrefcount(t) and t.requires_grad and not t.is_leaf:
                    _note_unseen(t)


def _note_unseen(t: torch.Tensor) -> None:
    """``t`` has a ``grad_fn`` that no torch call under a tape made: made under a tape
    (a custom ``Function``'s output), it protects its graph; made before, it does not."""
    tapes = _open_tapes()
    fn = t.grad_fn
    children(fn)  # a wrapper made in the forward: NOTE [ Deep graphs and Python wrappers ]
    _outputs.note((t,), ours=bool(tapes) and fn._sequence_nr() >= tapes[0].first_seq)


def _call_setitem(call, func, args, kwargs, frame):
    """``target[key] = value``, through ``call`` (the caller's call site): stamp the
    index it wrote on the ``CopySlices`` it made (NOTE [ Gradient routing ] in
    ``_routing.py``)."""
    target = args[0]
    before = target.grad_fn if target._base is None else _NO_STAMP
    out = call(func, args, kwargs)
    if before is not _NO_STAMP and len(args) > 1:
        try:
            stamp_setitem(target, args[1], before)
        except RuntimeError:  # a view made under no_grad, modified in place
            pass
    _adopt(target, frame)
    _note_safely(out, args, frame, kwargs)
    if _anomaly_enabled():  # the CopySlices it made is the target's node now
        _drop_own_frames(target)
    return out


_SETITEM = torch.Tensor.__setitem__
_NO_STAMP = object()


def _call_registering_hook(call, func, args, kwargs):
    """``t.register_hook(hook)``, through ``call``: mark ``t``'s node, whose hooks run
    wherever its gradient arrives, whether ``t`` lives then or not (NOTE [ Hooks at the
    cut ] in ``_each.py``)."""
    _before_a_hook(call)
    out = call(func, args, kwargs)
    t = args[0] if args else None
    if isinstance(t, _Tensor):
        try:
            with _NoSubclassDispatch():
                fn = t.grad_fn
        except RuntimeError:  # a view made under no_grad, modified in place
            fn = None
        if fn is not None:
            children(fn)  # a wrapper made in the forward: NOTE [ Deep graphs and Python wrappers ]
            mark_hooked(fn)
    _note_safely(out, args)
    return out


@contextlib.contextmanager
def before_hooks(run):
    """While open, ``run()`` in this thread before a tensor hook is registered under
    ``track()`` (``register_hook``, ``retain_grad``, ``register_post_accumulate_grad_hook``):
    NOTE [ Hooks a later head registers ] in ``_each.py``. ``run=None``: nothing runs
    (graphprune registering its own hooks)."""
    old = getattr(_local, "before_hook", None)
    _local.before_hook = run
    try:
        yield
    finally:
        _local.before_hook = old


def _before_a_hook(call) -> None:
    """What :func:`before_hooks` asks to run, through ``call`` (the caller's call site):
    a backward pass, in the torch-function state the caller has (NOTE [ Modes below the
    recorder ])."""
    run = getattr(_local, "before_hook", None)
    if run is not None:
        call(run, (), _NO_KWARGS)


def _call_inplace(call, func, args, kwargs, frame):
    """An in-place op on a tensor that is no view, through ``call`` (the caller's call
    site)."""
    out = call(func, args, kwargs)
    _adopt(args[0], frame)
    _note_safely(out, args, frame, kwargs)
    return out


def _adopt(t: torch.Tensor, frame) -> None:
    """A tracked in-place op modified ``t`` (and, where ``t`` is a view, the tensor it
    is a view of): a tensor made before the tape, noted as protecting nothing
    (``_outputs.note``), has a graph built under the tape now and protects it
    (``reg += x.sum()`` on a regulariser made before ``track()``). Most programs note
    no such tensor: then an in-place op asks nothing."""
    if not _made_before[0]:
        return
    with _NoSubclassDispatch():
        base = t._base
    _adopt_one(t, frame)
    if base is not None:
        _adopt_one(base, frame)


def _adopt_one(t: torch.Tensor, frame) -> None:
    if not getweakrefcount(t):
        return
    ref = _outputs.output_of(t)
    if ref is None or ref.ours:
        return
    tapes = _open_tapes()
    try:
        with _NoSubclassDispatch():
            fn = t.grad_fn
    except RuntimeError:  # a view made under no_grad, modified in place
        return
    if fn is not None and tapes and fn._sequence_nr() >= tapes[0].first_seq:
        _outputs.adopt(ref, frame)


def _call_inplace_on_view(call, func, args, kwargs, frame):
    """An in-place op on a view, through ``call`` (the caller's call site): autograd
    hides the node that saves tensors inside a ``CopySlices``; collect what it packs
    and file it for that node (NOTE [ Lazy records ] in ``_graph.py``)."""
    own = _own_pack_hook()
    if own is None:
        out = call(func, args, kwargs)
    else:
        packed: list[SavedHandle] = []

        def collect(t):
            h = own(t)
            packed.append(h)
            return h

        with torch.autograd.graph.saved_tensors_hooks(collect, SavedHandle.unpack):
            out = call(func, args, kwargs)
        if packed and out is args[0]:
            with _NoSubclassDispatch():
                node = out._base.grad_fn
            if node is not None and node.name().endswith("CopySlices"):
                attach_hidden(node, packed)
    _adopt(args[0], frame)
    _note_safely(out, args, frame, kwargs)
    if _anomaly_enabled() and isinstance(out, _Tensor):  # and the CopySlices it made, the base's node
        with _NoSubclassDispatch():
            base = out._base
        if base is not None:
            _drop_own_frames(base)
    return out


class Tape:
    """The record of forward passes run inside one ``with graphprune.track():``.

    Use :func:`track` to make one (``timeline`` and ``modules`` as it takes them).
    Holding a tape keeps no tensor and no node alive.
    """

    def __init__(self, timeline=None, modules=False) -> None:
        if timeline is not None and not isinstance(timeline, Timeline):
            raise TypeError(f"graphprune.track: timeline must be a graphprune.Timeline, "
                            f"got {type(timeline).__name__}")
        self.id = next(_tape_ids)
        self.timeline = timeline
        self.modules = None
        if modules is not False and modules is not None:  # NOTE [ Module names by sequence number ]
            from ._modules import ModuleRecorder

            self.modules = ModuleRecorder(modules)
        self.first_seq = 0  # sequence numbers of the nodes built while it was open
        self.end_seq: int | None = None
        self._inner: list[range] = []  # windows of the tapes opened inside this one
        self._thread = None
        self._hooks = None
        self._pack = None
        self._mode = None

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Tape:
        if self._hooks is not None:
            raise RuntimeError("graphprune.track: this tape is already active; use a new track()")
        if self.end_seq is not None:
            raise RuntimeError("graphprune.track: this tape was closed; use a new track()")
        tapes = _open_tapes()
        self._thread = threading.get_ident()
        self.first_seq = torch._C._autograd._get_sequence_nr()
        if self.timeline is None:
            pack = pack_hook(self.id)
        else:  # NOTE [ What the timeline counts ] in _timeline.py
            pack = self.timeline.pack_hook(self.id)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, SavedHandle.unpack)
        hooks.__enter__()
        self._pack = pack
        if self.modules is not None:
            self.modules.start()
        if not tapes:  # one recorder per thread: the outermost tape's
            try:
                self._mode = _OutputRecorder()
                self._mode.__enter__()
            except BaseException:
                hooks.__exit__(None, None, None)
                self._mode = None
                raise
        self._hooks = hooks
        tapes.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is None:
            state = "closed already" if self.end_seq is not None else "never entered"
            raise RuntimeError(f"graphprune.track: this tape is not open ({state}); __exit__ closes "
                               "what __enter__ opened")
        if threading.get_ident() != self._thread:
            raise RuntimeError("graphprune.track: a tape must be closed in the thread that opened it")
        tapes = _open_tapes()
        index = tapes.index(self)
        last = index == len(tapes) - 1
        try:
            tapes.remove(self)
            if self._mode is not None:
                if last or not tapes:
                    _pop_mode_of(self._mode)
                else:  # NOTE [ A tape closed out of order ]: the recorder stays, the outermost's now
                    tapes[0]._mode, self._mode = self._mode, None
        finally:
            if self.modules is not None:
                self.modules.stop()
            _pop_hooks_of(self._pack)
            self._hooks = self._mode = self._pack = None
            self.end_seq = torch._C._autograd._get_sequence_nr()
            if index:  # the tape it was opened in
                tapes[index - 1]._inner.append(range(self.first_seq, self.end_seq))
            elif not tapes:
                _outputs.settle()

    # NOTE [ A tape closed out of order ]
    # A generator that yields inside ``track()`` closes its tape when it is closed or
    # collected, which may be while a tape opened after it is still open (``gen.close()``
    # in the user's block), or while saved-tensor hooks or a ``TorchFunctionMode`` of the
    # user's entered after it are (a generator of the user's, started in the block, that
    # holds them past it). PyTorch's hooks and modes are stacks: popping the top would
    # take those away and leave the closed tape's on. So a tape takes out its own hooks
    # and mode from under the later ones, which stay on in their order; one that is not
    # the innermost tape hands the output recorder, which the outermost tape holds, to
    # the tape that is now.

    def owns(self, node, handles, kind: str) -> bool:
        """Whether this tape's forward built ``node``, which saved ``handles`` (of ``kind``)."""
        if handles:
            return handles[0].tape == self.id
        seq = node._sequence_nr()
        end = self.end_seq if self.end_seq is not None else torch._C._autograd._get_sequence_nr()
        if kind == "untracked" or not self.first_seq <= seq < end:
            return False
        return not any(seq in inner for inner in self._inner)

    # -- inspection ----------------------------------------------------------------------
    def graph(self) -> nx.DiGraph:
        """A snapshot of this tape's live ``grad_fn`` graph as a ``networkx.DiGraph``.

        Nodes are integer ids with attributes ``op`` (e.g. ``"MulBackward0"``),
        ``saved_bytes`` (unique storage still held), ``saved_tensors`` and ``state``:
        ``"trunk"`` (a live tensor created under ``track()`` still reaches it),
        ``"branch"`` (none does), ``"released"`` (graphprune freed its saved tensors)
        or ``"untracked"`` (built outside ``track()``, below the tape's nodes, or under
        other saved-tensor hooks: PyTorch or those hooks hold what it saved, which
        ``saved_bytes`` does not count). Edges follow ``next_functions``. The snapshot
        holds only ints and strings, never a node or a tensor.

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

        return snapshot(self)

    def __repr__(self) -> str:
        state = "active" if self._hooks is not None else "closed"
        return f"<graphprune.Tape {self.id} {state}>"


def _pop_mode_of(mode) -> None:
    """Take ``mode`` out of this thread's stack of torch-function modes, those pushed
    after it kept in their order (NOTE [ A tape closed out of order ])."""
    above = []
    while _len_modes() and (top := _pop_mode()) is not mode:
        above.append(top)
    for other in reversed(above):
        _push_mode(other)


_len_modes = torch._C._len_torch_function_stack
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack


def _untrack_a_forked_child() -> None:
    """NOTE [ A forked child ]
    A process forked inside ``track()`` (a ``DataLoader``'s workers, made when its
    iterator is, a ``multiprocessing`` pool with the fork start method) starts with
    the forking thread's torch-function modes and saved-tensor hooks: every op of
    its data pipeline would go through the recorder, which plain PyTorch's worker
    does not. So the child takes graphprune's out of both stacks (the user's stay, in
    their order); its tapes stay open, untracking, and close as they would (a tape's
    exit takes out only what it finds of its own)."""
    for tape in _open_tapes():
        if tape._mode is not None:
            _pop_mode_of(tape._mode)
        if tape._pack is not None:
            _pop_hooks_of(tape._pack)


os.register_at_fork(after_in_child=_untrack_a_forked_child)


def _pop_hooks_of(pack) -> None:
    """Take the saved-tensor hooks whose pack hook is ``pack`` out of this thread's stack
    of them, those pushed after it kept in their order (NOTE [ A tape closed out of
    order ]); nothing where they are not on it."""
    autograd = torch._C._autograd
    top, pop = autograd._top_saved_tensors_default_hooks, autograd._pop_saved_tensors_default_hooks
    above = []
    while (hooks := top(False)) is not None and hooks[0] is not pack:
        above.append(hooks)
        pop()
    if hooks is not None:
        pop()
    for hooks in reversed(above):
        autograd._push_saved_tensors_default_hooks(*hooks)


def track(*, timeline=None, modules=False) -> Tape:
    """Record the forward passes run in a ``with`` block, so that they can be pruned.

    Inside the block, graphprune's saved-tensor hooks hold every tensor that
    autograd saves, and an output recorder notes (weakly) every tensor created.
    Hooks are per thread and innermost-wins: a ``checkpoint`` or ``save_on_cpu``
    region inside the block keeps its own tensors, which graphprune leaves alone.

    Args:
        timeline: a :class:`~graphprune.Timeline` that records the bytes the saved
            tensors hold, pack by pack and free by free (a pack hook of its own, only
            then).
        modules: ``True``, or the root ``nn.Module`` (for qualified names such as
            ``trunk.0``), to record which module built each node, for
            :func:`~graphprune.render`: one small list per module call, nothing per op
            (global module hooks, only while this tape is open).

    Returns:
        A :class:`Tape`: a context manager, and ``tape.graph()`` afterwards.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(3, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     y1 = (x * x).sum()
        >>> y1.backward(retain_graph=True)
        >>> gp.prune_after(y1, keep=x).released_tensors
        2
        >>> (x.sqrt().sum()).backward()   # x's graph is still there
    """
    return Tape(timeline, modules)
