"""Later passes that reach a released node with an all-zero gradient.

NOTE [ Zero-gradient passes through released nodes ]
Losses stacked with ``torch.stack`` (or summed with weights that are zero for a
task) make ``losses[1].backward()`` run head 0's nodes too, with all-zero incoming
gradients (DESIGN.md fact 9). Plain PyTorch computes zeros there; a released node
has no tensors left. Backward functions are linear in the incoming gradient, so
zero in means zero out. A released node gets one pre-hook, which sees the incoming
gradients before the node runs (NOTE [ A guard registered when first needed ]): any
non-zero one raises :class:`ReleasedTensorError` there, before a kernel could run on
a placeholder, so never a wrong gradient and never a kernel's own error. All-zero
ones mark the node for this graph task: the unpack hook then hands it a placeholder
for each released tensor, and a post-hook (registered by the pre-hook the first
time, the engine calls it in the same pass, first of the node's post-hooks) replaces
its outputs with zeros, as the placeholder may give NaN (Div, Log): a user's
post-hook on the node sees zeros, as in plain PyTorch. Each hook is registered once
per node, under a lock, though two threads' passes run the node for the first time
together. The hooks are plain functions shared by every node: a closure that held
the node's wrapper would be a reference cycle through C++. The mark is keyed by (the
node's wrapper, graph task), so a pass that raised midway or another thread's pass
never sees a stale mark. Placeholders of floating tensors are zero-stride (no
memory); integer ones are contiguous zeros (indices: 0 is valid along
any dim that is not empty), or ones for LU pivots, which are 1-based.

NOTE [ A guard registered when first needed ]
``Node.register_prehook`` makes Python objects for every node it is called on (an
``OrderedDict`` of hooks, a ``RemovableHandle``): ~1-1.5 µs of a prune per released
node, and a dict that lives as long as the node, for a pre-hook that most released
nodes never run. So a prune gives each released node a tensor pre-hook instead,
registered in C++ from one dict shared by every node (``_register_hook_dict``, as
``Tensor.register_hook`` does), on the node's first output: the engine calls it every
time it runs the node, before the node's own pre-hooks, with that output's gradient
(``None`` where there is none). Its first call registers the node's pre-hook, which
the engine then calls in the same run, after every tensor hook (a user's hook that
changes a gradient included), with all the incoming gradients.

NOTE [ Masks stay ]
A boolean mask decides the shape of what it indexes (``logits[mask]``, ``z[mask] =
v``, a masked-token loss): no placeholder gives the kernel the count of its ``True``
entries, so a zero-gradient pass through a node that saved one would fail in the
kernel (a shape mismatch). So a prune releases no saved boolean tensor: a node keeps
its masks (one byte per entry) and releases the rest, or, where it saved only masks,
is not released at all, and runs in later passes as in plain PyTorch.

NOTE [ Zeros known without looking ]
Reading a gradient's values (``g.any()``) on a GPU waits for the device: one
host-device synchronisation per released node a pass runs. So a pass of
graphprune's (``gp.backward``, ``gp.grad``, the per-loss helpers) marks before it
runs the released nodes that gradient routing (NOTE [ Gradient routing ]) says only
zeros reach (head 0 in ``losses[1]``'s pass): their pre-hook waits for nothing
(NOTE [ Zeros read where reading is free ]). Where
a released node may get a non-zero gradient, the check stays: on the CPU at once; on
other devices deferred, each gradient's ``any()`` kept on its device and read once,
all together, when the pass ends (``queue_callback``), which then raises
:class:`ReleasedTensorError` if one was not zero. A deferred check cannot stop the
pass midway: the ``.grad`` it wrote is then not to be used (the error says so).

NOTE [ Zeros read where reading is free ]
Routing knows zeros only where nothing between the pass's roots and the node makes
them non-zero, and some of what does is out of graphprune's sight: a hook on a tensor
made after the ``track()`` block, a ``Node`` hook (``grad_fn.register_hook``, the old
``Module.register_backward_hook``) above the node (NOTE [ Zeros that may not stay
zeros ] in ``_plan.py``). On the CPU reading a value waits for nothing, so a released
node's pre-hook reads its gradients there even where routing says they are zeros, and
raises where one is not: a wrong routing guess is an error, never a wrong gradient.
On other devices the node's gradients are trusted there, as the read would wait for
the device at every released node.

NOTE [ Zeros whose derivative is not zero ]
A pass with ``create_graph=True`` builds a graph of its gradients. A gradient that is
zero by its value but depends on tensors that require grad (``c * losses`` with the
weight ``c[0]`` at 0, GradNorm's learnt weights) has a derivative that need not be
zero (``d(c[0] * g)/dc[0] = g``), and the node's backward would carry it on using its
saved tensors: zeros in its place would make the next pass's gradient (``c.grad``)
wrong. So such a gradient counts as non-zero and raises, unless routing knows it is
zero by construction (an entry a ``stack`` gives no gradient to: zero whatever the
tensors it depends on, its derivative too).

NOTE [ Backwards that run a pass ]
A node's backward computes its outputs from its saved tensors and its gradients, so
zeros in place of the outputs it computed from placeholders are what plain PyTorch
gives. A reentrant ``checkpoint``'s does more: it recomputes its region from its saved
inputs and runs a pass of its own, which writes the region's parameters' ``.grad``
(NaN from ``log`` of a zero placeholder) and its BatchNorm's running statistics. So a
zero-gradient pass that reaches a released reentrant checkpoint raises, before the
node runs. A custom ``Function`` of yours whose backward does more than compute its
gradients (writes state, runs a pass) is run on the placeholders: graphprune cannot
tell.

NOTE [ Pre-hooks after the guard ]
The engine calls a node's pre-hooks in the order they were registered. The guard's is
registered the first time a pass runs the node, so a ``Node.register_prehook`` call
made after that runs after the guard and may make the gradient it checked non-zero
(gradient noise added at a node). The zeroing post-hook sees the gradients every
pre-hook left (``grad_outputs``): where the node has pre-hooks besides the guard (its
dict of them is left in the node's metadata when the guard is registered), it checks
them again there, after the kernel has run on the placeholders, before anything
reads its outputs.
"""

from __future__ import annotations

import threading

import torch

from ._marks import GUARDED, RELEASED, is_function
from .errors import ReleasedTensorError, released_message

__all__ = ["guard_released", "in_zero_pass", "placeholder", "known_zero", "forget", "IMMEDIATE"]

_ZEROING = "graphprune.zeroing"  # node.metadata key: the post-hook is registered
_zero_pass: set[tuple[int, int]] = set()  # (id of the node's wrapper, graph task id)
_lock = threading.Lock()
_registering = threading.Lock()  # the hooks a node's first zero pass registers


IMMEDIATE = {"cpu"}  # device types whose values are read at once; others: deferred
_deferred: dict[int, list] = {}  # graph task id -> [(node name, reason, device flag)]


def _zero_or_raise(grad_outputs) -> None:
    """The pre-hook of every released node."""
    node = torch._C._current_autograd_node()
    task = torch._C._current_graph_task_id()
    key = (id(node), task)
    with _lock:
        known = key in _zero_pass  # NOTE [ Zeros known without looking ]
    grads = [g for g in grad_outputs if g is not None]
    immediate = not grads or grads[0].device.type in IMMEDIATE
    if not known:
        # NOTE [ Zeros whose derivative is not zero ]; one read non-zero on the CPU is named so, below
        if any(g.requires_grad for g in grads) and not (immediate and _any_nonzero(node, grads)):
            raise ReleasedTensorError(released_message(node, _released_by(node)) + _DIFFERENTIABLE)
        _raise_or_defer(node, task, grads)
        with _lock:
            _zero_pass.add(key)
    elif immediate and _any_nonzero(node, grads, routed=True):  # NOTE [ Zeros read where reading is free ]
        with _lock:
            _zero_pass.discard(key)
        raise ReleasedTensorError(released_message(node, _released_by(node)))
    if is_function(node, *_REENTRANT):  # NOTE [ Backwards that run a pass ]
        with _lock:
            _zero_pass.discard(key)
        raise ReleasedTensorError(released_message(node, _released_by(node)) + _REENTRANT_BACKWARD)
    md = node.metadata
    if _ZEROING not in md:
        with _registering:  # two threads' first zero passes through one node: one hook
            if _ZEROING not in md:
                _register_zeroing(node)
                md[_ZEROING] = True


def _released_by(node):
    """What released ``node``'s tensors: its ``RELEASED`` mark, or where its pass is
    still running, its guard's."""
    md = node.metadata
    return md.get(RELEASED) or md.get(GUARDED)


def _register_zeroing(node) -> None:
    """Register the post-hook that zeroes ``node``'s outputs, first of its post-hooks."""
    handle = node.register_hook(_zero_outputs)
    hooks = handle.hooks_dict_ref()  # the node's one dict of Python post-hooks
    if hooks is not None and len(hooks) > 1:
        # first, so that a user's post-hook registered before sees the zeros; the
        # engine calls them in the order of the plain dict (move_to_end would not do)
        others = [(k, v) for k, v in hooks.items() if k != handle.id]
        hooks.clear()
        hooks[handle.id] = _zero_outputs
        hooks.update(others)


def _zero_outputs(grad_inputs, grad_outputs):
    node = torch._C._current_autograd_node()
    task = torch._C._current_graph_task_id()
    key = (id(node), task)
    with _lock:
        if key not in _zero_pass:
            return None
        _zero_pass.discard(key)
    hooks = node.metadata.get(_CHECKED)
    if isinstance(hooks, dict) and len(hooks) > 1:  # NOTE [ Pre-hooks after the guard ]
        _raise_or_defer(node, task, [g for g in grad_outputs if g is not None])
    return tuple(None if g is None else torch.zeros_like(g) for g in grad_inputs)


def _raise_or_defer(node, task: int, grads) -> None:
    """Raise where one of ``grads`` (into ``node``, released) is not zero: on the CPU at
    once, on other devices when the pass ends (NOTE [ Zeros known without looking ])."""
    if grads and grads[0].device.type not in IMMEDIATE:
        _defer(node, task, grads)
    elif _any_nonzero(node, grads):
        raise ReleasedTensorError(released_message(node, _released_by(node)))


def _any_nonzero(node, grads, routed: bool = False) -> bool:
    """Whether one of ``grads`` is not zero. A batched pass (vmap, ``is_grads_batched``)
    has no value to read: it raises, but where routing said they are zeros (``routed``),
    whose word stands there."""
    try:
        return any(bool(g.any()) for g in grads)
    except RuntimeError as e:  # a batched pass (vmap, is_grads_batched): no value can be read
        if routed:
            return False
        raise ReleasedTensorError(
            released_message(node, _released_by(node))
            + " The pass is batched (torch.vmap, is_grads_batched=True), so graphprune cannot check "
            "that only zeros reach this node; a pass through gp.grad knows it from gradient routing "
            "where it can."
        ) from e


def _defer(node, task: int, grads) -> None:
    flag = torch.stack([g.any() for g in grads]).any()  # on the device: no wait
    with _lock:
        first = task not in _deferred
        _deferred.setdefault(task, []).append((node.name(), _released_by(node), flag))
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _check_deferred(task))


def _check_deferred(task: int) -> None:
    """At the end of a pass: one read of every deferred flag."""
    with _lock:
        checks = _deferred.pop(task, [])
    if not checks:
        return
    nonzero = torch.stack([flag for _, _, flag in checks]).cpu()
    for (name, reason, _), bad in zip(checks, nonzero.tolist()):
        if bad:
            raise ReleasedTensorError(
                f"graphprune: a backward pass sent a non-zero gradient into {name}, whose saved "
                f"tensors were released by {reason}. The check ran at the end of the pass (reading "
                "gradients on the device sooner would wait for it at every released node): the "
                ".grad this pass accumulated is not valid. Pass keep= to that call for what later "
                "passes start from."
            )


def known_zero(nodes, task: int) -> list:
    """Mark ``nodes`` (released, wrappers) as reached by zeros only in graph task
    ``task``: their pre-hook reads nothing off the CPU. Returns the keys, for :func:`forget`."""
    keys = [(id(n), task) for n in nodes]
    with _lock:
        _zero_pass.update(keys)
    return keys


def forget(keys) -> None:
    """Drop the marks of nodes a pass did not run."""
    with _lock:
        _zero_pass.difference_update(keys)


def guard_released(node, reason, md=None) -> None:
    """Let zero-gradient passes through ``node`` (a wrapper), whose tensors ``reason``
    released; once per node. ``md`` is its ``metadata``, if the caller has it."""
    if md is None:
        md = node.metadata
    if GUARDED not in md:
        md[GUARDED] = reason  # named by a non-zero gradient's error until the RELEASED mark is there
        node._register_hook_dict(_PROBE)  # NOTE [ A guard registered when first needed ]


def _first_run(grad) -> None:
    """The tensor pre-hook of every released node's first output: register the node's
    pre-hook the first time the node runs (NOTE [ A guard registered when first needed ])."""
    node = torch._C._current_autograd_node()
    md = node.metadata
    if _CHECKED not in md:
        with _registering:
            if _CHECKED not in md:
                hooks = node.register_prehook(_zero_or_raise).hooks_dict_ref()
                md[_CHECKED] = True if hooks is None else hooks  # NOTE [ Pre-hooks after the guard ]


_CHECKED = "graphprune.checked"  # node.metadata key: its pre-hook is registered; the node's pre-hooks
_REENTRANT_BACKWARD = (
    " The pass sends it a zero gradient, but it is a reentrant checkpoint's node, whose backward recomputes "
    "its region from the released inputs and runs a pass of its own into the region's .grad and buffers: "
    "graphprune does not run it on placeholders. Pass keep= to that call, or use "
    "checkpoint(..., use_reentrant=False), whose region graphprune does not release."
)
_REENTRANT = ("CheckpointFunction", "torch.utils.checkpoint")  # a reentrant checkpoint's Function
_COMPILED = "CompiledFunctionBackward"  # a torch.compile'd region's node
_DIFFERENTIABLE = (
    " The pass builds a graph of its gradients (create_graph=True), and the gradient that reaches this "
    "node depends on tensors that require grad: zero as it is (a loss weight that is 0 now), its "
    "derivative need not be, and computing that needs the tensors this node saved."
)


def _probe() -> torch.Tensor:
    """A tensor whose hooks are the dict every released node shares; a normal CPU
    tensor whatever mode or default device ``import graphprune`` ran under."""
    with torch.inference_mode(False):
        probe = torch.empty(0, device="cpu")
    probe._backward_hooks = {0: _first_run}
    return probe


_PROBE = _probe()


def in_zero_pass(node) -> bool:
    """Whether ``node`` (running now) came in with all-zero gradients."""
    return (id(node), torch._C._current_graph_task_id()) in _zero_pass


def placeholder(shape, dtype: torch.dtype, device, node) -> torch.Tensor:
    """What released ``node`` (running now) gets in a zero-gradient pass instead of
    its tensor. Integer tensors are indices (valid as 0 along any dim that is not
    empty; 1 is out of range on a dim of size 1), except the 1-based LU pivots of a
    node that saves ``pivots``. A compiled region's backward checks the strides of what
    it saved (inductor's ``assert_size_stride``): its placeholders are contiguous zeros,
    as what it saved most often is."""
    if (dtype.is_floating_point or dtype.is_complex) and type(node).__name__ != _COMPILED:
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    if hasattr(type(node), "_raw_saved_pivots"):
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
