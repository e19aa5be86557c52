"""One pass per loss: ``backward_each`` and ``grads_each``.

NOTE [ Heads, the trunk, and the cut ]
Multi-task code backpropagates T losses that share a trunk, one at a time. Each
loss's graph splits in two: its *head*, the nodes no other loss reaches, and the
*trunk*, the nodes several losses reach. Where the head meets the trunk is its
*cut*: the edges from head nodes into trunk nodes.

- Losses given as tensors (heads built together): a node is in the trunk when two
  losses reach it; through a routing node (``torch.stack``, ``losses[i] = l_i``,
  NOTE [ Gradient routing ]) only when their gradients can meet in it.
- Losses given as callables (heads built one at a time, each after the previous
  pass): a head is what its callable built, told by the nodes' sequence numbers
  (increasing per thread); the trunk is what existed before.

``backward_each`` needs only the sum of the losses' gradients, so it runs each
head's pass down to its cut (freeing the head as it goes), keeps the gradients that
arrive there, and runs the trunk once from their sums: the time and memory of the
hand-written ``x.detach().requires_grad_()`` split, with no change to the model, and
on graphs with no single split point (heads tapping several trunk depths) too.

The cut must let each node's backward run exactly once over all passes. A head's
pass (``torch.autograd.grad`` to the cut) runs every node with a path to a cut node,
so the cut is taken below the *upper* part of the head's graph, the part its pass
runs: the *lower* part is downward closed (the trunk, every leaf, what they reach),
no node of it has parents on both sides (a node of the head feeding a trunk node
that another trunk node feeds too is moved down, with what it reaches), and the cut
is where the upper part's edges enter it. Every leaf is in the lower part: a
parameter the upper part alone feeds has its gradient accumulated right after the
head's pass (through its ``AccumulateGrad``, as a plain pass would), the others in
the trunk's pass.
``grads_each`` needs each loss's own gradient of the shared parameters, so each
loss runs a whole pass; the heads go as their passes end, the trunk after the last.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping

import torch
from torch.autograd.graph import GradientEdge

from . import _outputs, _routing
from ._graph import FOREIGN, _is_router, is_accumulator, reach, saved
from ._marks import is_function, is_hooked
from ._plan import Plan, input_guards, listed, no_graph_reason
from ._prune import _relabel, _remember, inputs_of_a_pass
from ._report import PruneReport, nothing_released
from ._tape import before_hooks, track
from ._warn import warn_at_caller

__all__ = ["backward_each", "grads_each"]

_TRUNK_REASON = "the trunk the losses of {call} share"
_LATER_REASON = "a later loss of {call}"
_LAZY_NOTE = (
    "an earlier head's callable built it, and that head's pass released it with the head. Build what "
    "several heads use before calling {call} (with the trunk, under track()), or build the heads "
    "first and pass their losses."
)


def backward_each(losses, *, keep=None, strategy: str = "cut") -> list[PruneReport]:
    """Backpropagate each loss in turn, as ``for l in losses: l.backward(retain_graph=True)``
    would, freeing each head during its own pass and the trunk after the last.

    ``losses`` is a list of scalar losses; or one tensor whose entries are the losses
    (``torch.stack([...])``, or ``losses[i] = l_i`` into a zeros tensor); or a list
    of callables, each building its head and returning its loss when its turn comes
    (called inside :func:`~graphprune.track`), so only one head lives at a time.
    Gradients accumulate into ``.grad`` as the plain calls would. ``keep=`` protects
    as in :func:`~graphprune.backward`, for every pass.

    ``strategy="cut"`` runs each head down to where it meets the trunk and the trunk
    once, from the sum of the gradients there (NOTE [ Heads, the trunk, and the
    cut ]): one trunk pass in all, holding those gradients (one per tap depth) until
    it runs. ``strategy="passes"`` runs each loss's whole pass, the trunk kept until
    the last: T trunk passes, nothing held between them. The last report names it.
    With callables, ``"cut"`` runs the trunk after the last of them: one that changes
    trunk parameters or their ``.grad`` in place needs ``"passes"``, which runs the
    trunk after each head as the loop does.

    A loss that is a leaf (a placeholder ``torch.zeros((), requires_grad=True)`` for a
    task without labels in the batch) has no graph: its pass writes its ``.grad``, as
    the loop's would, and its report releases nothing. An empty list runs nothing.

    Returns:
        One :class:`~graphprune.PruneReport` per pass (with ``"cut"``: one per head,
        then the trunk's).

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(3, requires_grad=True)
        >>> heads = [torch.full((3,), 2.0, requires_grad=True) for _ in range(2)]
        >>> with gp.track():
        ...     x = w.exp()
        ...     losses = torch.stack([(x * h).sin().sum() for h in heads])
        >>> reports = gp.backward_each(losses)
        >>> [r.released_node_count for r in reports], reports[-1].strategy
        ([2, 2, 1], 'cut: 2 head pass(es), then the trunk once from 1 edge(s)')
        >>> expected = 2 * (2 * x.detach()).cos() * 2 * x.detach()
        >>> torch.testing.assert_close(w.grad, expected)
    """
    notes = _Notes()
    reports = _backward_each(losses, keep, strategy, notes)
    notes.show()
    return reports


class _Notes:
    """The one warning a per-loss helper shows per call: the first its passes deserve
    (``Plan.warning``): a graph built outside ``track()``, read at every pass, or a sum
    the user holds, read at the last pass only (the one that frees the trunk, which
    such a sum keeps; its walks at every pass would cost one per pending loss each), the
    call's own later losses not taken for held sums. That nothing can be released is
    not shown where a later pass that did not retain the graph freed what other hooks
    and PyTorch held (NOTE [ Outputs saved as they are ] in ``_plan.py``)."""

    __slots__ = ("losses", "first", "untracked", "released")

    def __init__(self) -> None:
        self.losses: list = []
        self.first: tuple[str, str] | None = None
        self.untracked = self.released = False

    def take(self, plan: Plan, call: str, last: bool) -> None:
        self.released = self.released or plan.freed_what_others_held
        if self.first is None:  # Plan.warning's first is the untracked warning
            untracked = plan.untracked_warning(call)
            self.untracked = untracked is not None
            self.first = plan.warning(call, self.losses) if last and untracked is None else untracked

    def show(self) -> None:
        if self.first is not None and not (self.untracked and self.released):
            warn_at_caller(*self.first)


def _backward_each(losses, keep, strategy: str, notes: _Notes) -> list[PruneReport]:
    call = "graphprune.backward_each"
    if strategy not in ("cut", "passes"):
        raise ValueError(f'{call}: strategy must be "cut" or "passes", got {strategy!r}')
    items = _items(losses, call)
    if not items:  # the loop over no losses runs nothing
        return []
    notes.losses = [t for t in items if isinstance(t, torch.Tensor)]
    lazy = callable(items[0])
    heads = _heads(items, call, cut=strategy == "cut")
    hooked = False
    if strategy == "cut":  # NOTE [ Hooks at the cut ]
        if lazy:  # the first head stands for the others: built before any pass
            first = next(heads)
            hooked = _hooked([first])
            first.lower = set()  # read: not held through the passes
            heads = _then(first, heads)
        else:
            hooked = _hooked(heads)
            for head in heads:
                head.lower = set()  # read: not held through the passes
    if hooked:
        strategy = "passes"
        if not lazy:
            heads = _heads(items, call, cut=False)
    if strategy == "passes":
        reports = [report for _, report in _whole_passes(
            call, heads, len(items), keep, _whole_pass, lazy, notes)]
        text = f"passes: {len(items)} whole pass(es), the trunk freed by the last"
        if hooked:
            text += (" (a hook below the cut, or a tensor at it that retains its grad: the cut would "
                     "run it on the heads' summed gradient, not once per loss)")
        _label_last(reports, text)
        return reports
    reports, cut, whole, ran = [], collections.OrderedDict(), 0, []  # ran: the heads of whole passes
    flushed: list[GradientEdge] = []  # where the trunk ran early: NOTE [ Hooks a later head registers ]

    def flush():
        if cut:
            early, grads = [GradientEdge(node, nr) for node, nr in cut], [g for g, _ in cut.values()]
            cut.clear()
            torch.autograd.backward(early, grads, retain_graph=True)  # releases nothing: later heads use it
            flushed.append(early)

    with before_hooks(flush) if lazy else contextlib.nullcontext():
        for i, head in enumerate(heads):
            if head.stop == "leaf":
                reports.append(_leaf_pass(call, head.loss, torch.autograd.backward)[1])
                continue
            if head.cut and head.cut[0].node is head.loss.grad_fn:  # all of it is trunk: nothing to run yet
                _add(cut, head.cut[0], torch.ones_like(head.loss))
                continue
            if lazy and i and head.stop != "whole" and _hooked([head]):  # NOTE [ Hooks at the cut ]
                head.stop = "whole"
            if head.stop == "whole":  # NOTE [ Where a head's pass stops ]: its whole pass, the trunk kept
                whole += 1
                head.lower = set()
                ran.append(head)  # for the trunk's release: what only it reaches goes with the rest
                run = functools.partial(_whole_pass, head.loss)
                _, report = _pass(call, [head.loss], keep, head.guards, run, notes=notes, lazy=lazy)
                reports.append(report)
                continue
            got, report = _pass(call, [head.loss], keep, head.guards, functools.partial(_to_the_cut, head),
                                notes=notes, lazy=lazy, cut=None if lazy else {e.node for e in head.cut})
            reports.append(report)
            _add_each(cut, head.cut, got)
            del got  # before the next callable builds its head: one gradient at the cut, the sum
    edges = [GradientEdge(node, nr) for node, nr in cut]
    grads = [g for g, _ in cut.values()]
    below = [e for head in ran for e in head.cut] + [e for early in flushed for e in early]
    below = list({(e.node, e.output_nr): e for e in below if (e.node, e.output_nr) not in cut}.values())
    whys = []
    if whole:
        whys.append(f"{whole} head(s) ran whole passes: a reentrant checkpoint above the cut, or a hook "
                    "below it, or a tensor at it that retains its grad")
    if flushed:
        whys.append(f"the trunk ran {len(flushed)} time(s) more, from the earlier heads' gradients, before "
                    "a later head's callable registered a tensor hook")
    why = f" ({'; '.join(whys)})" if whys else ""
    if not edges:  # every head ran its whole pass, or none reached a leaf that requires grad
        if below:  # what the whole passes (and the early trunk passes) kept of the trunk goes now
            plan = Plan(call, [head.loss for head in ran] or None, keep, arg="losses", edges=below)
            report = plan.report(call, dry_run=False)
            plan.release()
            text = f"cut: {len(items)} head pass(es), the trunk released after the last{why}"
            reports.append(_remember(dataclasses.replace(report, strategy=text), ran=False))
        else:  # one loss, or graphs that share nothing (per-domain batches): each pass freed its own
            _label_last(reports, f"cut: {len(items)} head pass(es), no trunk pass to run once{why}")
        return reports
    cut.clear()
    _, report = _pass(call, None, keep, (),
                      lambda retain: torch.autograd.backward(edges, grads, retain_graph=retain),
                      edges=edges + below, notes=notes, last=True)
    text = f"cut: {len(items)} head pass(es), then the trunk once from {len(edges)} edge(s){why}"
    reports.append(_relabel(report, text))
    return reports


def _whole_pass(loss: torch.Tensor, retain: bool = True) -> None:
    """A loss's whole pass, retaining the graph but for the last that meets a cycle
    (NOTE [ Outputs saved as they are ] in ``_plan.py``)."""
    torch.autograd.backward(loss, retain_graph=retain)


def _label_last(reports: list, strategy: str) -> None:
    """Label the last report of a pass through a graph (a leaf loss's has none) with ``strategy``."""
    graphs = [i for i, r in enumerate(reports) if r.strategy != _LEAF_TEXT]
    if graphs:
        reports[graphs[-1]] = _relabel(reports[graphs[-1]], strategy)


def grads_each(losses, inputs, *, keep=None, allow_unused: bool | None = None,
               materialize_grads: bool = False, accumulate=()) -> list[tuple[torch.Tensor | None, ...]]:
    """Each loss's gradients of ``inputs``, as ``[torch.autograd.grad(l, inputs,
    retain_graph=True) for l in losses]`` would give them (the rows of the T x P
    Jacobian that PCGrad, CAGrad and MGDA combine), each head freed during its own
    pass and the trunk during the last.

    ``losses`` as for :func:`backward_each`. With callables, each head is built after
    the previous pass freed its predecessor: the peak is the trunk and one head.
    ``allow_unused`` and ``materialize_grads`` as for ``torch.autograd.grad``;
    :func:`~graphprune.last_report` gives the last pass's report; a dict of
    ``inputs`` gives dict rows, as ``torch.autograd.grad`` does. ``accumulate``: leaf
    tensors (the heads' parameters, none of ``inputs``) whose gradients each pass
    accumulates into ``.grad`` as ``backward`` would, right after it, instead of
    returning them: the rows then hold only ``inputs`` (the shared parameters), and no
    pass's gradients of the heads are held over the next. With ``keep=None``, an
    intermediate among ``inputs`` (``z``, as MGDA-UB takes the gradients at the shared
    representation) keeps the graph below it, which no pass runs, for ``z.backward(g)``
    after: ``torch.autograd.grad`` keeps it too.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(2, requires_grad=True)
        >>> with gp.track():
        ...     x = w * 3
        >>> rows = gp.grads_each([lambda: (x * x).sum(), lambda: x.sin().sum()], w)
        >>> rows[0]
        (tensor([18., 18.]),)
    """
    call = "graphprune.grads_each"
    items = _items(losses, call)
    if not items:  # the list comprehension over no losses
        return []

    inputs = inputs_of_a_pass(inputs, call)
    keys = list(inputs) if isinstance(inputs, dict) else None  # torch takes a dict too: rows are dicts
    wanted = ([inputs] if isinstance(inputs, (torch.Tensor, GradientEdge)) else
              list(inputs.values()) if keys is not None else list(inputs))
    if not isinstance(inputs, (torch.Tensor, list, tuple, dict)):
        inputs = wanted  # a generator (model.parameters()): read once, by every pass
    extra = listed(accumulate)  # a generator (head.parameters()) too
    if isinstance(extra, torch.Tensor):
        extra = [extra]
    elif not isinstance(extra, (list, tuple)):
        raise TypeError(f"{call}: accumulate must be a leaf tensor or a list of them (the heads' "
                        f"parameters), got {type(accumulate).__name__}")
    extra = list(extra)
    returned = {id(t.node.variable if isinstance(t, GradientEdge) and is_accumulator(t.node) else t)
                for t in wanted}  # a leaf's edge is the leaf
    for i, t in enumerate(extra):
        if not (isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad):
            got = (type(t).__name__ if not isinstance(t, torch.Tensor) else f"a non-leaf {type(t).__name__}"
                   if not t.is_leaf else f"a {type(t).__name__} that does not require grad")
            raise TypeError(f"{call}: accumulate[{i}] must be a leaf tensor that requires grad "
                            f"(a parameter), got {got}")
        if id(t) in returned:
            raise ValueError(f"{call}: accumulate[{i}] is in inputs too: its gradient is either returned "
                             "in the rows or accumulated into .grad; pass it in one of them")

    if extra and materialize_grads and allow_unused is False:  # torch's check, which run() skips
        raise ValueError("Expected allow_unused to be True or not passed when materialize_grads=True, "
                         "but got: allow_unused=False.")

    index = itertools.count()  # the pass running: the loss it is of

    def run(loss, retain=True):
        i = next(index)
        try:
            return row_of(loss, retain)
        except RuntimeError as e:  # torch's unused-input error says which input, not which loss
            if "appears to not have been used in the graph" not in str(e):
                raise
            before = f" The passes of losses[:{i}] ran, each releasing its head." if i else ""
            raise RuntimeError(f"{call}: losses[{i}]: {e}{before}") from e

    def row_of(loss, retain):
        if not extra:
            return torch.autograd.grad(loss, inputs, retain_graph=retain, allow_unused=allow_unused,
                                       materialize_grads=materialize_grads)
        with _accumulating(extra):  # NOTE [ Leaves accumulated as they arrive ]
            got = torch.autograd.grad(loss, wanted + extra, retain_graph=retain, allow_unused=True)
        row = got[:len(wanted)]
        del got
        unused = [i for i, g in enumerate(row) if g is None]
        if unused and not allow_unused and not materialize_grads:
            raise RuntimeError(f"The differentiated Tensor at index {unused[0]} appears to not have been "
                               "used in the graph. Set allow_unused=True if this is the desired behavior.")
        if materialize_grads:
            if any(g is None and isinstance(t, GradientEdge) for t, g in zip(wanted, row)):
                raise RuntimeError("materialize_grads cannot be used when the given input is a GradientEdge")
            row = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(wanted, row))
        return row if keys is None else dict(zip(keys, row))

    notes = _Notes()
    notes.losses = [t for t in items if isinstance(t, torch.Tensor)]
    below = input_guards(wanted) if keep is None else []  # z, for MGDA-UB's z.backward(g) after
    passes = _whole_passes(call, _heads(items, call, cut=False), len(items), keep, run, callable(items[0]),
                           notes, below)
    notes.show()
    return [row for row, _ in passes[:len(items)]]


def _then(first, rest):
    """``first``, then what ``rest`` yields; ``first`` not held once it was taken."""
    yield first
    del first
    yield from rest


def _hooked(heads) -> bool:
    """Whether the cut would run a hook otherwise than the plain loop: one graphprune
    can see in the lower part of these heads' graphs, or a tensor at their cut that
    retains its grad.

    NOTE [ Hooks at the cut ]
    A tensor's hooks run where its gradient arrives, and the cut moves that for the
    lower part. A head's pass to the cut runs the hooks of the trunk tensors it stops
    at, and the trunk's pass, which starts there from the heads' summed gradient, runs
    them again (a gradient reversal undone, ``.grad`` of a tensor that retains it
    counted twice); below the cut a hook runs once, on the sum, where the plain loop
    runs it once per loss on that loss's gradient (a clipping hook clips the sum; a
    parameter's hook and its post-accumulate-grad hook likewise). Whole passes run
    every hook as the plain loop does, so ``strategy="cut"`` takes them when the lower
    part holds a hook graphprune can see:

    - a node marked by a ``register_hook`` call under ``track()`` (the recorder marks
      the tensor's node, which runs the hook whether the tensor still lives or not);
    - a leaf (a parameter, an input) with tensor hooks or post-accumulate-grad hooks;
    - a module's backward hooks (``register_full_backward_hook`` and its pre-hook
      make ``BackwardHookFunction`` nodes around the module);
    - a live tensor graphprune has noted with hooks (registered outside ``track()``),
      or one at the cut that retains its grad (below it, ``.grad`` gets the same sum).

    Every trunk node's backward runs once, in the trunk's pass, on the sum: exact for
    a backward linear in its incoming gradient (PyTorch's, a custom ``Function``'s
    that computes a derivative). For heads given as callables the first head's lower
    part decides for all (it is built before any pass runs); a later head whose lower
    part or cut holds such a hook runs its whole pass, the trunk kept (NOTE [ Where a
    head's pass stops ]), which runs the hook once for that loss.

    NOTE [ Hooks a later head registers ]
    A later head's callable that registers a tensor hook under ``track()`` (``register_hook``,
    ``retain_grad``, ``register_post_accumulate_grad_hook``) would have it run on the
    earlier heads' gradients too, still waiting at the cut for the trunk's one pass,
    where the plain loop had run those before the hook existed. So the recorder runs
    the trunk from the gradients at the cut right before it registers the hook
    (``_tape.before_hooks``), releasing nothing, and the cut starts again; the last
    trunk pass releases what the early ones ran through. Not seen: a hook registered
    outside ``track()`` (the callable runs under it), on a node (``Node.register_hook``).

    Not seen: a hook
    registered outside ``track()`` on a non-leaf tensor that has died since, hooks
    on trunk nodes themselves (``Node.register_prehook``,
    ``Node.register_hook``, the old ``Module.register_backward_hook``), which run once
    on the sum (and, on a node at the cut, in each head's pass too, with no gradient
    for its outputs: NOTE [ Where a head's pass stops ]), and a custom ``Function``
    whose backward is not linear (one that clips). ``strategy="passes"`` runs them as
    the plain loop does.
    """
    lower: set = set().union(*(head.lower for head in heads))
    if not lower:
        return False
    if any(map(is_hooked, lower)):
        return True
    for node in lower:
        if is_accumulator(node):
            leaf = node.variable
            if leaf._backward_hooks or getattr(leaf, "_post_accumulate_grad_hooks", None):
                return True
        elif is_function(node, "BackwardHookFunction", "torch.nn.modules._functions"):
            return True  # a module's backward hooks
    if not _outputs.hooked_nodes().isdisjoint(lower):
        return True
    cut = {(e.node, e.output_nr) for head in heads for e in head.cut}
    for t in _outputs.live(made_before=True):
        try:
            if t.retains_grad and (t.grad_fn, t.output_nr) in cut:
                return True
        except RuntimeError:  # a view made under no_grad and modified in place
            continue
    return False


def _add_each(cut: dict, edges: list[GradientEdge], grads) -> None:
    """:func:`_add` each of a head's gradients at its cut (none left bound here)."""
    for edge, g in zip(edges, grads):
        if g is not None:
            _add(cut, edge, g)


def _add(cut: dict, edge: GradientEdge, g: torch.Tensor) -> None:
    """Sum ``g`` into the cut's gradient at ``edge``: the first one as it came, the
    second into a new tensor of ours, the later ones into that, in place (the pass's
    own gradients may be views or expanded: never written to)."""
    key = (edge.node, edge.output_nr)
    held = cut.get(key)
    if held is None:
        cut[key] = (g, False)
    elif held[1]:
        held[0].add_(g)
    else:
        cut[key] = (held[0] + g, True)


def _to_the_cut(head: _Head, retain: bool = True) -> tuple:
    """A head's pass down to its cut (NOTE [ Where a head's pass stops ]): the
    gradients that arrive at its cut edges, after the hooks of the tensors there, and
    the leaves its upper part feeds accumulated into ``.grad`` as a plain pass does.
    A pass that does not retain the graph captures: "inputs" would run the cut's
    nodes, and free what the trunk's pass needs of them."""
    if head.stop == "capture" or not retain:
        with _accumulating(head.leaves):
            got = torch.autograd.grad(head.loss, [*head.cut, *head.leaves], retain_graph=retain,
                                      allow_unused=True)
        return got[:len(head.cut)]
    captured: dict = {}
    task = [None]  # the head's pass: a pass another hook or thread runs through the cut is not
    hooks = [head.loss.grad_fn.register_prehook(functools.partial(_note_pass, task))]
    hooks += [edge.node.register_prehook(functools.partial(_capture, captured, edge.node, task))
              for edge in {e.node: e for e in head.cut}.values()]
    try:
        torch.autograd.backward(head.loss, inputs=[*head.leaves, *head.cut], retain_graph=retain)
    finally:
        for hook in hooks:
            hook.remove()
    return [captured.get((edge.node, edge.output_nr)) for edge in head.cut]


def _note_pass(task: list, grad_outputs) -> None:
    """The head loss's node's prehook: note the graph task of the first pass to run it,
    the head's own (it starts there)."""
    if task[0] is None:
        task[0] = torch._C._current_graph_task_id()


def _capture(captured: dict, node, task: list, grad_outputs) -> None:
    """A cut node's prehook: keep the gradients that reached it in the head's pass. Its
    own backward then runs with none of its outputs needed (the pass stops here), so
    computes nothing for them. Another pass through the node (a hook's
    ``aux.backward()``, another thread's) is not the head's: its gradient is not kept."""
    if task[0] != torch._C._current_graph_task_id():
        return
    for nr, g in enumerate(grad_outputs):
        if g is not None:
            captured[(node, nr)] = g


@contextlib.contextmanager
def _accumulating(leaves: list):
    """Inside, a pass of ``torch.autograd.grad`` that takes these leaves' gradients
    accumulates each into its ``.grad`` as it arrives, as a plain pass does.

    NOTE [ Leaves accumulated as they arrive ]
    ``torch.autograd.grad`` captures a leaf's gradient after its tensor hooks and
    holds it until the pass ends: a head's parameters' gradients all alive at once,
    where a plain pass gives each to ``AccumulateGrad`` and lets it go. So a last
    tensor hook on each leaf gives the gradient, which the leaf's own hooks have made,
    to its ``AccumulateGrad`` right away (a pass of its own, from the leaf: the layout
    of ``.grad``, post-accumulate-grad hooks, the node's hooks, DDP's among them, as a
    plain pass runs them), the leaf's tensor hooks held back there as they ran, and
    leaves a placeholder of zero strides to be captured. One cost stays: where
    ``.grad`` is ``None``, ``AccumulateGrad`` copies the gradient, which the pass
    still references, where a plain pass's is taken over (a head of two 4096 x 4096
    layers, ``.grad`` set to ``None``: 196 MiB at the peak, 204 holding them all, 136
    for the hand-made cut). Only heads whose cut needs the capture pay it.
    """
    with before_hooks(None):  # graphprune's own hooks, no later head's: NOTE [ Hooks a later head registers ]
        handles = [leaf.register_hook(functools.partial(_accumulate_now, leaf)) for leaf in leaves]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _accumulate_now(leaf: torch.Tensor, grad: torch.Tensor):
    hooks = leaf._backward_hooks  # the dict the leaf's C++ hook reads: emptied in place, then refilled
    held = list(hooks.items())
    hooks.clear()
    try:
        torch.autograd.backward([leaf], [grad])
    finally:
        hooks.update(held)
    if grad.layout is not torch.strided:  # a sparse gradient: small, captured as it is
        return None
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def _pass(call: str, outputs, keep, guards, run, edges=(), notes=None, lazy: bool = False,
          last: bool = False, cut=None):
    """``run(retain)`` under a plan that frees what it passes through, and the report;
    ``notes`` (:class:`_Notes`) takes the plan's warning (``last``: the call's last pass,
    which frees the trunk). A pass does not retain the graph where it meets a cycle that
    only such a pass breaks and no protected root reaches its graph (NOTE [ Outputs
    saved as they are ] in ``_plan.py``), nor a head's pass that stops at the nodes
    ``cut`` and runs one that nothing protects; the others retain it. ``lazy``: the head a callable
    built, whose release a later head's pass may meet (a feature one callable memoised
    for the next), which ``keep=`` cannot name: the error says what to do instead."""
    plan = Plan(call, outputs, keep, arg="losses", guards=guards, edges=edges)
    if lazy:
        plan.reason.note = _LAZY_NOTE.format(call=call)
    if cut is not None:
        retain = not plan.frees_a_cycle_above(cut)
    else:  # a whole pass: a lazy head's may hold what a later callable memoised, which nothing protects
        retain = lazy or not plan.holds_a_cycle()
    result = plan.run(functools.partial(run, retain), retains=retain)
    if notes is not None:
        notes.take(plan, call, last)
    return result, _remember(plan.report(call, dry_run=False))


def _whole_passes(call: str, heads, count: int, keep, run, lazy: bool, notes: _Notes, below=()) -> list:
    """Each head's whole pass, ``(result, report)``; the trunk is protected until the
    last. Heads built by callables protected all that existed before them; the parts
    of it the last pass does not reach (a deeper tap's) are released after it, with
    one report more. ``below``: guards of every pass and that release (the graphs
    below the passes' inputs: ``_plan.input_guards``)."""
    out, losses = [], []
    below = list(below)
    for i, head in enumerate(heads):
        if head.stop == "leaf":
            out.append(_leaf_pass(call, head.loss, run))
            continue
        guards = [*head.guards, *below] if i < count - 1 else below
        losses.append(head.loss)
        out.append(_pass(call, [head.loss], keep, guards, functools.partial(run, head.loss), notes=notes,
                         lazy=lazy and i < count - 1, last=i == count - 1))  # the last frees the trunk too
    if lazy and losses:
        plan = Plan(call, losses, keep, arg="losses", guards=below)
        report = plan.report(call, dry_run=False)
        plan.release()
        if report.released_node_count:
            out.append((None, _remember(report, ran=False)))
    return out


@dataclasses.dataclass
class _Head:
    loss: torch.Tensor
    cut: list[GradientEdge]  # where its pass stops: NOTE [ Heads, the trunk, and the cut ]
    guards: list  # (node, output number, reason) its pass must not free
    leaves: list = dataclasses.field(default_factory=list)  # what its pass accumulates into
    lower: set = dataclasses.field(default_factory=set)  # the nodes below its cut: the trunk's pass runs them
    stop: str = "inputs"  # how its pass stops at the cut (NOTE [ Where a head's pass stops ]); "leaf"


_LEAF_TEXT = "a leaf loss: no graph, its pass wrote its .grad"


def _leaf_pass(call: str, loss: torch.Tensor, run):
    """``(run(loss), report)`` of a loss that is a leaf (a task's placeholder): nothing
    to release, its pass as the plain loop's."""
    result = run(loss)
    return result, _remember(nothing_released(call, _LEAF_TEXT))


def _items(losses, call: str) -> list:
    """The losses as a list of scalar tensors, or of callables (none: the loop runs nothing)."""
    if isinstance(losses, torch.Tensor):
        if losses.dim() == 0:
            items = [losses]
        elif losses.dim() == 1:
            items = [losses[i] for i in range(losses.shape[0])]
        else:
            raise ValueError(f"{call}: losses must be a 1-d tensor of losses, got shape "
                             f"{tuple(losses.shape)}")
    elif isinstance(losses := listed(losses), (list, tuple)):  # any iterable, read once (dict.values())
        items = list(losses)
    else:
        hint = " (its .values()?)" if isinstance(losses, Mapping) else ""
        raise TypeError(f"{call}: losses must be a list of losses, a 1-d tensor of them, or a list of "
                        f"callables that return them, got {type(losses).__name__}{hint}")
    lazy = [callable(t) and not isinstance(t, torch.Tensor) for t in items]
    if any(lazy) and not all(lazy):
        raise TypeError(f"{call}: losses mixes tensors and callables; pass one kind")
    if not any(lazy):
        for i, t in enumerate(items):
            _check_loss(t, f"losses[{i}]", call)
    return items


def _check_loss(t, what: str, call: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{call}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{call}: {what} must be a scalar loss, got shape {tuple(t.shape)}")
    if t.grad_fn is None and not t.requires_grad:
        raise ValueError(f"{call}: {what} has no grad_fn ({no_graph_reason(t)}); there is no graph behind "
                         "it to backpropagate")


def _heads(items: list, call: str, cut: bool):
    """Each loss's ``_Head``: its cut only where ``cut`` asks (a lazy head's guards
    need it always: the trunk is what existed before the callable ran)."""
    if callable(items[0]):
        return _lazy_heads(items, call)
    if cut:
        return _eager_heads(items, call)
    return [_Head(t, [], _later(items[i + 1:], call)) if t.grad_fn is not None else
            _Head(t, [], [], stop="leaf") for i, t in enumerate(items)]


def _later(items: list[torch.Tensor], call: str) -> list:
    """Guards of the losses ``items`` that later passes start from (leaves have no graph)."""
    return [(u.grad_fn, u.output_nr, _LATER_REASON.format(call=call)) for u in items if u.grad_fn is not None]


def _eager_heads(items: list[torch.Tensor], call: str) -> list[_Head]:
    """Each loss's head and cut, with the trunk told by two losses reaching it."""
    reached, supports = [], []
    for fn, nr in ((t.grad_fn, t.output_nr) for t in items):
        sup = {fn: {nr: _routing.ALL}} if fn is not None and _is_router(fn) else {}
        reached.append(reach([fn], supports=sup))
        supports.append(sup)
    owners: dict = collections.defaultdict(list)
    for i, nodes in enumerate(reached):
        for node in nodes:
            owners[node].append(i)
    trunk = {node for node, who in owners.items() if len(who) > 1 and _shared(node, who, supports)}
    heads = []
    for i, t in enumerate(items):
        if t.grad_fn is None:
            heads.append(_Head(t, [], [], stop="leaf"))
            continue
        cut, leaves, lower, stop = _cut(t, trunk.__contains__)
        guards = _later(items[i + 1:], call) + [(e.node, e.output_nr, _TRUNK_REASON.format(call=call))
                                                for e in cut]
        heads.append(_Head(t, cut, guards, leaves, lower, stop))
    return heads


def _shared(node, owners: list[int], supports: list[dict]) -> bool:
    """Whether gradients of two of ``owners`` can meet in ``node``: always, unless it
    routes and their supports are disjoint on every output."""
    if not _is_router(node):
        return True
    seen = [supports[i].get(node, {}) for i in owners]
    for a in range(len(seen)):
        for b in range(a):
            if any(_routing.overlap(s, seen[b].get(nr, _routing.NOTHING)) for nr, s in seen[a].items()):
                return True
    return False


def _lazy_heads(items: list[Callable], call: str):
    """Build each head when its turn comes (a generator: the previous pass has run)."""
    for i, build in enumerate(items):
        start = torch._C._autograd._get_sequence_nr()
        with track():
            loss = build()
        end = torch._C._autograd._get_sequence_nr()
        _check_loss(loss, f"losses[{i}]()", call)
        if loss.grad_fn is None:
            yield _Head(loss, [], [], stop="leaf")
            continue
        # the callable's nodes are numbered from start to end by this thread's counter; a trunk another
        # thread built is numbered by that thread's, above or below: not between, but by chance
        cut, leaves, lower, stop = _cut(loss, lambda node, start=start, end=end: (
            not is_accumulator(node) and not start <= node._sequence_nr() < end))
        yield _Head(loss, cut, [(e.node, None, _TRUNK_REASON.format(call=call)) for e in cut], leaves, lower,
                    stop)


def _cut(loss: torch.Tensor, in_trunk) -> tuple[list[GradientEdge], list[torch.Tensor], set, str]:
    """Where ``loss``'s pass stops, the leaves it accumulates into, the lower part, and
    how its pass stops (NOTE [ Where a head's pass stops ]): the edges from the upper
    part of its graph into the lower part, which holds what ``in_trunk`` says and all
    it reaches (NOTE [ Heads, the trunk, and the cut ])."""
    root = loss.grad_fn
    parents: dict = collections.defaultdict(list)
    order, seen = [root], {root}
    for node in order:  # every node, with its parents: the edges a pass may run
        for child, nr in node.next_functions:
            if child is None:
                continue
            parents[child].append((node, nr))
            if child not in seen:
                seen.add(child)
                order.append(child)
    lower: set = set()
    _close(lower, [n for n in order if in_trunk(n)])
    while root not in lower:  # no lower node may have parents on both sides
        moved = [p for n in list(lower) if any(q in lower for q, _ in parents[n])
                 for p, _ in parents[n] if p not in lower]
        if not moved:
            break
        _close(lower, moved)
    if root in lower:
        return [GradientEdge(root, loss.output_nr)], [], lower, "inputs"
    cut, taken, leaves = [], set(), []
    for node in order:
        upper_parent = any(p not in lower for p, _ in parents[node])
        if is_accumulator(node):
            if upper_parent:
                leaves.append(node.variable)
        elif node in lower and upper_parent:
            for _, nr in parents[node]:
                if (node, nr) not in taken:
                    taken.add((node, nr))
                    cut.append(GradientEdge(node, nr))
    return cut, leaves, lower, _stop(order, lower, cut)


def _stop(order: list, lower: set, cut: list[GradientEdge]) -> str:
    """How a head's pass stops at its cut.

    NOTE [ Where a head's pass stops ]
    ``backward(loss, inputs=[*leaves, *cut])`` ("inputs") stops a head's pass at the
    cut and accumulates its leaves as a plain pass does, as it goes (``AccumulateGrad``
    takes a gradient over as ``.grad`` where there was none); but it runs the cut's
    nodes, with none of their outputs wanted: PyTorch's compute nothing then, a
    custom ``Function``'s ``backward`` runs once more, and a checkpointed region's
    node recomputes (non-reentrant) or raises (reentrant: "incompatible with
    .grad()"). Where a cut node is such a node, the pass captures the cut's gradients
    with ``torch.autograd.grad`` ("capture"), which runs no node it captures at, and
    accumulates the leaves as their gradients arrive (NOTE [ Leaves accumulated as
    they arrive ]). A reentrant checkpoint above the cut refuses any pass that stops
    early: that head runs its whole pass ("whole"), the trunk kept, which gets that
    loss's gradient in a pass of its own and the other heads' sum in the last, adding
    up to the same.
    """
    if any(is_function(n, "CheckpointFunction", "torch.utils.checkpoint") for n in order if n not in lower):
        return "whole"
    for node in {e.node: None for e in cut}:
        if getattr(type(node), "_forward_cls", None) is not None or saved(node)[1] == FOREIGN:
            return "capture"
    return "inputs"


def _close(lower: set, nodes) -> None:
    """Add ``nodes`` and everything they reach to ``lower``."""
    stack = [n for n in nodes if n not in lower]
    lower.update(stack)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in lower:
                lower.add(child)
                stack.append(child)
