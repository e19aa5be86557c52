"""``pruning()``: the ``backward`` and ``grad`` calls of code you do not edit, through graphprune.

NOTE [ Routed calls ]
Multi-task libraries (LibMTL's weighting classes, PCGrad and CAGrad ports) call
``losses[i].backward(retain_graph=True)`` or ``torch.autograd.grad(..., retain_graph=True)``
themselves. A ``TorchFunctionMode`` sees those calls (``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` all reach
``__torch_function__``) and runs the ones that retain the graph as
:func:`~graphprune.backward` / :func:`~graphprune.grad` with ``keep=`` (``None``: the
losses no pass has run through yet keep the trunk). Every other call runs as it was
written, so nothing changes where graphprune has nothing to give:

- without ``retain_graph`` (``create_graph`` sets it, as in PyTorch): PyTorch frees
  what the pass runs and keeps what it does not (``inputs=`` stops it), its own nodes
  included, as ``gp.backward(..., retain_graph=False)`` would;
- batched passes (``is_grads_batched=True``, or any call inside ``torch.vmap``, as
  torchjd's Jacobians are): where routing cannot tell that a later pass sends only
  zeros into a released node, graphprune would have to read the gradient, which vmap
  forbids: such a pass raises ``ReleasedTensorError`` saying so
  (NOTE [ Zero-gradient passes through released nodes ]);
- graphprune's own passes (``gp.backward`` inside the block), the passes torch's own
  code makes (``torch.autograd.functional.jacobian`` and ``hessian``: one retained
  pass per row from the same output), GradientEdge roots,
  outputs with no ``grad_fn`` (PyTorch raises its own error), the deprecated
  ``grad_variables`` / ``only_inputs=False``, and calls while ``torch.compile`` traces.

The mode stack, like saved-tensor hooks, is per thread: another thread's calls are
its own. Inside ``__torch_function__`` the mode is off, so graphprune's pass does not
come back here; ``track()``'s recorder, above or below on the stack, sees the call
before or after and lets it through.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import types

import torch
from torch.overrides import TorchFunctionMode

from . import _prune
from ._plan import _keep_roots
from ._report import PruneReport
from ._warn import function_at, stands_for

__all__ = ["pruning", "Pruning"]

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TRAMPOLINE = "_graphprune_call"  # track()'s and this module's call-site functions
_SIGNATURES = {f: inspect.signature(f) for f in (torch.Tensor.backward, torch.autograd.backward,
                                                 torch.autograd.grad)}


class Pruning(TorchFunctionMode):
    """The mode :func:`pruning` returns: ``reports`` has one :class:`~graphprune.PruneReport`
    per routed call, ``passed`` one ``(call, why)`` per call left to PyTorch, the last
    ``history`` of each; ``routed`` and ``plain`` count them all."""

    def __init__(self, keep=None, history: int | None = 1000) -> None:
        super().__init__()
        if history is not None and type(history) is not int:
            raise TypeError(f"graphprune.pruning: history is an int or None, not {type(history).__name__}")
        if history is not None and history < 1:
            raise ValueError(f"graphprune.pruning: history must be positive or None, got {history}")
        self.keep = keep
        self.history = history
        self.reports: list[PruneReport] = []
        self.passed: list[tuple[str, str]] = []
        self.routed = self.plain = 0
        self._thread: int | None = None

    def __enter__(self) -> Pruning:
        if self._thread is not None:
            raise RuntimeError("graphprune.pruning: this block is already active; use a new pruning()")
        if self.keep is not None:
            _keep_roots(self.keep, "graphprune.pruning")  # a bad keep= fails here, not at a call
        self._thread = threading.get_ident()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError("graphprune.pruning: a block must be closed in the thread that opened it")
        self._thread = None
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            signature = _SIGNATURES.get(func)
        except TypeError:  # an unhashable callable that overrides (a dataclass instance): no pass
            signature = None
        if signature is None:
            return func(*args, **kwargs)
        call = "Tensor.backward" if func is torch.Tensor.backward else f"torch.autograd.{func.__name__}"
        a = signature.bind(*args, **kwargs).arguments
        site = _call_site()
        why = _why_plain(func, a, site) or _why_torch_s(func)
        if why is not None:
            self.plain += 1
            self._keep_last(self.passed, (call, why))
            return func(*args, **kwargs)
        report, result = self._routed(site, call, a, lambda: _at(site, _route, (self.keep, func, a, call)))
        self.routed += 1
        self._keep_last(self.reports, report)
        return result

    def _keep_last(self, entries: list, entry) -> None:
        """Append ``entry``, keeping the last ``history``: a block around a whole training
        run (a library's ``fit()``) would otherwise hold a report per routed call of it."""
        entries.append(entry)
        if self.history is not None and len(entries) > self.history:
            del entries[0]

    def _routed(self, site, call: str, arguments: dict, run) -> tuple:
        """``run()``, the routed call made at ``site`` (a frame, or ``None``) as graphprune's:
        ``(report, result)``. The CLI's block shows the report here."""
        return run()

    def __repr__(self) -> str:
        return f"<graphprune.pruning: {self.routed} routed, {self.plain} plain call(s)>"


def pruning(*, keep=None, history: int | None = 1000) -> Pruning:
    """Run the ``backward``/``grad`` calls of unmodified code (a library's training loop)
    inside the block through graphprune.

    ``t.backward(..., retain_graph=True)``, ``torch.autograd.backward(...,
    retain_graph=True)`` and ``torch.autograd.grad(..., retain_graph=True)`` become
    :func:`~graphprune.backward` and :func:`~graphprune.grad` with ``keep=keep``: the
    pass keeps what later passes need (with ``keep=None``, the losses no pass has run
    through yet, or the un-run entries of a stacked or assigned ``losses`` tensor) and
    frees the rest of its branch as it goes. ``create_graph=True`` retains, as in
    PyTorch; graphprune then frees after the pass and keeps what the gradients' graph
    needs. Every other call runs as written: without ``retain_graph`` PyTorch frees the
    graph itself; batched passes (``is_grads_batched=True``, calls inside
    ``torch.vmap``, as torchjd's) run plain, since graphprune cannot check a
    zero-gradient pass through a released node under vmap; so do graphprune's own
    calls, the calls torch's own code makes (``torch.autograd.functional.jacobian``)
    and GradientEdge roots (NOTE [ Routed calls ]).

    Only graphs built inside :func:`~graphprune.track` can be freed: the block records
    no forward and may hold the forward or not. A later pass from a tensor that is no
    loss (features you backpropagate with a gradient of your own), or a second pass
    from the same loss (gradients by parameter group), needs ``pruning(keep=features)``
    or ``pruning(keep=loss)``, or it meets :class:`~graphprune.ReleasedTensorError`
    naming it. The block acts in the thread that opened it.

    Args:
        keep: what every routed call keeps besides (see :func:`~graphprune.prune_after`);
            ``None`` for the losses not backpropagated yet.
        history: how many of the latest reports and plain calls the block holds (a block
            around a whole training run holds no report per step of it); ``None``: all.

    Returns:
        A ``TorchFunctionMode`` to use in ``with``: ``.reports`` has one
        :class:`~graphprune.PruneReport` per routed call, ``.passed`` one ``(call,
        why)`` per call left to PyTorch (the last ``history`` of each); ``.routed`` and
        ``.plain`` count every one.

    Raises:
        RuntimeError: the block is entered again while it is open, or closed in another
            thread (a closed block may be entered again).
        TypeError, ValueError: ``keep`` is no tensor or node, or needs no grad (raised
            when the block is entered); ``history`` is no int (``TypeError``) or is not
            positive (``ValueError``).

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(3, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     losses = torch.zeros(2)
        ...     losses[0] = (x * x).sum()
        ...     losses[1] = x.sin().sum()
        >>> with gp.pruning() as p:              # a library's loop, unchanged:
        ...     losses[0].backward(retain_graph=True)
        ...     losses[1].backward()
        >>> [r.released_nodes for r in p.reports]
        [{'MulBackward0': 1}]
        >>> p.passed
        [('Tensor.backward', 'retain_graph is not set: PyTorch frees the graph itself')]
        >>> w.grad
        tensor([12.2998, 12.2998, 12.2998])
    """
    return Pruning(keep, history)


def _route(keep, func, a: dict, call: str):
    """The call as graphprune's: ``(report, result)``."""
    with _prune.routed_from(call):
        return _route_as_graphprune_s(keep, func, a)


def _route_as_graphprune_s(keep, func, a: dict):
    if func is torch.autograd.grad:
        result = _prune.grad(
            a["outputs"], a["inputs"], a.get("grad_outputs"), create_graph=a.get("create_graph", False),
            allow_unused=a.get("allow_unused"), materialize_grads=a.get("materialize_grads", False),
            keep=keep,
        )
        return _prune.last_report(), result
    if func is torch.Tensor.backward:
        tensors, grads = a["self"], a.get("gradient")
    else:
        tensors, grads = a["tensors"], a.get("grad_tensors")
    report = _prune.backward(tensors, grads, create_graph=a.get("create_graph", False),
                             inputs=a.get("inputs"), keep=keep)
    return report, None


def _why_plain(func, a: dict, site) -> str | None:
    """Why this call runs as written, or ``None`` to route it (NOTE [ Routed calls ])."""
    retain = a.get("retain_graph")
    if not (a.get("create_graph", False) if retain is None else retain):
        return "retain_graph is not set: PyTorch frees the graph itself"
    if site is not None and site.f_code.co_filename.startswith(_OWN_DIR):
        return "graphprune's own pass"
    if a.get("is_grads_batched") or torch._C._functorch.maybe_current_level() is not None:
        return "a batched pass (is_grads_batched or torch.vmap): graphprune cannot check it"
    if a.get("grad_variables") is not None or a.get("only_inputs", True) is not True:
        return "a deprecated argument (grad_variables, only_inputs)"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    roots = a["self"] if func is torch.Tensor.backward else a.get("tensors", a.get("outputs"))
    roots = roots if isinstance(roots, (tuple, list)) else (roots,)
    if not roots or not all(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in roots):
        return "an output is no tensor with a grad_fn (a GradientEdge, a leaf): PyTorch handles it"
    return None


_HANDLER = torch.overrides.handle_torch_function.__code__
_FROM_TORCH = ("torch's own code made the call (torch.autograd.functional's jacobian and hessian "
               "retain the graph for the next pass from the same output)")


def _why_torch_s(func) -> str | None:
    """Why a call that torch's own code made runs as written (its caller is a frame
    in torch, past the handler and ``func`` itself), or ``None``."""
    frame = sys._getframe(3)  # this, the mode's __torch_function__, then the handler's
    api = func.__code__
    while frame is not None:
        code = frame.f_code
        own = code.co_filename.startswith(_OWN_DIR) and code.co_filename.endswith(("_pruning.py", "_tape.py"))
        if not (code is api or code is _HANDLER or code.co_name == _TRAMPOLINE or own):
            return _FROM_TORCH if code.co_filename.startswith(_TORCH_DIR) else None
        frame = frame.f_back
    return None


def _call_site():
    """The frame that made the call: the first outside torch, this module and ``track()``'s
    call-site functions (which stand at their caller's line)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        own = code.co_filename.startswith(_OWN_DIR) and code.co_filename.endswith(("_pruning.py", "_tape.py"))
        if not (code.co_filename.startswith(_TORCH_DIR) or code.co_name == _TRAMPOLINE or own):
            return frame
        frame = frame.f_back
    return None


def _at(site, fn, args):
    """``fn(*args)`` from a function that stands at ``site``'s line, in its file and
    module, so that graphprune's warnings are filed at the library's or user's call
    (NOTE [ Warnings at the caller's line ] in ``_tape.py``)."""
    if site is None:
        return fn(*args)
    key = (site.f_code, site.f_lineno)
    trampoline = _sites.get(key)
    if trampoline is None or not stands_for(trampoline.__globals__, site.f_globals):
        if len(_sites) > 4096:
            _sites.clear()
        line = max(2, key[1] or site.f_code.co_firstlineno)
        code = _CODE.replace(co_filename=site.f_code.co_filename, co_firstlineno=line - 1)
        trampoline, kept = function_at(code, site.f_globals, _TRAMPOLINE)
        if kept:
            _sites[key] = trampoline
    return trampoline(fn, args)


def _code() -> types.CodeType:
    module = compile(f"def {_TRAMPOLINE}(fn, args):\n    return fn(*args)\n", "<graphprune>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


_CODE = _code()
_sites: dict = {}
