"""Autograd behaviours run twice, plain and under ``graphprune.track()``: same results.

Each test builds its own inputs inside ``fn`` and hands it to :func:`both`, which runs
it plain and then under ``track()`` from the same line, with the same seed, and asserts
the two :class:`Outcome` records equal: returned values (tensors compared with
``assert_close``), the exception (type and message) and the warnings (category,
message, file and line, so a warning must point at the user's line, not graphprune's).
Tests at the end pin differences that are inherent to saved-tensor hooks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import runpy
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import graphprune as gp

HERE = os.path.basename(__file__)


class Outcome(NamedTuple):
    value: Any  # what fn returned, tensors detached and cloned
    error: tuple[type, str] | None
    warnings: list[tuple[type, str, str, int]]  # category, message, file basename, line


def _snapshot(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_snapshot(x) for x in v)
    if isinstance(v, dict):
        return {k: _snapshot(x) for k, x in v.items()}
    return v


def outcome(fn: Callable[[], Any], tracked: bool, outer=contextlib.nullcontext) -> Outcome:
    """Run ``fn()`` (inside ``outer()``, then ``track()`` if ``tracked``) and record what happened.

    The warnings filter is Python's "default": one warning per message and location,
    so a warning attributed to a graphprune line instead of two user lines shows up.
    """
    torch.manual_seed(0)
    ctx = gp.track() if tracked else contextlib.nullcontext()
    value, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            with outer(), ctx:
                value = fn()  # one line for both runs: tracebacks and warnings agree
        except Exception as exc:  # the record compares it
            error = (type(exc), str(exc))
    seen = [(w.category, str(w.message), os.path.basename(w.filename), w.lineno) for w in caught]
    return Outcome(_snapshot(value), error, seen)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert_close(a, b, equal_nan=True)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def runs(fn: Callable[[], Any], outer=contextlib.nullcontext) -> tuple[Outcome, Outcome]:
    """The plain and the tracked :class:`Outcome` of ``fn``.

    A first, unrecorded plain run takes the one-time effects (lazy imports that warn,
    ``TORCH_WARN_ONCE``), so the recorded runs do not depend on their order.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome(fn, False, outer)
    return outcome(fn, False, outer), outcome(fn, True, outer)


def both(fn: Callable[[], Any], outer=contextlib.nullcontext) -> Outcome:
    """Assert that ``fn`` behaves the same plain and under ``track()``; return the plain record."""
    plain, tracked = runs(fn, outer)
    assert tracked.error == plain.error
    assert_same(plain.value, tracked.value)
    assert tracked.warnings == plain.warnings
    return plain


INPLACE = "modified by an inplace operation"


def both_inplace_error(fn: Callable[[], Any], outer=contextlib.nullcontext) -> Outcome:
    """Like :func:`both` for a backward that reads a tensor modified in place after it was saved.

    PyTorch skips its version-counter check while saved-tensor hooks are set;
    graphprune restores it with its own ``InplaceModifiedError``, a ``RuntimeError``
    subclass whose message has the same key phrase and a different tail (the node's
    name and graphprune's hint). So the error is compared by type (a subclass) and
    phrase, the rest of the record exactly.
    """
    plain, tracked = runs(fn, outer)
    assert plain.error[0] is RuntimeError and INPLACE in plain.error[1], plain.error
    assert tracked.error is not None, "no error under track(): the in-place check was skipped"
    assert issubclass(tracked.error[0], RuntimeError) and INPLACE in tracked.error[1], tracked.error
    assert_same(plain.value, tracked.value)
    assert tracked.warnings == plain.warnings
    return plain


def first_line(fn) -> int:
    return fn.__code__.co_firstlineno


# -- views and in-place ops under no_grad and inference_mode ---------------------------------


def test_no_grad_view_inplace_repr():
    def fn():
        a = torch.ones(1, requires_grad=True)
        with torch.no_grad():
            b = a[:]
            b *= 2
        return repr(b)

    assert both(fn).value == "tensor([2.], grad_fn=<Invalid>)"


def test_inference_mode_view_of_view_add_():
    def fn():
        a = torch.ones(2, requires_grad=True)
        with torch.inference_mode():
            out = a.view(-1)
            out.view(-1).add_(2)
        return repr(out), a.detach().clone()

    assert both(fn).value[0] == "tensor([3., 3.], grad_fn=<Invalid>)"


def test_no_grad_unbind_view_as_strided_():
    def fn():
        base = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], requires_grad=True)
        with torch.no_grad():
            v = base.unbind()[0]
            v.as_strided_((3,), (2,))
        return repr(v)

    assert both(fn).value == "tensor([0., 2., 4.], grad_fn=<Invalid>)"


def test_unbind_view_as_strided_under_no_grad():
    def fn():
        base = torch.arange(6.0, requires_grad=True).view(2, 3).clone()
        v = base.unbind()[0]  # a multi-output view made in grad mode
        with torch.no_grad():
            v.as_strided_((3,), (2,))
        return repr(v)

    assert both(fn).value == "tensor([0., 2., 4.], grad_fn=<Invalid>)"


def test_no_grad_slice_update_of_a_leaf():
    def fn():
        w = torch.randn(4, requires_grad=True)
        with torch.no_grad():  # the pattern of hand-written updates and initialisers
            w[:2] *= 0
            w[2:].copy_(torch.ones(2))
        (w * w).sum().backward()
        return w, w.grad

    both(fn)


@pytest.mark.parametrize("key", ["array_row", "array_mask", "numpy_bool", "numpy_int"])
def test_item_assignment_with_numpy_keys(key):
    # a numpy array has __index__, which refuses: routing's parse of the key raised
    # TypeError after the assignment had run (reported in a review of track())
    keys = {
        "array_row": (np.array([0, 2]), 0),
        "array_mask": (np.array([True, False, True]), 1),
        "numpy_bool": np.True_,
        "numpy_int": (np.int64(1), slice(None)),
    }

    def fn():
        w = torch.randn(3, 2, requires_grad=True)
        v = torch.tensor([5.0, 6.0], requires_grad=True)
        x = w.clone()
        x[keys[key]] = v[:1] if key == "numpy_bool" else v
        (x * x).sum().backward()
        return x, w.grad, v.grad

    both(fn)


@pytest.mark.parametrize("init", ["orthogonal_", "kaiming_uniform_", "eye_", "sparse_"])
def test_nn_init_inside_track(init):
    def fn():
        w = torch.nn.Parameter(torch.empty(4, 3))
        getattr(torch.nn.init, init)(w, *([0.5] if init == "sparse_" else []))
        (w.sin() * w).sum().backward()
        return w, w.grad

    both(fn)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_view_inplace_inside_mode_then_backward(mode):
    def fn():
        a = torch.randn(4, requires_grad=True)
        base = a * 1  # a non-leaf base
        with mode():
            c = torch.randn(4)
            v = c[1:3]
            v.mul_(3)
        y = (base * base).sum()
        y.backward()
        return c, a.grad

    both(fn)


def test_view_made_in_no_grad_modified_in_grad_mode_raises():
    def fn():
        base = torch.randn(3, requires_grad=True).clone()
        with torch.no_grad():
            v = base[:2]
        v.mul_(2)

    assert both(fn).error[0] is RuntimeError


# -- nested tensors ----------------------------------------------------------------------------


def test_nested_tensor_inplace_after_save_raises():
    def fn():
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
        x = nt.clone()
        r = x.sum(-1, keepdim=True)
        x.add_(x)
        r.backward(torch.nested.nested_tensor([torch.ones(2, 1), torch.ones(4, 1)]))

    both_inplace_error(fn)  # the type and the key phrase: see both_inplace_error


def test_increment_version_after_save_raises():
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        torch.autograd.graph.increment_version(y)
        y.sum().backward()

    both_inplace_error(fn)


def test_nested_tensor_backward():
    def fn():
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
        r = (nt * nt).sin().sum(-1, keepdim=True)
        r.backward(torch.nested.nested_tensor([torch.ones(2, 1), torch.ones(4, 1)]))
        return list(nt.grad.unbind())

    both(fn)


# -- sparse and complex tensors ----------------------------------------------------------------


def _sparse_mm():
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    s = torch.sparse_coo_tensor(i, torch.randn(3), (3, 3), check_invariants=True).requires_grad_()
    d = torch.randn(3, 2, requires_grad=True)
    torch.sparse.mm(s, d).sin().sum().backward()
    return s.grad.coalesce(), d.grad


def _sparse_to_dense():
    s = torch.randn(3, 4).relu().to_sparse().requires_grad_()
    y = (s * 2).to_dense()
    (y * y).sum().backward()
    return s.grad.coalesce()


def _sparse_sum():
    s = torch.randn(4, 3).relu().to_sparse().requires_grad_()
    torch.sparse.sum(s * s).backward()
    return s.grad.coalesce()


def _complex_abs_angle():
    z = torch.randn(4, dtype=torch.cfloat, requires_grad=True)
    (z.abs() * z.angle()).sum().backward()
    return z.grad


def _complex_mul_conj():
    z = torch.randn(3, dtype=torch.cdouble, requires_grad=True)
    w = torch.randn(3, dtype=torch.cdouble, requires_grad=True)
    y = (z * w.conj()).exp()
    (y.real.sum() + y.imag.pow(2).sum()).backward()
    return y, z.grad, w.grad


def _complex_view_as_real():
    z = torch.randn(2, 3, dtype=torch.cfloat, requires_grad=True)
    r = torch.view_as_real(z * z)
    r.pow(3).sum().backward()
    return z.grad


@pytest.mark.parametrize(
    "fn",
    [_sparse_mm, _sparse_to_dense, _sparse_sum, _complex_abs_angle, _complex_mul_conj, _complex_view_as_real],
)
def test_sparse_and_complex(fn):
    both(fn)


# -- forward-mode AD -------------------------------------------------------------------------


def test_forward_ad_jvp():
    def fn():
        x, t = torch.randn(4), torch.randn(4)
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, t)
            y = (dual.sin() * dual.exp()).cumsum(0)
            primal, tangent = fwAD.unpack_dual(y)
        return primal, tangent

    both(fn)


def test_forward_ad_with_backward():
    def fn():
        x = torch.randn(3, requires_grad=True)
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, torch.ones(3))
            y = (dual * dual).tanh()
            primal, tangent = fwAD.unpack_dual(y)
            tangent.sum().backward()  # reverse over forward
        return primal, tangent, x.grad

    both(fn)


def test_forward_ad_inplace_on_view():
    def fn():
        base = torch.randn(4)
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.randn(2), torch.randn(2))
            base[1:3].mul_(dual)
            return fwAD.unpack_dual(base).tangent

    both(fn)


# -- custom autograd.Function ------------------------------------------------------------------


class SetupContextMul(torch.autograd.Function):
    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class OnceExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        y = a.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class DirtyDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        a.mul_(2)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class SortWithIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        values, index = a.sort()
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        return values, index

    @staticmethod
    def backward(ctx, g, _):
        (index,) = ctx.saved_tensors
        return torch.zeros_like(g).scatter(0, index, g)


def _setup_context():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    y = SetupContextMul.apply(a.sin(), b)
    (y * y).sum().backward()
    return y, a.grad, b.grad


def _setup_context_double_backward():
    a = torch.randn(3, requires_grad=True)
    y = SetupContextMul.apply(a, a).sum()
    (g,) = torch.autograd.grad(y, a, create_graph=True)
    g.sum().backward()
    return g, a.grad


def _once_differentiable():
    a = torch.randn(3, requires_grad=True)
    (OnceExp.apply(a * 2) ** 2).sum().backward()
    return a.grad


def _once_differentiable_twice():
    a = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(OnceExp.apply(a).sum(), a, create_graph=True)
    g.sum().backward()  # raises: once_differentiable


def _mark_dirty():
    a = torch.randn(3, requires_grad=True)
    x = a.clone()
    y = DirtyDouble.apply(x)
    (y * y).sum().backward()
    return y is x, x._version, a.grad


def _mark_dirty_leaf():
    a = torch.randn(3, requires_grad=True)
    DirtyDouble.apply(a)  # raises: a leaf modified in place


def _mark_non_differentiable():
    a = torch.randn(5, requires_grad=True)
    values, index = SortWithIndex.apply(a * 3)
    (values * torch.arange(5.0)).sum().backward()
    return values, index, index.requires_grad, a.grad


@pytest.mark.parametrize(
    "fn",
    [
        _setup_context,
        _setup_context_double_backward,
        _once_differentiable,
        _once_differentiable_twice,
        _mark_dirty,
        _mark_dirty_leaf,
        _mark_non_differentiable,
    ],
)
def test_custom_function(fn):
    both(fn)


# -- hooks on nodes ------------------------------------------------------------------------------


def test_node_hooks():
    def fn():
        seen = []
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        y = h * h
        y.grad_fn.register_prehook(lambda go: seen.append(("pre", go[0].clone())))
        y.grad_fn.register_hook(lambda gi, go: seen.append(("post", [g.clone() for g in gi])))
        h.grad_fn.register_prehook(lambda go: (go[0] * 10,))  # a prehook that changes the gradient
        y.sum().backward()
        return seen, x.grad

    seen = both(fn).value[0]
    assert [s[0] for s in seen] == ["pre", "post"]


def test_multi_grad_hook():
    def fn():
        seen = []
        a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        u, v = a.sin(), b.cos()

        def hook(grads):
            seen.append([None if g is None else g.clone() for g in grads])

        handle = torch.autograd.graph.register_multi_grad_hook((u, v), hook)
        (u * v).sum().backward(retain_graph=True)
        u.sum().backward()
        handle.remove()
        return seen, a.grad, b.grad

    assert len(both(fn).value[0]) == 2


def test_multi_grad_hook_any_mode():
    def fn():
        seen = []
        a = torch.randn(3, requires_grad=True)
        u, v = a.exp(), a.tanh()
        torch.autograd.graph.register_multi_grad_hook((u, v), lambda g: seen.append(g.clone()), mode="any")
        (u * v).sum().backward()
        return seen, a.grad

    both(fn)


def test_module_full_backward_hooks():
    def fn():
        seen = []
        m = torch.nn.Linear(3, 2)
        m.register_full_backward_pre_hook(lambda mod, go: seen.append(go[0].clone()))
        m.register_full_backward_hook(lambda mod, gi, go: seen.append(gi[0].clone()))
        m(torch.randn(4, 3, requires_grad=True)).tanh().sum().backward()
        return seen, m.weight.grad

    assert len(both(fn).value[0]) == 2


def test_tensor_hooks_and_retain_grad():
    def fn():
        seen = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        h.retain_grad()
        h.register_hook(lambda g: g * 3)
        x.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        h.exp().sum().backward()
        return h.grad, x.grad, seen

    both(fn)


def test_hook_that_raises():
    def hook(g):
        raise ValueError("a hook failed")

    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        y.register_hook(hook)
        y.sum().backward()

    assert both(fn).error[0] is ValueError


def test_backward_twice_raises():
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x.exp().sum()
        y.backward()
        y.backward()

    plain = both(fn)
    assert plain.error[0] is RuntimeError and "second time" in plain.error[1]


def test_training_steps_with_optimizer():
    def fn():
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(5, 4)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        return list(m.parameters())

    both(fn)


def test_autocast_cpu():
    def fn():
        m = torch.nn.Linear(4, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(torch.randn(2, 4)).relu()
        y.float().sum().backward()
        return y, m.weight.grad

    both(fn)


class LoggingTensor(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_sees_the_same_calls():
    def fn():
        LoggingTensor.calls = []
        x = torch.randn(3, requires_grad=True)
        y = (x.as_subclass(LoggingTensor) * 2).exp().sum()
        y.backward()
        return type(y).__name__, x.grad, list(LoggingTensor.calls)

    assert both(fn).value[2] == ["mul", "exp", "sum", "backward"]


class _SavesItsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + 0 * x


def test_a_subclass_a_custom_function_saves_sees_only_the_detach_of_graphprune_s_handle():
    """``save_for_backward`` packs outside any torch call: the pack hook's reads of the
    tensor (``is_leaf``, ``_is_view``, ``_version``) reached the subclass's
    ``__torch_function__`` as calls the program never made (a subclass that refuses
    unknown calls raised). Only the detach that graphprune's handle holds (which keeps
    the subclass's type for the backward) goes through it."""
    w = torch.ones(2, requires_grad=True)
    x = (w * 1).as_subclass(LoggingTensor)
    LoggingTensor.calls = []
    with gp.track():
        y = _SavesItsInput.apply(x)
    assert LoggingTensor.calls == ["mul", "detach"]
    y.sum().backward()
    assert_close(w.grad, torch.full((2,), 2.0))


class _UnhashableMeta(torch._C._TensorMeta):
    def __eq__(cls, other):  # __eq__ without __hash__: the classes it makes are unhashable
        return cls is other


class _UnhashableClassTensor(torch.Tensor, metaclass=_UnhashableMeta):
    pass


def test_a_subclass_whose_class_is_unhashable_is_read_without_hashing_it():
    # the recorder tells a plain tensor's property read by the argument's type: by identity,
    # never by hashing the type (which may be unhashable, or run the metaclass's code)
    def fn():
        t = torch.randn(3).as_subclass(_UnhashableClassTensor)
        return t.dim(), t.dtype, tuple(t.shape)

    assert both(fn).value == (1, torch.float32, (3,))


class _CallLog(TorchFunctionMode):
    """A user's mode entered outside ``track()``: logs every call that reaches it."""

    calls: list = []

    def __enter__(self):
        _CallLog.calls = []
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _CallLog.calls.append(getattr(func, "__qualname__", getattr(func, "__name__", repr(func))))
        return func(*args, **(kwargs or {}))


def test_a_mode_outside_track_sees_the_calls_of_a_plain_run_and_only_those():
    def fn():
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        h = lin(x * 2)
        h.register_hook(lambda g: g * 1)
        values, _ = h.max(dim=1)  # a tuple of outputs
        v = h[:, :2]
        v.mul_(3)  # in place, on a view
        h[0] = h[1]  # an item assignment
        assert lin.weight.dtype is torch.float32  # a Parameter's property
        (values.sum() + h.sum()).backward()
        return x.grad, list(_CallLog.calls)

    calls = both(fn, outer=_CallLog).value[1]
    assert "TensorBase.mul_" in calls and "Tensor.backward" in calls


def test_a_mode_outside_track_sees_no_read_of_a_custom_functions_saved_tensors():
    # save_for_backward packs outside any torch call: the pack hook's reads reached the modes
    def fn():
        x = torch.ones(3, requires_grad=True)
        y = SetupContextMul.apply(x * 1, torch.full((3,), 2.0, requires_grad=True))
        y.sum().backward()
        return x.grad, list(_CallLog.calls)

    both(fn, outer=_CallLog)
    plain = outcome(fn, False, _CallLog).value[1]
    with _CallLog():
        with gp.track(timeline=gp.Timeline()):  # the timeline's pack hook reads sizes too
            fn_value = fn()
    assert fn_value[1] == plain


class _Unwrapping(torch.Tensor):
    """A subclass whose calls give plain tensors back."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", repr(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_subclass_in_a_list_argument_sees_only_its_own_calls():
    def fn():
        w = torch.ones(3, requires_grad=True)
        s = (w * 2).as_subclass(_Unwrapping)  # a non-leaf made outside track(), in a list below
        _Unwrapping.calls = []
        out = torch.cat([s, w])
        return type(out).__name__, list(_Unwrapping.calls)

    assert both(fn).value[1] == ["cat"]


# -- anomaly mode ----------------------------------------------------------------------------------


def test_detect_anomaly_nan_in_backward():
    def fn():
        x = torch.tensor([-1.0, 4.0], requires_grad=True)
        with torch.autograd.detect_anomaly():
            x.sqrt().sum().backward()  # SqrtBackward0 returns nan

    plain = both(fn)
    assert plain.error[0] is RuntimeError and "returned nan values" in plain.error[1]
    assert {w[0] for w in plain.warnings} == {UserWarning}


def test_set_detect_anomaly_clean_pass():
    def fn():
        x = torch.randn(3, requires_grad=True)
        with torch.autograd.set_detect_anomaly(True):
            (x.sigmoid() * x).sum().backward()
        return x.grad, torch.is_anomaly_enabled()

    assert both(fn).value[1] is False


def test_detect_anomaly_inplace_error():
    def fn():
        a = torch.randn(3, requires_grad=True)
        with torch.autograd.detect_anomaly(check_nan=False):
            s = a.sigmoid()
            s.mul_(2)
            s.sum().backward()

    plain = both_inplace_error(fn)  # the forward traceback in the warnings must match too
    assert any("Error detected in SigmoidBackward0" in w[1] for w in plain.warnings)


def _forward_frames(t: torch.Tensor) -> list[str]:
    """The first line of each frame anomaly mode recorded for ``t``'s node."""
    return [frame.splitlines()[0].strip() for frame in t.grad_fn.metadata.get("traceback_", [])]


def test_anomaly_tracebacks_of_the_nodes_an_item_assignment_and_an_in_place_op_on_a_view_make():
    # both make a CopySlices on the base, whose forward traceback kept graphprune's frames
    def fn():
        with torch.autograd.set_detect_anomaly(True):
            x = torch.ones(4, requires_grad=True)
            h = x * 2
            h[0] = x[1] * 3
            g = x * 2
            g[1:3].mul_(2)
        return [_forward_frames(h), _forward_frames(g)]

    frames = both(fn).value
    assert all(name.endswith("in fn") for name in (frames[0][-1], frames[1][-1]))


def test_anomaly_traceback_of_a_torch_function_written_in_python():
    # F.softmax reaches the recorder through handle_torch_function and runs again inside it
    def fn():
        with torch.autograd.set_detect_anomaly(True):
            y = torch.nn.functional.softmax(torch.ones(4, requires_grad=True) * 2, dim=0)
        return _forward_frames(y)

    frames = both(fn).value
    assert frames[-1].endswith("in softmax") and frames[-2].endswith("in fn")


# -- global modes around tracked code -----------------------------------------------------------


@contextlib.contextmanager
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_deterministic_algorithms():
    def fn():
        x = torch.randn(6, 4, requires_grad=True)
        idx = torch.tensor([0, 2, 2, 5])
        y = torch.zeros(6, 4).index_add(0, idx, x[:4] * 2)
        z = y.scatter_add(0, idx.repeat(4, 1).t(), x[1:5])
        (z.tanh()[idx] * torch.nn.functional.embedding(idx, x)).sum().backward()
        return z, x.grad, torch.are_deterministic_algorithms_enabled()

    before = torch.are_deterministic_algorithms_enabled()
    assert both(fn, outer=deterministic).value[2] is True
    assert torch.are_deterministic_algorithms_enabled() is before


def test_checkpoint_with_dropout():
    def fn():
        w = torch.randn(5, 5, requires_grad=True)
        x = torch.randn(3, 5, requires_grad=True)

        def block(t):
            return torch.nn.functional.dropout(t @ w, p=0.5, training=True).relu() @ w

        y = checkpoint(block, x.sin(), use_reentrant=False, preserve_rng_state=True)
        (y * y).sum().backward()
        return y, w.grad, x.grad

    both(fn)


def _compiled_body(t):
    return (t.sin() * t).sum()


def test_torch_compile_called_twice():
    def fn():
        torch._dynamo.reset()
        f = torch.compile(_compiled_body, backend="eager")
        out = []
        for _ in range(2):
            x = torch.randn(3, requires_grad=True)
            y = f(x)
            y.backward()
            out.append((y, x.grad))
        return out

    both(fn)


def test_inference_mode_around_track():
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = (x * 2).exp()
        return y, y.is_inference(), y.requires_grad

    assert both(fn, outer=torch.inference_mode).value[1] is True


def test_track_around_inference_mode():
    def fn():
        x = torch.randn(3, requires_grad=True)
        with torch.inference_mode():
            c = x.exp() * 2
        y = (x * c).sin()
        y.sum().backward()
        return c, c.is_inference(), y, x.grad

    both(fn)


def test_inference_tensor_saved_for_backward_raises():
    def fn():
        with torch.inference_mode():
            c = torch.randn(3)
        x = torch.randn(3, requires_grad=True)
        (x * c).sum().backward()  # c is saved: fine
        c.add_(1)  # an inference tensor outside inference mode: raises

    assert both(fn).error[0] is RuntimeError


# -- TorchScript and threads ---------------------------------------------------------------------


def _fork_grad(x: torch.Tensor) -> torch.Tensor:
    y = (x * x).sum()
    g = torch.autograd.grad([y], [x])
    r = g[0]
    assert r is not None
    return r


def _fork_outer(x: torch.Tensor) -> torch.Tensor:
    fut = torch.jit._fork(_fork_grad, x)
    return torch.jit._wait(fut) * 2


def test_jit_fork_autograd_grad():
    with warnings.catch_warnings():
        # a DeprecationWarning on torch 2.13, a FutureWarning on 2.14
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated")
        scripted = torch.jit.script(_fork_outer)

    def fn():
        x = torch.randn(3, requires_grad=True)
        return scripted(x)

    plain = both(fn)
    assert plain.error is None


def test_thread_started_inside_track_runs_plain():
    def fn():
        out = {}

        def work():
            x = torch.randn(3, requires_grad=True)
            y = (x.exp() * x).sum()
            y.backward()
            out["grad"] = x.grad
            out["hooks"] = torch._C._autograd._top_saved_tensors_default_hooks(False) is None

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return out

    assert both(fn).value["hooks"] is True


def test_backward_in_another_thread():
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = (x.exp() * x.sin()).sum()
        thread = threading.Thread(target=y.backward)
        thread.start()
        thread.join()
        return y, x.grad

    both(fn)


# -- warnings point at the user's line -----------------------------------------------------------


# -- inherent differences, pinned ----------------------------------------------------------------


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: torch.func.grad(f)(x),
        lambda f, x: torch.func.vjp(f, x)[1](torch.ones(())),
        lambda f, x: torch.func.jacrev(f)(x),
    ],
    ids=["grad", "vjp", "jacrev"],
)
def test_torch_func_grad_refuses_saved_tensor_hooks(transform):
    def fn():
        return transform(lambda t: t.sin().sum(), torch.randn(3))

    plain, tracked = outcome(fn, False), outcome(fn, True)
    assert plain.error is None
    assert tracked.error == (
        RuntimeError,
        "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
        "Please open an issue with your use case.",
    )


def test_torch_func_jvp_works_under_track():
    def fn():
        return torch.func.jvp(lambda t: t.sin().exp(), (torch.randn(3),), (torch.ones(3),))

    both(fn)


def test_saved_tensor_identity():
    """graphprune's pack hook keeps ``t.detach()``, so a saved input comes back as a new
    tensor object (with the same ``grad_fn``): plain PyTorch returns the very tensor it
    saved. A saved output is a new object in both."""

    def fn():
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        z = h.sin()
        y = x.exp()
        saved_in, saved_out = z.grad_fn._saved_self, y.grad_fn._saved_result
        return {
            "input is": saved_in is h,
            "input grad_fn": type(saved_in.grad_fn).__name__,
            "input values": saved_in,
            "output is": saved_out is y,
            "output grad_fn": type(saved_out.grad_fn).__name__,
            "output values": saved_out,
        }

    plain, tracked = outcome(fn, False), outcome(fn, True)
    assert plain.error is None and tracked.error is None
    assert_same(plain.value["input values"], tracked.value["input values"])
    assert_same(plain.value["output values"], tracked.value["output values"])
    assert (plain.value["input is"], tracked.value["input is"]) == (True, False)
    assert (plain.value["output is"], tracked.value["output is"]) == (False, False)
    assert plain.value["input grad_fn"] == tracked.value["input grad_fn"] == "MulBackward0"
    assert plain.value["output grad_fn"] == tracked.value["output grad_fn"] == "ExpBackward0"


def test_user_saved_tensor_hooks_outside_track_are_bypassed():
    """Saved-tensor hooks are innermost-wins: track() inside a user's own hooks
    (``save_on_cpu``, a custom pack/unpack) takes every save from them."""

    def fn(inner_track: bool):
        calls = []

        def pack(t):
            calls.append("pack")
            return t

        def unpack(t):
            calls.append("unpack")
            return t

        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with gp.track() if inner_track else contextlib.nullcontext():
                y = x.exp().sum()
        y.backward()
        return calls, x.grad

    plain = outcome(functools.partial(fn, False), False)
    inner = outcome(functools.partial(fn, True), False)
    assert plain.value[0] == ["pack", "unpack"]
    assert inner.value[0] == []
    assert_close(plain.value[1], inner.value[1])


def test_disable_saved_tensors_hooks_refuses_track():
    """``disable_saved_tensors_hooks(msg)`` (used by functorch) raises ``msg`` on entry
    while saved-tensor hooks are set: under track() they always are."""

    def fn():
        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.disable_saved_tensors_hooks("no saved-tensor hooks here"):
            y = x.exp().sum()
        y.backward()
        return x.grad

    plain, tracked = runs(fn)
    assert plain.error is None
    assert tracked.error == (RuntimeError, "no saved-tensor hooks here")


def test_warning_location_copy_construct():
    def fn():
        t = torch.ones(2)
        a = torch.tensor(t)
        b = torch.tensor(t)
        return a, b

    got = both(fn).warnings  # two lines: "default" shows the warning once per line
    lines = [first_line(fn) + 2, first_line(fn) + 3]
    assert [(w[0], w[2], w[3]) for w in got] == [(UserWarning, HERE, line) for line in lines]
    assert all("To copy construct from a tensor" in w[1] for w in got)


@pytest.fixture
def warn_always():
    """Warnings that C++ shows once per process (``TORCH_WARN_ONCE``) shown every time."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


def test_warnings_of_item_assignment_and_in_place_ops_on_views_are_filed_at_the_callers_line(warn_always):
    # the recorder's own lines took them: _call_setitem found the call site one frame
    # short (its own caller, the recorder), _call_inplace_on_view made the call itself
    def fn():
        y = torch.zeros(4, requires_grad=True) * 1
        c = torch.tensor([1 + 1j, 2j])  # complex into real: "Casting complex values ..."
        y[0] = c[0]
        y[1:3].copy_(c)
        return y

    got = both(fn).warnings
    lines = [first_line(fn) + 3, first_line(fn) + 4]
    assert [(w[0], w[2], w[3]) for w in got] == [(UserWarning, HERE, line) for line in lines]
    assert all("Casting complex values to real" in w[1] for w in got)


def test_warning_location_non_leaf_grad():
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        g = y.grad  # a non-leaf's .grad warns (a UserWarning from C++)
        return g

    got = both(fn).warnings
    assert [(w[0], w[2], w[3]) for w in got] == [(UserWarning, HERE, first_line(fn) + 3)]


def test_warning_from_a_python_torch_function_keeps_its_stacklevel():
    def fn():
        x = torch.randn(2, 3, requires_grad=True)
        return torch.nn.functional.softmax(x)  # no dim: a Python warning, stacklevel=3

    got = both(fn).warnings  # same file and line as plain, whichever frame that is
    assert [w[0] for w in got] == [UserWarning] and "softmax" in got[0][1]


def test_warnings_of_a_new_function_are_filed_at_its_own_line_when_an_old_ones_code_is_gone():
    # The recorder files call sites by id(code) (NOTE [ Code objects as keys ] in
    # _outputs.py) and holds the code objects it has seen: a function made after
    # another one was freed can take a freed object's id, and would then have its
    # warnings filed at the freed function's file and line.
    module = {"torch": torch}
    for i in range(20):
        f = eval(compile("\n" * i + "lambda t: torch.tensor(t)", f"<generated {i}>", "eval"), module)
        with warnings.catch_warnings(record=True) as got, gp.track():
            warnings.simplefilter("always")
            f(torch.ones(2))  # warns: copy construct
        assert [(w.filename, w.lineno) for w in got if "copy construct" in str(w.message)] == [
            (f"<generated {i}>", i + 1)
        ]
        del f, got


def test_exec_namespace_and_its_tensors_die_with_it():
    # the call-site function of exec'd code held the code's globals, so a namespace
    # with a tensor of its own (and the tensor) outlived every reference the program had
    ns = {"torch": torch, "big": torch.ones(1 << 16)}
    exec("def step(x):\n    return (x * big).sum()\n", ns)
    dead = weakref.ref(ns["big"])
    x = torch.randn(1 << 16, requires_grad=True)
    with gp.track():
        y = ns["step"](x)
    y.backward()
    del ns, y
    gc.collect()
    assert dead() is None


def test_code_made_per_step_takes_its_call_sites_with_it():
    # a loss weighting eval'd each step (or a forward exec'd): the recorder's tables held
    # every step's code objects and a function or code per call site, up to 65536 codes
    from graphprune import _outputs, _tape

    w = torch.ones(3, requires_grad=True)

    def tables():  # after the records of dead outputs, which hold their code, are dropped (as a prune does)
        _outputs._compact()
        gc.collect()
        return len(_tape._call_sites) + len(_tape._site_made) + len(_tape._site_code)

    def step():
        code = compile("0.5 * (w * w).sum() + 2.0 * w.sin().sum()", "<config>", "eval")
        with gp.track():
            loss = eval(code, {"w": w})
        assert _outputs.describe(loss).endswith("created at <config>:1")
        loss.backward()

    step()
    gc.collect()
    before = tables()
    for _ in range(20):
        step()
    gc.collect()
    assert tables() == before


def test_a_script_run_by_runpy_and_its_tensors_die_with_it(tmp_path):
    # runpy's module is in sys.modules while the script runs: its call sites' functions
    # were kept with the script's namespace, and the namespace's tensors with it
    script = tmp_path / "train_script.py"
    script.write_text(
        "import torch, graphprune as gp\n"
        "big = torch.ones(1 << 16)\n"
        "x = torch.randn(1 << 16, requires_grad=True)\n"
        "with gp.track():\n"
        "    y = (x * big).sum()\n"
        "y.backward()\n"
        "refs.append(weakref.ref(big))\n"
    )
    refs: list = []
    for _ in range(2):
        runpy.run_path(str(script), init_globals={"refs": refs, "weakref": weakref}, run_name="__main__")
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_call_site_of_a_module_shares_the_module_s_warning_registry():
    # the call site's function stands for the module with a small namespace of its own:
    # a warning raised under it goes to the module's registry, once per location
    module = types.ModuleType("registry_probe")
    sys.modules["registry_probe"] = module
    try:
        exec(compile("import torch\ndef copy(t):\n    return torch.tensor(t)\n", "registry_probe.py", "exec"),
             module.__dict__)
        with warnings.catch_warnings(record=True) as got, gp.track():
            warnings.simplefilter("default")
            for _ in range(3):
                module.copy(torch.ones(2))
        assert len(got) == 1 and module.__warningregistry__
    finally:
        del sys.modules["registry_probe"]


def test_an_overridable_function_made_per_call_and_what_it_closes_over_die_with_it():
    # the recorder's table of which functions modify their input in place held every
    # function a __torch_function__ call named: a closure made per call, with what it
    # closed over (the torch.overrides pattern, handle_torch_function(f, ...))
    def make():
        table = torch.ones(1 << 16)

        def scale(x):
            if torch.overrides.has_torch_function_unary(x):
                return torch.overrides.handle_torch_function(scale, (x,), x)
            return x * table[: x.numel()]

        return scale, weakref.ref(table)

    refs = []
    with gp.track():
        for _ in range(2):
            scale, ref = make()
            scale(torch.ones(4, requires_grad=True) * 2)  # a tensor: the mode sees scale
            refs.append(ref)
            del scale
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_the_recorder_asks_once_whether_a_torch_function_modifies_its_input():
    # the table above keeps only functions that live as long as the program; torch's
    # own (a builtin without a self, a method, a property's getter, F.*) must stay in
    # it, or every call asks again (a fix for the closures left torch.mul out)
    from graphprune import _tape

    t = torch.ones(3, requires_grad=True)
    with gp.track():
        r = torch.nn.functional.relu(torch.mul(t, 2.0))
        r.add_(1)
        assert r.shape == (3,)
        torch.nn.functional.max_pool1d((1.0 - r).reshape(1, 1, 3) ** 2, 1)  # closures torch's decorators made
        torch.ops.aten.add.Tensor(r, r)
    for func in (torch.mul, torch.nn.functional.relu, torch.Tensor.add_, torch.Tensor.shape.__get__,
                 torch.Tensor.__rsub__, torch.Tensor.__pow__, torch.nn.functional.max_pool1d,
                 torch.ops.aten.add.Tensor):
        assert func in _tape._inplace_funcs, func


def test_warnings_of_code_run_with_two_namespaces_go_to_each_ones_module():
    # one code object, two globals (a function copied into another namespace): the
    # call site kept the first namespace, and the second's warnings were filed in
    # the first's module, past a filter on that module
    code = compile("def f(x):\n    return torch.nn.functional.softmax(x)\n", "shared.py", "exec")
    a = {"__name__": "mod_a", "torch": torch}
    exec(code, a)
    f_b = types.FunctionType(a["f"].__code__, {"__name__": "mod_b", "torch": torch})
    t = torch.randn(2, 3, requires_grad=True)

    def run():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", module="mod_b")
            a["f"](t)
            f_b(t)
        return len(got)

    plain = run()
    with gp.track():
        tracked = run()
    assert (plain, tracked) == (1, 1)


class _StacksSeen(torch.utils.data.Dataset):
    """What a worker's torch calls run under: (torch-function modes, no saved-tensor hooks)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        no_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        return torch.tensor([torch._C._len_torch_function_stack(), int(no_hooks)])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method only")
def test_a_dataloader_worker_forked_inside_track_runs_untracked():
    """NOTE [ A forked child ] in _tape.py: a worker forked inside the block started
    with the recorder and the pack hook on, as the forking thread had them."""
    def fn():
        loader = torch.utils.data.DataLoader(_StacksSeen(), batch_size=None, num_workers=1,
                                             multiprocessing_context="fork")
        return [batch.tolist() for batch in loader]

    assert both(fn).value == [[0, 1], [0, 1]]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork only")
def test_a_child_forked_inside_track_closes_its_tape_and_keeps_the_users_hooks():
    read, write = os.pipe()
    w = torch.ones(2, requires_grad=True)
    pid = -1
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with gp.track():
                pid = os.fork()
                if pid == 0:  # the child: its block goes on, untracked, and closes
                    inside = torch._C._len_torch_function_stack()
                    (w.exp() * w).sum().backward()
                y = (w.exp() * w).sum()
            if pid == 0:
                hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        if pid == 0:
            os.write(write, f"{inside} {int(hooks)} {torch._C._len_torch_function_stack()}".encode())
    finally:
        if pid == 0:  # never back into pytest
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 100).decode() == "0 1 0"  # no recorder; the user's hooks on under the tape
    os.close(read)
    os.close(write)
    y.backward()


# -- what differs, as README's "What track() changes" says -----------------------------
def test_data_assigned_to_a_saved_non_leaf_after_it_was_saved_is_not_what_the_backward_reads():
    """graphprune holds ``x.detach()``, an alias of the data ``x`` had when saved;
    ``x.data = new`` gives ``x`` other data, which plain PyTorch's saved variable (``x``
    itself) reads."""
    def fn():
        w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        x = w * 2
        y = (x * w).sum()
        x.data = torch.tensor([10.0, 20.0, 30.0])
        y.backward()
        return w.grad

    plain, tracked = runs(fn)
    assert_close(plain.value, torch.tensor([12.0, 24.0, 36.0]))
    assert_close(tracked.value, torch.tensor([4.0, 8.0, 12.0]))


def test_detach_in_place_of_a_saved_non_leaf_is_not_refused():
    """PyTorch skips its check while saved-tensor hooks are set; the data is unchanged."""
    def fn():
        w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        x = w * 2
        y = (x * w).sum()
        x.detach_()
        y.backward()
        return w.grad

    plain, tracked = runs(fn)
    assert plain.error[0] is RuntimeError and "detached in-place" in plain.error[1]
    assert tracked.error is None
    assert_close(tracked.value, torch.tensor([4.0, 8.0, 12.0]))


def test_requires_grad_of_a_saved_leaf_is_read_as_it_was_saved_as_under_any_hooks():
    def fn():
        w, v = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        y = (w * v).sum()
        w.requires_grad_(False)
        y.backward(create_graph=True)
        return v.grad.requires_grad

    plain, tracked = runs(fn)
    hooked = outcome(fn, False, lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert (plain.value, tracked.value, hooked.value) == (False, True, True)


def test_the_inference_fast_path_of_transformer_layers_is_not_taken():
    """torch takes it only where no torch function is overridden, and any
    ``TorchFunctionMode`` is: the padded positions are computed, not zero."""
    def fn():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval()
        x, pad = torch.randn(2, 3, 8), torch.tensor([[False, False, True], [False, False, False]])
        with torch.no_grad():
            return encoder(x, src_key_padding_mask=pad)[0, 2]

    plain, tracked = runs(fn)
    assert bool((plain.value == 0).all()) and not bool((tracked.value == 0).all())


class _WarnsForItsCaller(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "exp":
            warnings.warn("exp of this tensor is deprecated", DeprecationWarning, stacklevel=3)
        return super().__torch_function__(func, types, args, kwargs or {})


def _library_exp(t):
    return t.exp()


def test_a_warning_raised_in_a_torch_call_with_stacklevel_3_is_filed_in_graphprune_s_frame():
    """The function that stands at the caller's line is one frame (NOTE [ Warnings at
    the caller's line ] in _tape.py): a warning two frames out of the torch call meets
    the recorder's."""
    def fn():
        return _library_exp(torch.ones(2).as_subclass(_WarnsForItsCaller))

    plain, tracked = runs(fn)
    assert [w[2] for w in plain.warnings] == [HERE] and [w[2] for w in tracked.warnings] == ["_tape.py"]


def test_a_torch_call_takes_a_few_frames_of_the_recursion_limit():
    def deepest():
        reached = [0]

        def down(t, depth):
            reached[0] = depth
            return down(t.neg(), depth + 1)

        try:
            down(torch.ones(1), 0)
        except RecursionError:
            pass
        return reached[0]

    plain, tracked = runs(deepest)
    assert plain.value - 8 <= tracked.value < plain.value
    with gp.track():  # and the recorder is whole after it
        assert torch.ones(1).neg().item() == -1


class _UnhashableScale:
    """An overridable callable that cannot be hashed (as a ``@dataclass`` with ``eq=True``
    is): plain PyTorch's dispatch never hashes it."""

    __hash__ = None

    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, t):
        if torch.overrides.has_torch_function_unary(t):
            return torch.overrides.handle_torch_function(self, (t,), t)
        return t * self.k

    def shift(self, t):
        if torch.overrides.has_torch_function_unary(t):
            return torch.overrides.handle_torch_function(self.shift, (t,), t)
        return t + self.k


@pytest.mark.parametrize("block", ["track", "pruning"])
def test_an_unhashable_overridable_function_runs_as_in_plain_pytorch(block):
    # reproduced in review: the recorder looked the function up in a dict, TypeError
    def run():
        s = _UnhashableScale(2.0)
        x = torch.ones(2, requires_grad=True)
        y = s(x) * s.shift(x)
        y.sum().backward()
        return y.detach(), x.grad

    want = run()
    with gp.track() if block == "track" else gp.pruning():
        got = run()
    for g, w in zip(got, want):
        assert_close(g, w)


def _traced_calls(fn) -> list[str]:
    """The names of the Python functions ``fn()`` calls in this file, as a tracer sees them."""
    seen = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == __file__:
            seen.append(frame.f_code.co_name)
        return None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen


def test_a_tracer_sees_the_call_site_function_at_the_callers_line():
    # README: a debugger or line tracer sees each torch call's line twice
    x = torch.ones(2, requires_grad=True)

    def work():
        return torch.sin(x)

    assert _traced_calls(work) == ["work"]
    with gp.track():
        assert _traced_calls(work) == ["work", "_graphprune_call"]


def test_a_function_compiled_outside_track_compiles_once_more_inside():
    # README: Dynamo guards the torch-function mode stack; later calls reuse both graphs
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    f = torch.compile(lambda t: (t.sin() * 2).sum(), backend="eager")
    x = torch.ones(3, requires_grad=True)
    f(x)
    before = counters["stats"]["unique_graphs"]
    with gp.track():
        f(x)
        f(x)
    f(x)
    assert counters["stats"]["unique_graphs"] == before + 1
