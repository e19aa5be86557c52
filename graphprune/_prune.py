"""``prune_after``, ``explain``, ``backward`` and ``grad``: retain_graph per subgraph."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge

from ._collector import walks
from ._graph import is_accumulator, walk
from ._plan import Plan, as_outputs, input_guards, listed
from ._report import KeptReason, PruneReport, nothing_released
from ._warn import warn_at_caller

__all__ = ["prune_after", "explain", "backward", "grad", "last_report"]


def inputs_of_a_pass(inputs, call: str):
    """``inputs`` as ``torch.autograd.grad`` takes them (a tensor, a ``GradientEdge``,
    or an iterable of them), or a ``TypeError`` that names the argument.

    Example::

        >>> inputs_of_a_pass(None, "graphprune.grad")
        Traceback (most recent call last):
        ...
        TypeError: graphprune.grad: inputs must be a tensor, a GradientEdge or a sequence of them ...
    """
    if isinstance(inputs, (torch.Tensor, GradientEdge, Iterable)):
        return inputs
    raise TypeError(f"{call}: inputs must be a tensor, a GradientEdge or a sequence of them (what "
                    f"torch.autograd.grad takes: the tensors to differentiate with respect to), got "
                    f"{type(inputs).__name__}")


def _leaf_grads(roots, inputs) -> list[torch.Tensor]:
    """The ``.grad`` a ``backward`` pass from the nodes ``roots`` wrote: of ``inputs``,
    or of every leaf."""
    if inputs is not None:
        if isinstance(inputs, (torch.Tensor, GradientEdge)):
            inputs = [inputs]
        elif isinstance(inputs, dict):  # torch takes a dict of inputs: its values
            inputs = inputs.values()
        leaves = []
        for t in inputs:
            if isinstance(t, GradientEdge):  # a leaf's gradient edge ends at its accumulator
                t = t.node.variable if is_accumulator(t.node) else None
            if isinstance(t, torch.Tensor):
                leaves.append(t)
    else:
        leaves = [node.variable for node in walk(roots) if is_accumulator(node)]
    return [t.grad for t in leaves if t.grad is not None]


_AGAIN = ("the outputs of a create_graph=True pass, for a later pass from them (a loss and a penalty "
          "on its gradient); keep= names what stays instead")


def _pass_and_prune(call: str, outputs, arg: str, keep, retain_graph, create_graph: bool, pass_fn, made,
                    inputs=None):
    """Run ``pass_fn(retain)`` (a pass from ``outputs``; it retains the graph but for
    ``retain_graph=False``, PyTorch's own pass; a cycle it retains warns: NOTE [ Outputs
    saved as they are ] in ``_plan.py``) and free the branch: as the pass goes,
    or after it with ``create_graph=True`` (the gradients'
    graphs, ``made(result)``, lead back into the branch and are protected). With
    ``keep=None``, the graphs below ``inputs`` are protected too (``grad``'s: an
    ``autograd.grad`` pass keeps what lies below an intermediate it stops at, where
    ``autograd.backward(inputs=)`` frees it: :func:`~graphprune._plan.input_guards`).
    Return the pass's result and the report (also :func:`last_report`'s)."""
    retain_graph = _retain_flag(retain_graph, call)
    tensors, edges = as_outputs(outputs, call, arg, leaves=True)
    routed = getattr(_routing, "call", None)
    roots = [*tensors, *edges]  # the leaves torch takes have no graph: their pass only writes .grad
    keep = _keep_for(call, keep, retain_graph, roots)
    below = input_guards(inputs) if keep is None else []
    if not roots:
        result = pass_fn(retain_graph is not False)
        return result, _remember(nothing_released(call), retain_graph)
    if create_graph and retain_graph is not False:
        result = pass_fn(True)
        # keep=None: the outputs too, for the pass a penalty on the gradient goes with
        # (``(loss + g.pow(2).sum()).backward()``), as torch's create_graph retains them
        again = [] if keep is not None else [(r.grad_fn, r.output_nr, _AGAIN) for r in tensors] + [
            (e.node, e.output_nr, _AGAIN) for e in edges]
        plan = Plan(call, roots, keep, arg=arg, extra=made(result), guards=again + below, routed=routed)
        plan.release()
    else:  # retain_graph=False is PyTorch's own pass, create_graph or not: it frees what it runs, all of it
        plain = retain_graph is False
        plan = Plan(call, roots, keep, arg=arg, guards=below, routed=routed)
        result = plan.run(lambda: pass_fn(not plain), ran_only=plain, retains=not plain)
    report = _remember(plan.report(call, dry_run=False), retain_graph)  # a warning made an error: it is
    if retain_graph is None:  # last_report() all the same, as the pass ran and the branch is released
        cycle = None if routed is not None or create_graph else plan.cycle_warning(call)
        if cycle is None or plan.untracked_warning(call) is None:  # a cycle: other hooks hold the graph,
            plan.warn(call)  # not a forward outside track()
        if cycle is not None:  # NOTE [ Outputs saved as they are ] in _plan.py
            warn_at_caller(*cycle)
    return result, report


def _retain_flag(retain_graph, call: str) -> bool | None:
    """``retain_graph`` as PyTorch reads it: ``None``, or the truth of an integer (a
    bool, ``0``, a 0-d integer tensor); anything else is a ``TypeError``, as there.

    Example::

        >>> _retain_flag(0, "graphprune.backward"), _retain_flag(None, "graphprune.backward")
        (False, None)
    """
    if retain_graph is None or type(retain_graph) is bool:
        return retain_graph
    try:
        return bool(operator.index(retain_graph))
    except TypeError:
        kind = type(retain_graph)
        name = kind.__qualname__ if kind.__module__ == "builtins" else (
            f"{kind.__module__}.{kind.__qualname__}")
        raise TypeError(f"{call}: retain_graph must be a bool or None, got {name}") from None


def prune_after(y: torch.Tensor | Sequence[torch.Tensor], keep=None) -> PruneReport:
    """Release the saved tensors that only ``y``'s branch of the graph still needs.

    A node's saved tensors are released when ``y`` reaches it and no protected root
    does. ``keep=None`` protects the graphs of the live losses created under
    :func:`~graphprune.track` that ``y``'s graph does not contain and no pass has run
    through yet (the other heads' losses: NOTE [ What keep=None protects ] in
    ``_plan.py``); a tensor of more than one element protects nothing.
    ``keep=`` (a tensor, a ``GradientEdge``, a ``grad_fn`` node or a sequence of them) protects exactly
    those: ``keep=x`` for a head built on ``x`` after this call. Call it after ``y``'s
    backward pass (``.backward(retain_graph=True)`` or ``torch.autograd.grad``); it
    works after the ``with`` block.

    Args:
        y: the finished output (a tensor or a ``GradientEdge``, as PyTorch's passes
            take), or a sequence of them.
        keep: what must stay differentiable; ``None`` for the losses not
            backpropagated yet.

    Returns:
        A :class:`PruneReport` of what was released and kept, and why.

    Raises:
        TypeError: ``y`` or ``keep`` is not a tensor or a ``GradientEdge`` (or node,
            for ``keep``).
        ValueError: ``y`` has no ``grad_fn`` (a leaf has no graph to prune), or a
            ``keep`` tensor needs no grad.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(4, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     y1 = (x * x).sum()
        ...     y2 = x.sqrt().sum()
        >>> y1.backward(retain_graph=True)
        >>> report = gp.prune_after(y1)         # y2 is not backpropagated yet: x's graph stays
        >>> report.released_nodes
        {'MulBackward0': 1}
        >>> y2.backward()
        >>> y1.backward()
        Traceback (most recent call last):
        ...
        graphprune.errors.ReleasedTensorError: graphprune: a backward pass needs ... of MulBackward0 ...
    """
    report, warning = _prune_after(y, keep)
    if warning is not None:  # shown with the collector on: showing it may run the user's code
        warn_at_caller(*warning)
    return report


@walks  # till the plan is dropped: NOTE [ The collector and the walk ]
def _prune_after(y, keep) -> tuple[PruneReport, tuple[str, str] | None]:
    plan = Plan("graphprune.prune_after", y, keep)
    report = plan.report("graphprune.prune_after", dry_run=False)
    plan.release()
    return _remember(report), plan.warning("graphprune.prune_after")


def explain(y: torch.Tensor | Sequence[torch.Tensor], keep=None) -> PruneReport:
    """What :func:`prune_after` would release and keep, releasing nothing.

    Args:
        y: the output whose branch a prune would free (a tensor or a ``GradientEdge``,
            or a sequence of them), as :func:`prune_after` takes it.
        keep: what would stay differentiable (see :func:`prune_after`).

    Returns:
        The :class:`PruneReport` the prune would give (``dry_run``; also
        :func:`last_report`'s).

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(4, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     y1 = x.sin().cos().sum()
        >>> print(gp.explain(y1, keep=x))  # doctest: +ELLIPSIS
        graphprune.explain would release 2 saved tensor(s) of 2 node(s): 16 B freed
          nodes: CosBackward0, SinBackward0
          kept by the trunk: 16 B
          kept 2 node(s), 16 B: keep: tensor of shape (4,), torch.float32, created at ...
    """
    return _explain(y, keep)


@walks  # till the plan is dropped: NOTE [ The collector and the walk ]
def _explain(y, keep) -> PruneReport:
    return _remember(Plan("graphprune.explain", y, keep).report("graphprune.explain", dry_run=True))


def backward(
    tensors,
    grad_tensors=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables=None,
    inputs=None,
    *,
    keep=None,
) -> PruneReport:
    """``torch.autograd.backward`` that retains the trunk and frees the branch as it goes.

    Takes what ``torch.autograd.backward`` takes (tensors or gradient edges, in its
    order), and ``keep=`` (see :func:`prune_after`); a leaf among ``tensors`` has no
    graph to prune: the pass only writes its ``.grad``. The pass runs with
    ``retain_graph=True`` (where it protects nothing and meets a tensor that other
    saved-tensor hooks packed as it is, a cycle only a pass without it breaks, it
    warns: NOTE [ Outputs saved as they are ] in ``_plan.py``); each saved tensor only the branch
    needs is let go as soon as its node has used it, as ``retain_graph=False`` would,
    so the peak is that of a plain pass on the branch. Branch nodes the pass does not
    run (``inputs=`` stops it) are released when it ends. If the pass raises, what it
    had not used yet is kept. ``retain_graph=True`` keeps the whole graph (plain
    PyTorch's pass; the report says what it holds); ``retain_graph=False`` is
    PyTorch's pass too, with ``create_graph=True`` or without: it frees what it runs
    (nodes built outside ``track()`` included, which its report lists as released) and
    keeps what ``inputs=`` stops it from running. ``grad_tensors``, ``create_graph``,
    ``grad_variables`` (deprecated) and ``inputs``
    are passed to the pass as ``torch.autograd.backward`` reads them.

    Returns:
        The :class:`PruneReport` of what was released and kept (:func:`last_report`
        returns it too).

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(4, requires_grad=True)
        >>> with gp.track():
        ...     x = w.exp()
        ...     y1 = (x * x).sum()
        >>> gp.backward(y1, keep=x).released_tensors
        2
        >>> x.sum().backward()
        >>> w.grad
        tensor([17.4964, 17.4964, 17.4964, 17.4964])
    """
    call = "graphprune.backward"
    if grad_variables is not None:  # torch's warning and error, at your line, not graphprune's pass's
        warn_at_caller("`grad_variables` is deprecated. Use `grad_tensors` instead.", category=FutureWarning)
        if grad_tensors is not None:
            raise RuntimeError("`grad_tensors` and `grad_variables` (deprecated) arguments both passed to "
                               "`backward()`. Please only use `grad_tensors`.")
        grad_tensors, grad_variables = grad_variables, None
    tensors = listed(tensors)  # a generator, dict.values(), as torch takes: read by the plan, then the pass
    if inputs is not None and not isinstance(inputs, (torch.Tensor, Sequence, dict)):
        inputs = list(inputs)  # a generator (model.parameters()): the pass and made() both read it

    def pass_fn(retain: bool):
        torch.autograd.backward(tensors, grad_tensors, retain_graph=retain, create_graph=create_graph,
                                grad_variables=grad_variables, inputs=inputs)

    def made(_):
        ys, edges = as_outputs(tensors, call, "tensors", leaves=True)
        return _leaf_grads([t.grad_fn for t in ys] + [e.node for e in edges], inputs)

    return _pass_and_prune(call, tensors, "tensors", keep, retain_graph, create_graph, pass_fn, made)[1]


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
    *,
    keep=None,
):
    """``torch.autograd.grad`` with the trunk retained and the branch freed as it goes.

    Takes what ``torch.autograd.grad`` takes, and ``keep=``; returns what it returns
    (the :class:`PruneReport` is :func:`last_report`'s). See :func:`backward`. With
    ``keep=None``, an intermediate among ``inputs`` keeps the graph below it, which the
    pass does not run and ``torch.autograd.grad`` keeps too: ``gp.grad(loss, z)``, then
    ``z.backward(g)``.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(2, requires_grad=True)
        >>> with gp.track():
        ...     x = w * 3
        ...     y1 = (x * x).sum()
        >>> gp.grad(y1, w, keep=x)
        (tensor([18., 18.]),)
        >>> gp.last_report().released_nodes
        {'MulBackward0': 1}
    """
    call = "graphprune.grad"
    if not only_inputs:  # torch's warning, at your line
        warn_at_caller("only_inputs argument is deprecated and is ignored now (defaults to True). To "
                       "accumulate gradient for other parts of the graph, please use "
                       "torch.autograd.backward.",
                       category=FutureWarning)
        only_inputs = True
    outputs = listed(outputs)
    if not isinstance(inputs, (torch.Tensor, GradientEdge, Sequence, dict)):  # model.parameters():
        inputs = list(inputs_of_a_pass(inputs, call))  # the pass and the plan both read it

    def pass_fn(retain: bool):
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph=retain,
            create_graph=create_graph,
            only_inputs=only_inputs,
            allow_unused=allow_unused,
            is_grads_batched=is_grads_batched,
            materialize_grads=materialize_grads,
        )

    def made(gradients):  # a dict of inputs gives a dict of gradients
        return gradients.values() if isinstance(gradients, dict) else gradients

    result, _ = _pass_and_prune(call, outputs, "outputs", keep, retain_graph, create_graph, pass_fn, made,
                                inputs)
    return result


def last_report() -> PruneReport | None:
    """The report of this thread's last :func:`prune_after`, :func:`backward`,
    :func:`grad` or :func:`explain` call, or of the last pass of
    :func:`~graphprune.backward_each`, :func:`~graphprune.grads_each` or a call that
    :func:`~graphprune.pruning` routed (``None`` before the first); :func:`~graphprune.render`
    leaves it as it was."""
    return getattr(_last, "report", None)


_last = threading.local()
_routing = threading.local()  # .call: the torch call pruning() routes here, named in what it releases


@contextlib.contextmanager
def routed_from(call: str):
    """Within: the passes are ``call``'s (``"torch.autograd.grad"``), made graphprune's
    by :func:`~graphprune.pruning`, and a pass that meets what they released is told to
    open the block with ``keep=``, since it cannot pass ``keep=`` to code it does not edit."""
    before, _routing.call = getattr(_routing, "call", None), call
    try:
        yield
    finally:
        _routing.call = before


def _keep_for(call: str, keep, retain_graph, outputs):
    """``keep`` as ``retain_graph`` asks: ``True`` keeps every graph the outputs have,
    ``False`` keeps nothing; with ``keep=`` besides, they would contradict."""
    if retain_graph is None:
        return keep
    if keep is not None:
        raise ValueError(f"{call}: pass keep= or retain_graph=, not both (keep= is retain_graph "
                         "per subgraph)")
    return list(outputs) if retain_graph else []


def _remember(report: PruneReport, retain_graph=None, ran: bool = True) -> PruneReport:
    """``report`` as this thread's last (:func:`last_report`); ``ran=False``: a release
    no pass made (what a per-loss helper's last pass left of the trunk)."""
    if retain_graph:
        held = (KeptReason("retain_graph=True keeps the whole graph", sum(r.nodes for r in report.kept),
                           report.bytes_kept, frozenset().union(*(r.node_ids for r in report.kept))),)
        report = dataclasses.replace(report, kept=held)
    return _keep_last(report, ran=ran)


def _relabel(report: PruneReport, strategy: str) -> PruneReport:
    """``report``, which a per-loss helper's pass just made, labelled with the helper's
    ``strategy``: what :func:`last_report` gives from now on; the innermost
    :func:`capturing` block gets it as a relabel of ``report`` (the same pass)."""
    return _keep_last(dataclasses.replace(report, strategy=strategy), relabels=report)


def _keep_last(report: PruneReport, relabels: PruneReport | None = None, ran: bool = True) -> PruneReport:
    """``report`` as this thread's last, told to the innermost :func:`capturing` block."""
    _last.report = report
    captures = getattr(_last, "captures", None)
    if captures:
        captures[-1](report, relabels, ran)
    return report


@contextlib.contextmanager
def capturing(on_report):
    """While the block is open, ``on_report(report, relabels, ran)`` gets each report
    this thread's calls make, as they make it (``relabels``: ``None``, or the report that
    ``report`` labels, :func:`_relabel`; ``ran``: a pass made it, not a release after the
    passes); a block opened inside it gets those of the
    calls made inside instead. For the CLI: the passes of ``grads_each`` and of a
    ``pruning()`` block return no report."""
    captures = getattr(_last, "captures", None)
    if captures is None:
        captures = _last.captures = []
    captures.append(on_report)
    try:
        yield
    finally:
        for i in range(len(captures) - 1, -1, -1):  # by identity: callbacks may compare equal
            if captures[i] is on_report:
                del captures[i]
                break
