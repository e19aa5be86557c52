"""The plan of a prune: which nodes ``y`` reaches, which are kept and why, and the
release of the rest (now, or during a backward pass)."""

from __future__ import annotations

import collections
import functools
import itertools
import re
import weakref
from collections.abc import Iterable, Mapping

import torch
from torch.autograd.graph import GradientEdge, Node

from . import _outputs
from ._checkpoint import inputs_of
from ._collector import walks
from ._graph import (
    FOREIGN,
    NOTHING_SAVED,
    TRACKED,
    UNTRACKED,
    _is_router,
    _SavedTensor,
    along_every_edge,
    is_accumulator,
    name,
    reach,
    saved,
    saves_its_output,
    saves_nothing,
    saves_one,
    was_freed,
)
from ._marks import FINISHED, RELEASED, is_hooked, marking_released, node_name
from ._report import (
    KeptReason,
    PruneReport,
    exclusive_keys,
    format_bytes,
    held_elsewhere,
    storage_bytes,
    storages,
    unique_bytes,
)
from ._routing import ALL, NOTHING, complement, index_text, merge, widen
from ._saved import SavedHandle, release_all
from ._trunk import released, walk_trunk_once
from ._warn import warn_at_caller
from ._zero import forget, guard_released, known_zero

__all__ = ["Plan", "as_outputs"]

_BOOL = torch.bool
_FOREIGN_REASON = "saved under other saved-tensor hooks (checkpoint, save_on_cpu, ...)"
_CHECKPOINT_INPUTS = "; graphprune holds the checkpointed regions' inputs, which they recompute from"
_UNTRACKED_REASON = (
    "built outside graphprune.track() (or under saved-tensor hooks that keep tensors); "
    "PyTorch or those hooks hold its saved tensors"
)


def no_graph_reason(t: torch.Tensor) -> str:
    """Why a tensor has no ``grad_fn``, for an error that names it."""
    if t.requires_grad:
        return "it is a leaf"
    return ("it does not require grad: made under torch.no_grad() or torch.inference_mode(), "
            "or from tensors that do not require grad")


def listed(value):
    """``value`` as PyTorch's passes read their outputs: one tensor or gradient edge as
    it is, any other iterable (a generator, ``dict.values()``, a deque) as a list, read
    once; a mapping or a string as it is, to be refused by name."""
    if isinstance(value, (torch.Tensor, list, tuple, str, bytes, Mapping)) or not isinstance(value, Iterable):
        return value
    return list(value)


def as_outputs(
    value, call: str, arg: str, leaves: bool = False
) -> tuple[list[torch.Tensor], list[GradientEdge]]:
    """The tensors and the gradient edges in ``value`` (one, or an iterable of them:
    what PyTorch's passes take) whose graphs a prune walks. ``leaves``: a leaf
    tensor or a leaf's edge, which have no graph behind them (a pass from one only
    writes its ``.grad``), is left out rather than refused."""
    value = listed(value)
    single = isinstance(value, GradientEdge) or not isinstance(value, (list, tuple))
    items = [value] if single else list(value)
    if not items and not leaves:
        raise ValueError(f"{call}: {arg} is empty; pass the tensor(s) whose branch is finished")
    tensors, edges = [], []
    for i, t in enumerate(items):
        name = arg if single else f"{arg}[{i}]"
        if isinstance(t, GradientEdge):
            if not isinstance(t.node, Node):
                raise TypeError(f"{call}: {name} is a GradientEdge to {type(t.node).__name__}, not to a node")
            if not is_accumulator(t.node):
                edges.append(t)
            elif not leaves:  # as a leaf tensor is refused
                raise ValueError(f"{call}: {name} is the gradient edge into a leaf's AccumulateGrad; there "
                                 "is no graph behind it to prune")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{call}: {name} must be a torch.Tensor or a GradientEdge, got {type(t).__name__}")
        if t.grad_fn is None:
            if leaves and t.requires_grad:
                continue
            raise ValueError(f"{call}: {name} has no grad_fn ({no_graph_reason(t)}); there is no graph "
                             "behind it to prune")
        tensors.append(t)
    return tensors, edges


def _keep_roots(keep, call: str, warn_leaves: bool = True) -> list[tuple[Node, int | None, str]]:
    """``(node, output number or None for a node, description)`` of each root that
    ``keep`` protects; ``warn_leaves``: warn where they are all leaves."""
    single = isinstance(keep, GradientEdge) or not isinstance(keep, (list, tuple))
    items = [keep] if single else list(keep)
    roots = []
    if warn_leaves and items and all(_is_leaf(k) for k in items):
        warn_at_caller(
            f"{call}: keep= names only leaf tensors (parameters, inputs); a leaf has no graph "
            "behind it, so it protects nothing. Name the tensor a later backward pass starts "
            "from, or the intermediate it is built on (the trunk's output x)."
        )
    for i, k in enumerate(items):
        name = "keep" if single else f"keep[{i}]"
        if isinstance(k, torch.Tensor):
            if not k.requires_grad:
                raise ValueError(f"{call}: {name} does not require grad; it has no graph to keep")
            if k.grad_fn is not None:
                roots.append((k.grad_fn, k.output_nr, f"{name}: {_outputs.describe(k)}"))
        elif isinstance(k, GradientEdge):  # a tuple: tested before a sequence is
            if not isinstance(k.node, Node):
                raise TypeError(f"{call}: {name} is a GradientEdge to {type(k.node).__name__}, not to a node")
            roots.append((k.node, k.output_nr, f"{name}: the gradient edge into {node_name(k.node)}"))
        elif isinstance(k, Node):
            roots.append((k, None, f"{name}: node {node_name(k)}"))  # a routing node: every output
        else:
            what = ("a tensor, a GradientEdge, a grad_fn node or a list or tuple of them" if single else
                    "a tensor, a GradientEdge or a grad_fn node (keep= takes one list of them)")
            hint = ""
            if isinstance(k, Mapping):  # list(d) would be its keys
                hint = "; pass its tensors: keep=list(d.values())" if single else " (its .values()?)"
            elif single and isinstance(k, collections.abc.Iterable) and not isinstance(k, (str, bytes)):
                hint = "; pass keep=list(...)"
            raise TypeError(f"{call}: {name} must be {what}, got {type(k).__name__}{hint}")
    return roots


def _as_written(call: str, routed: str | None) -> str:
    """A call as its messages name it: a call ``pruning()`` routed by the torch call
    the code wrote (NOTE [ Routed calls ] in ``_pruning.py``)."""
    return call if routed is None else f"{routed} (graphprune.pruning() ran it as {call})"


def _is_leaf(k) -> bool:
    """Whether ``keep`` item ``k`` is a leaf, as a tensor, its gradient edge or its
    ``AccumulateGrad``: no graph behind it."""
    if isinstance(k, torch.Tensor):
        return k.requires_grad and k.grad_fn is None
    if isinstance(k, GradientEdge):
        k = k.node
    return isinstance(k, Node) and is_accumulator(k)


_BELOW_AN_INPUT = ("{name}: {what}, an input the pass stops at (inputs=), and the graph below it, which the "
                   "pass does not run: a later pass starts there (z.backward(g) after the gradients at z, "
                   "as MGDA-UB takes them); keep= names what stays instead")


def input_guards(inputs) -> list[tuple[Node, int, str]]:
    """``Plan``'s ``guards`` for a pass with ``keep=None`` and ``inputs=``: each input
    with a graph below it (an intermediate, not a leaf). A pass that stops at ``z``
    runs nothing below it, and PyTorch's own pass, retaining nothing, frees nothing
    there: the graph below ``z`` is what the next pass, ``z.backward(g)``, needs.

    Example::

        >>> w = torch.ones(2, requires_grad=True)
        >>> z = w * 2
        >>> [(type(n).__name__, nr) for n, nr, _ in input_guards([w, z])]
        [('MulBackward0', 0)]
    """
    if inputs is None:
        return []
    if isinstance(inputs, (torch.Tensor, GradientEdge)):
        inputs = [inputs]
    elif isinstance(inputs, Mapping):
        inputs = list(inputs.values())
    guards = []
    for i, t in enumerate(inputs):
        if isinstance(t, GradientEdge):
            if isinstance(t.node, Node) and not is_accumulator(t.node):
                guards.append((t.node, t.output_nr, _BELOW_AN_INPUT.format(
                    name=f"inputs[{i}]", what=f"the gradient edge into {name(t.node)}")))
        elif isinstance(t, torch.Tensor) and t.grad_fn is not None:
            guards.append((t.grad_fn, t.output_nr, _BELOW_AN_INPUT.format(
                name=f"inputs[{i}]", what=_outputs.describe(t))))
    return guards


# NOTE [ What a prune pays first ]
# A prune runs right after a backward pass, whose kernels streamed the graph's tensors
# through the CPU's caches: the code the prune runs (graphprune's, and the CPython and
# torch paths it calls) is out of them, and every distinct path pays for that once,
# whatever the graph's size. On the benchmark's small transformer (CPU, one thread) a
# prune of a 3-node graph takes ~0.45 ms right after the backward and ~0.13 ms right
# after that one: a third of that transformer's 1.3 ms prune (``benchmarks/overhead.py``,
# the fixed-cost row). So a prune runs no path that its report or its release does not
# need: the text of what it was given, for its messages, is written when one is shown
# (``Release.text``, from ``_outputs.facts``), and the sets of reasons, marks and walks
# it asks are plain sets of weak references (``_marks.weakly_add``), not ``WeakSet``s,
# which add, count and iterate in Python.


# NOTE [ Outputs saved as they are ]
# Other saved-tensor hooks inside the block that pack a tensor as it is (an identity or
# logging ``saved_tensors_hooks``, ``save_on_cpu`` of a CPU tensor, whose ``.cpu()`` is
# the tensor itself) make a node that saves its output hold that output, which holds the
# node as its ``grad_fn``: a reference cycle through C++, which Python's collector does
# not see and only a pass that does not retain the graph breaks (it frees what a node
# saved as it runs it). A pass that retains the graph keeps those tensors for good (15.6
# MiB a step in a review's script, where ``l2.backward()`` freed them).
# - ``backward_each`` and ``grads_each`` end the step, as ``sum(losses).backward()``
#   does: a pass of theirs whose graph no protected root reaches (the last; one whose
#   graph no other loss shares) and that meets such a node does not retain the graph,
#   and its report lists what it freed of other hooks' and PyTorch's as released. A
#   head's pass of ``backward_each``'s cut, which stops where the trunk starts, does not
#   retain it either where it runs such a node and no node it may run is protected
#   (every edge counted, as the engine runs them: ``torch.stack`` sends zeros to the
#   other losses' heads; a built-in node that saves nothing runs again after, so two
#   heads may share one), and it captures at the cut; not a lazy head's, whose trunk a
#   later callable may have memoised where nothing protects it.
# - ``gp.backward``/``gp.grad`` retain it for what graphprune does not hold: a later
#   loss it cannot see (made after the call, or outside ``track()``) may need it, and a
#   pass without ``retain_graph`` would free it under that loss (a review found four
#   such steps that worked, and broke when this pass freed them). So such a call warns,
#   once per line, and ``retain_graph=False`` is what frees them. A call that
#   ``pruning()`` routed was written ``retain_graph=True``: it keeps them, as that pass
#   would, and the user's own last pass frees them.
# Packings this does not see (a dict, a wrapper object, ``t.view_as(t)``) keep their
# cycle without a word.


class Plan:
    """The partition of the graph behind ``outputs`` into kept and released nodes.

    NOTE [ What keep=None protects ]
    A later backward pass starts at a loss that no pass has run through yet. So
    ``keep=None`` protects the graphs of the live tracked losses that the pruned
    outputs' graph does not contain: the other heads' scalar losses, and the entries
    no pass has run through of the losses gathered into one 1-d tensor (a ``stack``,
    ``cat`` or item-assigned ``losses``, or a slice of it: NOTE [ Gradient routing ]
    in ``_routing.py``). Any other tensor of more than one element (logits or a feature held
    for a metric, a hidden state carried to the next step, a module output) protects
    nothing: no backward pass starts there unless ``keep=`` names it (the seed's
    ``retain_graph=x``). A live tensor inside the pruned graph (a module's ``.loss``)
    is finished, and stays finished for later prunes.

    ``extra`` are tensors protected besides ``keep`` (the gradients a
    ``create_graph=True`` pass made, whose graphs lead back into the branch);
    ``guards`` are ``(node, output number or None, reason)`` protected besides, and
    ``edges`` are ``GradientEdge`` roots besides ``outputs`` (the per-loss helpers'
    passes: a head down to where it meets the trunk, the trunk from there).
    """

    freed_what_others_held = False  # a pass without retain_graph freed nodes graphprune does not hold

    @walks
    def __init__(self, call: str, outputs, keep, arg: str = "y", extra=(), guards=(), edges=(),
                 routed: str | None = None):
        ys, more = ([], []) if outputs is None and edges else as_outputs(outputs, call, arg)
        self.outputs, edges = ys, [*edges, *more]
        self._hooks: list = []
        tops = [(t.grad_fn, t.output_nr) for t in ys] + [(e.node, e.output_nr) for e in edges]
        self._edge_nodes = [e.node for e in edges]
        y_supports = _supports((fn, nr, ALL) for fn, nr in tops)
        # a routed call's keep= is its pruning() block's, which warned of leaves once, as it was entered
        roots = None if keep is None else _keep_roots(keep, call, warn_leaves=routed is None)
        protect_extra = [(t.grad_fn, "the graph of a gradient made with create_graph=True")
                         for t in extra if t is not None and t.grad_fn is not None]
        protected = self._trunk_walk = self._head = None
        if roots is not None and len(roots) == 1 and not protect_extra and not guards:
            fn, nr, _ = roots[0]  # NOTE [ The trunk walked once ] in _trunk.py
            start = _supports([(fn, nr, ALL)] if nr is not None else [])
            self.reach, protected, self._trunk_walk, self._head = walk_trunk_once(
                tops, roots[0], start, y_supports)
        if self._trunk_walk is None:  # no single keep= root, or the walk from y needs the whole graph
            self.reach = reach([fn for fn, _ in tops], supports=y_supports)
        self._routers = y_supports  # the routing nodes the walk met, for arm()
        self._zero_keys: list = []
        earlier: list = []  # finished by an earlier call: the trunk's x, for the hint
        self.finished, pending = _split_live(ys, self.reach, y_supports, earlier)
        self._candidates = _candidates(self.finished, pending, ys, earlier)
        # NOTE [ What a prune pays first ]: the outputs' text, for messages, written when one needs it
        facts = [_outputs.facts(t) for t in ys]
        self._what = functools.partial(_outputs_text, facts, [name(e.node) for e in edges])
        # NOTE [ Outputs made after the block ]: an output no tape recorded, and the live tensors its pass
        # did not reach
        unseen = keep is None and not all(_made_under_a_tape(t, f[2]) for t, f in zip(ys, facts))
        # the tensors the call's outputs are entries of (per_task[0]): its pass ran through all of them
        self.reason = Release(functools.partial(_call_text, call, self._what), self._candidates,
                              routed=routed, passless=call == "graphprune.prune_after", unseen=unseen,
                              entries_of=frozenset(id(t._base) for t in ys if t._base is not None))
        self._losses = losses = [p for p in pending if _may_start_a_pass(*p)] if keep is None else []
        self._unreached = [] if not unseen else [
            (fn, t) for fn, nr, part, t in pending
            if part is ALL and fn not in self.reach and not _may_start_a_pass(fn, nr, part, t)]
        if keep is None:
            protect = [(fn, functools.partial(_pending_text, t, part)) for fn, _, part, t in losses]
            starts = [(fn, nr, part) for fn, nr, part, _ in losses]
        else:
            protect = [(fn, text) for fn, _, text in roots]
            starts = [(fn, nr, ALL) for fn, nr, _ in roots if nr is not None]
        protect += protect_extra
        protect += [(fn, text) for fn, _, text in guards]
        guard_starts = [(fn, nr, ALL) for fn, nr, _ in guards if nr is not None]
        starts += guard_starts
        # what protects besides keep= and the losses (for _held_by_sums): roots, and where they start
        self._guards = [fn for fn, _ in protect_extra] + [fn for fn, _, _ in guards], guard_starts
        order = sorted(range(len(protect)), key=lambda i: protect[i][0] not in self.reach)  # nearest first
        self.protected = protected if protected is not None else reach(
            (protect[i][0] for i in order), through_released=False, supports=_supports(starts)
        )
        self._guard_text = [protect[i][1] for i in order]
        if roots and self._trunk_walk is None and not _meet(self.reach, self.protected):
            warn_at_caller(
                f"{_as_written(call, routed)}: keep= reaches no node of the graph of {self._what()}, its "
                "parameters aside, so it protects nothing this call releases (a tensor of another "
                "forward's graph, an earlier batch's, or one whose graph an earlier prune released). Name "
                "the tensor a later backward pass starts from, or the intermediate it is built on (the "
                "trunk's output x).",
                f"{call}: keep= reaches nothing",  # the text names y's shape: batches differ
            )
        # a pass ran from each output: it is finished unless keep= (or a guard) names it as
        # where a later pass starts, even when another live loss (a held sum) protects it
        self._named = {fn for fn, _, _ in (roots or ())} | {fn for fn, _, _ in guards}
        self.roots = [fn for fn, _ in tops if fn not in self._named]
        self.handles_by_node, self.report_args = self._measure()
        self.report_args["output_ids"] = frozenset(id(fn) for fn, _ in tops)

    def _measure(self) -> tuple[dict, dict]:
        """The branch's live handles by node, and the report's numbers, in one pass over
        the nodes; the trunk's below its root measured once (NOTE [ The trunk walked
        once ] in ``_trunk.py``)."""
        walked = self._trunk_walk
        if walked is None:
            part, trunk = _classify(self.reach, self.protected), None
        else:
            part = _classify(self._head, self.protected)
            trunk = walked.measured(_classify_kept, _FOREIGN_REASON)
        by_node, kept_nodes, kept_by = part.by_node, part.kept_nodes, part.kept_by
        # the protected roots' reasons nearest first, then the kinds graphprune does not hold
        order = sorted({**kept_nodes, **(trunk.counts if trunk else {})}, key=_reason_rank)
        self._kinds = part.kinds | (trunk.kinds if trunk else set())
        foreign = kept_nodes.get(_FOREIGN_REASON, []) + (trunk.foreign if trunk else [])
        self._elsewhere = foreign + kept_nodes.get(_UNTRACKED_REASON, [])  # what graphprune does not hold
        inputs = inputs_of(foreign) if foreign else None  # NOTE [ What a checkpointed region keeps ]
        trunk_leaves = trunk.leaves() if trunk else {}
        owned = _graph_owned([kept_by.values(), by_node.values(), trunk_leaves.values(),
                              [inputs or ()]])  # the branch's are released now
        handles = [h for live in by_node.values() for h in live]
        helds = []  # the kept storages' bytes, by reason
        kept = []
        for key in order:  # every reason, in _reason_rank's order
            nodes = kept_nodes.get(key, ())
            live = list(kept_by.get(key, ()))
            if trunk is not None:
                live += trunk_leaves.get(key, ())
            with_inputs = key == _FOREIGN_REASON and bool(inputs)  # graphprune holds those: measured
            if with_inputs:
                live += inputs
            held = storage_bytes(h for h in live if not h.leaf or id(h.tensor) in owned)
            count, ids = len(nodes), frozenset(map(id, nodes))
            if trunk is not None and key in trunk.counts:
                held = _most_of(trunk.storages[key], held)
                count, ids = count + trunk.counts[key], ids | trunk.ids[key]
            helds.append(held)
            reason = key if type(key) is str else self._guard_reason(key)
            if with_inputs:
                reason += _CHECKPOINT_INPUTS
            unknown = key in (_FOREIGN_REASON, _UNTRACKED_REASON) and not with_inputs
            kept.append(KeptReason(reason, count, None if unknown else sum(held.values()), ids))
        held_bytes = helds[0] if len(helds) == 1 else functools.reduce(_most_of, helds, {})
        branch = storages(handles)
        self._trunk, self._branch = held_bytes, branch
        self._exclusive = exclusive_keys(branch)
        # for warn(), which runs after the release: the branch's handles are gone then
        self._graph_total = self._graph_bytes() if self._losses else None
        released = collections.Counter(map(type, by_node))
        names = collections.Counter()
        for node in by_node:  # a name per node type: name() is a call into C++ and a string split
            if not released:
                break
            kind = type(node)
            if kind in released:
                names[name(node)] += released.pop(kind)
        return by_node, dict(
            released_nodes=dict(names),
            released_tensors=len(handles),
            bytes_freed=sum(branch[key][0] for key in self._exclusive),
            bytes_kept=sum(held_bytes.values()),
            kept=tuple(kept),
            released_ids=frozenset(map(id, by_node)),
        )

    def _graph_bytes(self) -> int:
        """Bytes the pruned graph held before the call: the kept part's and the branch's
        (parameters and inputs aside)."""
        total = dict(self._trunk)
        for key, entry in self._branch.items():
            graph = [h for h in entry[1:] if not h.leaf]
            if not graph:
                continue
            nbytes = entry[0] if len(graph) == len(entry) - 1 else storages(graph)[key][0]
            total[key] = max(nbytes, total.get(key, 0))
        return sum(total.values())

    def warn(self, call: str) -> None:
        """Show :meth:`warning`'s warning, if any (``GraphPruneWarning``, at the user's line)."""
        warning = self.warning(call)
        if warning is not None:
            warn_at_caller(*warning)

    def _made_outside_warning(self, call: str, later: str) -> tuple[str, str] | None:
        """NOTE [ Outputs made after the block ]
        ``keep=None`` protects the live losses the output recorder saw made, under
        ``track()``. An output made after the block (``loss = crit(out)`` below
        ``with``; or a custom ``Function``'s output no tracked call used) is no record's,
        and neither are the losses made beside it: they protect nothing, and a pass from
        one of them frees the graph the others need. So where an output has no record
        and the release cut into the graph of a live tracked tensor its pass did not
        reach (``outs[1]``, which the next loss is computed from), the call warns, and
        names that tensor. Only then is that graph walked: one walk, from those
        tensors."""
        if not self._unreached or not self.handles_by_node:
            return None
        walked = reach([fn for fn, _ in self._unreached])
        first = min((walked[node] for node in self.handles_by_node if node in walked), default=None)
        if first is None:
            return None
        t = self._unreached[first][1]
        return (
            f"{call}: {self._what()} was not made under graphprune.track() (computed after the `with` block, "
            "or a custom autograd.Function's output that no tracked call used), so keep=None cannot see the "
            f"losses made beside it, which protect nothing then: this call released the graph of "
            f"{_tensor_text(t, ALL)}, which its pass did not run through. Compute the losses inside `with "
            f"graphprune.track():`, or name what later passes start from: {later}.",
            f"{call}: made outside track()",
        )

    def untracked_warning(self, call: str) -> tuple[str, str] | None:
        """``(message, kind)`` where this call releases nothing because its graph was
        built outside ``track()``, or ``None``."""
        if (self.handles_by_node or TRACKED in self._kinds or UNTRACKED not in self._kinds
                or self.freed_what_others_held):
            return None
        return (
            f"{call}: nothing can be released: the graph of {self._what()} was built outside "
            "graphprune.track() (or inside it under other saved-tensor hooks that pack a tensor as it "
            "is), so PyTorch holds its saved tensors. Run the forward inside `with graphprune.track():`.",
            f"{call}: built outside track()",
        )

    @walks
    def warning(self, call: str, losses=()) -> tuple[str, str] | None:
        """``(message, kind)`` of the warning this call deserves, or ``None``: it cannot
        free what it is for, as the graph was built outside ``track()``, or it frees
        under 10% of it for a scalar the user holds that is computed from the losses and
        looks like no later loss (NOTE [ What keep=None protects ]). A call that
        ``pruning()`` routed is named as it was written. ``losses``: tensors the call
        backpropagates in later passes (a per-loss helper's), losses whatever they save."""
        later = "keep=[later losses]"
        if self.reason.routed is not None:
            call = _as_written(call, self.reason.routed)
            later = f"graphprune.pruning({later})"
        untracked = self.untracked_warning(call)
        if untracked is not None:
            return untracked
        outside = self._made_outside_warning(call, later)
        if outside is not None:
            return outside
        freed = self.report_args["bytes_freed"]
        if not self._losses:
            return None
        total = self._graph_total
        if total == 0 or freed >= 0.1 * total:
            return None
        held = self._held_by_sums(losses)
        if held is None or held[1] <= freed:
            return None
        names, blocked = held
        some = "; ".join(names[:3]) + (f"; and {len(names) - 3} more" if len(names) > 3 else "")
        return (
            f"{call} freed {format_bytes(freed)} of the {format_bytes(total)} its graph holds: "
            f"{format_bytes(blocked)} stays for live scalars you hold that are computed from the "
            f"losses and that no backward pass has run through: {some}. If no backward pass will "
            "start from them, detach them (t = t.detach()) or del them before this call; or name "
            f"what later passes start from: {later}.",
            f"{call}: held by live sums",
        )

    def _held_by_sums(self, later=()):
        """``(descriptions, bytes)`` of what only the pending losses that have nothing
        of their own protect: a scalar computed from the losses and held (``total = l1
        + l2`` for logging): its graph reaches a loss's node, and saves no tensor and
        reaches no leaf that the pruned graph, the other pending losses and the losses
        a pass has run through (``total`` once ``l1`` ran) do not; ``None`` if nothing.
        ``later``: tensors known to be losses (the call's own)."""
        ours = {id(t) for t in later}
        if all(id(p[3]) in ours for p in self._losses):  # the call's own losses only: no walk
            return None
        walks = [(p, reach([p[0]], through_released=False, supports=_supports([p[:3]])))
                 for p in self._losses]
        sums, losses = [], []
        # what a sum is built on: the pruned outputs, the call's losses (a per-loss helper's trunk
        # pass starts at the cut, where a metric of the feature is built too) or these edges
        tops = [t.grad_fn for t in later if t.grad_fn is not None] if later else self._edge_nodes
        roots = [t.grad_fn for t in self.outputs] + tops + [q[0] for q in self._losses]
        for i, (p, walked) in enumerate(walks):
            others = set().union(*(w for j, (_, w) in enumerate(walks) if j != i))
            ran = [n for n in walked if n is not p[0] and n.metadata.get(FINISHED) is True]
            if ran:  # a finished loss's graph, which a held sum keeps: not the sum's own
                others.update(reach(ran, through_released=False))
            own = [n for n in walked if n not in self.reach and n not in others]
            nothing = not any(is_accumulator(n) or saved(n)[0] for n in own)
            of_losses = any(r is not p[0] and r in walked for r in roots)  # built on losses, not features
            is_sum = nothing and of_losses and id(p[3]) not in ours
            (sums if is_sum else losses).append((p, walked))
        if not sums:
            return None
        kept = set().union(*(w for _, w in losses))  # what stays whatever the sums do: the losses'
        guards, starts = self._guards  # and the guards' (a create_graph=True pass's outputs)
        if guards:
            kept.update(reach(guards, through_released=False, supports=_supports(starts)))
        by_sums = set().union(*(w for _, w in sums))
        blocked = [n for n in self.protected if n in self.reach and n in by_sums and n not in kept]
        if not blocked:
            return None
        culprits = [_tensor_text(p[3], p[2]) for p, walked in sums if not set(blocked).isdisjoint(walked)]
        handles = [h for n in blocked for h in saved(n)[0] if h.tensor is not None and not h.leaf]
        return culprits, unique_bytes(handles)

    def _guard_reason(self, index: int) -> str:
        text = self._guard_text[index]
        if callable(text):
            text = self._guard_text[index] = text()
        return text

    def report(self, call: str, dry_run: bool) -> PruneReport:
        return PruneReport(call=call, dry_run=dry_run, **self.report_args)

    @walks
    def arm(self) -> None:
        """NOTE [ Release during backward ]: each branch node lets its handles go as
        soon as it has run, as ``retain_graph=False`` would; a post-hook, not the
        unpack hook, so a node may read its saved tensors more than once. Only in
        this pass's own graph task: a reentrant pass started by a hook inside it
        (implicit layers) may run the node again."""
        task = [None]
        roots = [t.grad_fn for t in self.outputs] + self._edge_nodes
        zero_only = _zero_only_released(roots, self.reach, self._routers)
        note = functools.partial(_note_task, task, zero_only, self._zero_keys)
        for fn in dict.fromkeys(roots):
            self._hooks.append(fn.register_prehook(note))
        for node, live in self.handles_by_node.items():
            release = functools.partial(_release_after_run, live, self.reason, task)
            self._hooks.append(node.register_hook(release))

    def run(self, pass_fn, ran_only: bool = False, retains: bool = True):
        """``pass_fn()`` with the plan armed, then released (``ran_only``: as
        :meth:`release`); if it raises, abandoned. Returns what it returned.
        ``retains=False``: the pass does not retain the graph, so what it freed of other
        hooks' and PyTorch's is the call's release, not kept (:meth:`_freed_by_the_pass`)."""
        self.arm()
        try:
            result = pass_fn()
        except BaseException:
            self.abandon()
            raise
        self.release(ran_only=ran_only)
        if not retains:
            self._freed_by_the_pass()
        return result

    def holds_a_cycle(self) -> bool:
        """Whether a node that other hooks hold saved its own output as it is, and no
        protected root reaches this plan's graph: a pass that retains it keeps that
        node for good (NOTE [ Outputs saved as they are ])."""
        return self._unprotected_elsewhere() and any(map(saves_its_output, self._elsewhere))

    def _unprotected_elsewhere(self) -> bool:
        """Whether the plan met nodes graphprune does not hold, and no protected root
        reaches its graph."""
        return bool(self._elsewhere) and self._trunk_walk is None and not _meet(self.reach, self.protected)

    def frees_a_cycle_above(self, cut) -> bool:
        """Whether a pass from this plan's outputs that stops at the nodes ``cut`` (a
        head's, where the trunk starts) runs a node that other hooks made hold its own
        output, and no protected root reaches a node it runs: it need not retain the
        graph then, and should not (NOTE [ Outputs saved as they are ])."""
        if not self._elsewhere or self._trunk_walk is not None:
            return False
        cycles = [node for node in self._elsewhere if node not in cut and saves_its_output(node)]
        if not cycles:
            return False
        ran = along_every_edge([t.grad_fn for t in self.outputs], cut)  # torch.stack's zeros too
        return any(node in ran for node in cycles) and not any(
            node in self.protected and not _reruns(node) for node in ran)

    def cycle_warning(self, call: str) -> tuple[str, str] | None:
        """``(message, kind)`` where this call's pass retained a graph that holds such a
        cycle (:meth:`holds_a_cycle`), or ``None``."""
        count = sum(map(saves_its_output, self._elsewhere)) if self._unprotected_elsewhere() else 0
        if not count:
            return None
        return (
            f"{call}: other saved-tensor hooks saved the output of {count} node(s) of the graph of "
            f"{self._what()} as it is (identity or logging saved_tensors_hooks, save_on_cpu of a CPU "
            "tensor): each holds its own grad_fn, a cycle that only a pass that does not retain the graph "
            "breaks, and this pass retained it for what graphprune does not hold, so those tensors stay "
            "alive after the step. If no later pass runs through them, end the step with "
            f"{call}(..., retain_graph=False).",
            f"{call}: outputs saved as they are",
        )

    def _freed_by_the_pass(self) -> None:
        """The nodes graphprune does not hold that a pass without ``retain_graph`` ran:
        PyTorch freed what they saved, so the report lists them as released, not kept
        (their bytes unmeasured, as they were; a reason all of whose nodes went takes
        its measured bytes out of ``bytes_kept``)."""
        freed = [node for node in self._elsewhere if was_freed(node)]
        if not freed:
            return
        self.freed_what_others_held = True  # its pass released what it was for: no warning that it could not
        ids = frozenset(map(id, freed))
        kept, gone = [], 0
        for r in self.report_args["kept"]:
            if r.node_ids & ids:
                left = r.node_ids - ids
                if not left:
                    gone += r.saved_bytes or 0
                    continue
                r = KeptReason(r.reason, len(left), r.saved_bytes, left)
            kept.append(r)
        names = collections.Counter(self.report_args["released_nodes"])
        names.update(name(node) for node in freed)
        self.report_args = dict(self.report_args, kept=tuple(kept), released_nodes=dict(names),
                                released_ids=self.report_args["released_ids"] | ids,
                                bytes_kept=max(0, self.report_args["bytes_kept"] - gone))

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        forget(self._zero_keys)
        self._zero_keys.clear()

    @staticmethod
    def _mark_released(nodes, reason: Release) -> None:
        """Let zero-gradient passes through these nodes; stop protection walks there."""
        marking_released(reason)
        for node in nodes:
            md = node.metadata
            md[RELEASED] = reason
            guard_released(node, reason, md)
        released(nodes)  # NOTE [ The trunk walked once ] in _trunk.py

    @walks
    def release(self, ran_only: bool = False) -> None:
        """Release every branch handle (``ran_only``: mark those of the nodes its pass
        ran, released as they ran); the branch's roots, and the live tensors its pass
        ran through that nothing protects, protect nothing any more."""
        self._disarm()
        if ran_only:
            ran = {n: live for n, live in self.handles_by_node.items() if any(h.released for h in live)}
            self.handles_by_node = ran
            branch = self._branch  # a storage is given back if every handle on it was released
            self.report_args = dict(self.report_args, released_nodes=dict(collections.Counter(
                name(n) for n in ran)), released_tensors=sum(map(len, ran.values())),
                released_ids=frozenset(map(id, ran)), bytes_freed=sum(
                    branch[key][0] for key in self._exclusive if all(h.released for h in branch[key][1:])))
        release_all(itertools.chain.from_iterable(self.handles_by_node.values()), self.reason)
        self._mark_released(self.handles_by_node, self.reason)
        for node in self.roots:
            node.metadata[FINISHED] = True
        for fn, nr, support, _ in self.finished:
            if support is ALL:
                if fn not in self._named:
                    fn.metadata[FINISHED] = True
            else:
                done = fn.metadata.get(FINISHED)
                if done is not True:
                    done = dict(done or {})
                    widen(done, nr, support)
                    fn.metadata[FINISHED] = done

    @walks
    def abandon(self) -> None:
        """The pass raised: keep what it had not used, and say where the rest went."""
        self._disarm()
        reason = Release(f"{self.reason.text}, whose pass raised before it finished", self._candidates,
                         self.reason.note, self.reason.routed, self.reason.entries_of)
        ran = [node for node, live in self.handles_by_node.items() if any(h.released for h in live)]
        for node in ran:
            for h in self.handles_by_node[node]:
                if h.released:
                    h.released_by = reason
        self._mark_released(ran, reason)


def _reason_rank(key) -> tuple:
    """Where a kept reason is listed: a protected root's by its number, then what was
    built outside ``track()``, then what other hooks hold (a checkpointed region's
    inputs with them): one order whichever walk found them."""
    if type(key) is int:
        return 0, key
    return (1, 0) if key == _UNTRACKED_REASON else (2, 0)


def _most_of(a: dict, b: dict) -> dict:
    """``{storage: bytes}`` of both, the most bytes of either for a storage in both; a
    new dict, but ``a`` itself where ``b`` is empty (neither is changed)."""
    if not b:
        return a
    out = dict(a)
    for key, nbytes in b.items():
        if nbytes > out.get(key, 0):
            out[key] = nbytes
    return out


class _Part:
    """What one pass over nodes found: the branch's live handles by node, and the kept
    nodes and their live handles (one list of them) by reason (a protected root's
    number, or the text of a kind that graphprune does not hold)."""

    __slots__ = ("by_node", "kept_nodes", "kept_by", "kinds")

    def __init__(self) -> None:
        self.by_node: dict = {}
        self.kept_nodes: dict = {}
        self.kept_by: dict = {}
        self.kinds: set = set()

    def lists(self, key) -> tuple[list, list]:
        """The kept nodes and the kept handles of reason ``key``, to append to."""
        return self.kept_nodes.setdefault(key, []), self.kept_by.setdefault(key, [])


_BRANCH = object()  # _classify: a node no protected root reaches


def _classify(nodes, protected: dict) -> _Part:
    """Sort ``nodes`` into the branch (a node no protected root reaches, whose tensors
    graphprune holds) and the kept, by reason."""
    part = _Part()
    by_node, kinds = part.by_node, part.kinds
    one_of, reason_of = saves_one.get, protected.get
    tracked = False  # a node saved one of graphprune's handles, seen without kinds.add
    last = _BRANCH  # the last kept reason, and its lists: most runs of nodes share one
    nodes_of = handles_of = None
    for node in nodes:
        node_type = type(node)
        if node_type in saves_nothing:  # most nodes: nothing to measure, only counted if kept
            key = reason_of(node, _BRANCH)
            if key is not _BRANCH:
                if key != last:
                    last, (nodes_of, handles_of) = key, part.lists(key)
                nodes_of.append(node)
            continue
        attr = one_of(node_type)
        p = None  # saved()'s common case, one handle, inline: what the pack hook returned
        if attr is not None:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed by a pass that did not retain the graph
                value = None
            if type(value) is _SavedTensor:
                p = value.data
        if type(p) is SavedHandle:
            live, kind = [p] if p.tensor is not None else NOTHING_SAVED, TRACKED
            tracked = True
        else:
            handles, kind = saved(node)
            if len(handles) == 1:
                live = handles if handles[0].tensor is not None else NOTHING_SAVED
            else:
                live = [h for h in handles if h.tensor is not None]
            if handles or kind is not TRACKED:  # a node that saved nothing: not where it was built
                kinds.add(kind)
        if kind is FOREIGN:
            key = _FOREIGN_REASON
        elif kind is UNTRACKED:
            key = _UNTRACKED_REASON
        else:
            key = reason_of(node, _BRANCH)
            if key is _BRANCH:
                if live:  # no boolean mask released: NOTE [ Masks stay ] in _zero.py
                    if len(live) == 1:
                        t = live[0].tensor  # None: another thread released it since
                        if t is not None and t.dtype is not _BOOL:
                            by_node[node] = live
                    else:  # getattr: a tensor of None is released, read once (a walrus here would
                        # make t a cell variable, slower at every node of the loop)
                        live = [h for h in live if getattr(h.tensor, "dtype", _BOOL) is not _BOOL]
                        if live:
                            by_node[node] = live
                continue
        if key != last:
            last, (nodes_of, handles_of) = key, part.lists(key)
        nodes_of.append(node)
        if live:
            handles_of += live
    if tracked:
        kinds.add(TRACKED)
    return part


def _classify_kept(nodes, key) -> _Part:
    """:func:`_classify` of ``nodes`` that one protected root reaches, all of them
    (a trunk below ``keep=``'s node, whose walk labels every node ``key``): no node is
    the branch's, so only the nodes that save tensors are read, and the kept nodes of
    ``key`` are all the others than the foreign and untracked ones."""
    part = _Part()
    kinds = part.kinds
    one_of = saves_one.get
    tracked = False
    handles_of: list = []
    elsewhere: set = set()  # the nodes kept for their kind, not for key
    for node in [node for node in nodes if type(node) not in saves_nothing]:
        attr = one_of(type(node))
        p = None  # as in _classify
        if attr is not None:
            try:
                value = getattr(node, attr)
            except RuntimeError:
                value = None
            if type(value) is _SavedTensor:
                p = value.data
        if type(p) is SavedHandle:
            tracked = True
            if p.tensor is not None:
                handles_of.append(p)
            continue
        handles, kind = saved(node)
        if handles or kind is not TRACKED:
            kinds.add(kind)
        live = [h for h in handles if h.tensor is not None]
        if kind is TRACKED:
            handles_of += live
            continue
        elsewhere.add(node)
        nodes_of, kind_handles = part.lists(_FOREIGN_REASON if kind is FOREIGN else _UNTRACKED_REASON)
        nodes_of.append(node)
        kind_handles += live
    if tracked:
        kinds.add(TRACKED)
    mine = list(nodes) if not elsewhere else [node for node in nodes if node not in elsewhere]
    if mine:
        part.kept_nodes[key], part.kept_by[key] = mine, handles_of
    return part


def _reruns(node) -> bool:
    """Whether ``node`` runs again after a pass that did not retain the graph ran it: a
    leaf's ``AccumulateGrad``, or a built-in node that saves nothing (two heads unbound
    from one tensor share their ``UnbindBackward0``); a custom ``Function``'s may not."""
    kind = type(node)
    return is_accumulator(node) or (kind in saves_nothing and getattr(kind, "_forward_cls", None) is None)


def _meet(a: dict, b: dict) -> bool:
    """Whether the walks ``a`` and ``b`` share a node other than a leaf's
    ``AccumulateGrad`` (the smaller one read): two forwards through one model share
    those, which save nothing to protect."""
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    return any(node in large and not is_accumulator(node) for node in small)


def _supports(starts) -> dict:
    """Where a walk starts on its routing roots: ``{node: {output number: support}}``
    from ``(node, output number, support)`` triples (other nodes start whole)."""
    out: dict = {}
    for fn, nr, support in starts:
        if _is_router(fn):
            widen(out.setdefault(fn, {}), nr, support)
    return out


def _graph_owned(groups_by_reason) -> set[int]:
    """``id``s of the tensors without a graph (a dropout mask, an RNN workspace: no
    grad, no ``grad_fn``) that nothing but the handles of these groups (lists of
    lists of live handles) holds; parameters and inputs the user holds are not the
    graph's memory."""
    by_tensor: dict[int, list[SavedHandle]] = {}
    for groups in groups_by_reason:
        for live in groups:
            for h in live:
                # no tensor (None): another thread's prune released it since; read with no local
                # name holding it, as held_elsewhere counts its references
                if h.leaf and not getattr(h.tensor, "requires_grad", True):
                    by_tensor.setdefault(id(h.tensor), []).append(h)
    return {key for key, group in by_tensor.items() if not held_elsewhere(group)}


def _may_start_a_pass(fn, nr, part, t: torch.Tensor) -> bool:
    """A loss: a scalar; or losses gathered into one 1-d tensor (a ``stack``, ``cat`` or
    item assignment, or a slice of one), or what is left of them after a pass took
    some (NOTE [ What keep=None protects ]). A ``cat`` gathers losses where it joins one
    entry per input (``torch.cat([l.view(1) for l in losses])``): one of longer vectors
    (``torch.cat([scores_real, scores_fake])``, held for a metric) gathers no losses."""
    if part is not ALL or t.numel() == 1:
        return True
    return t.dim() == 1 and _is_router(fn) and (type(fn).__name__ != "CatBackward0" or (
        len(fn.next_functions) == t.shape[0]))


def _size_along(t: torch.Tensor, support) -> int:
    """``t``'s size along a partial support's dim (0 for ``ALL`` or ``NOTHING``)."""
    return t.shape[support[0]] if support else 0


def _split_live(ys, reached: dict, supports: dict, earlier: list) -> tuple[list, list]:
    """The live tracked tensors (``ys`` aside) as ``(grad_fn, output number, support,
    tensor)``: those the walk from ``ys`` ran through, with the support it took
    (finished there), and those it did not or not wholly, with what is left of
    them (pending); ``earlier`` gets those an earlier call finished that the walk
    reached (what ``keep=`` would have named, for the hint)."""
    finished, pending = [], []
    live = _outputs.live_graphs(ys)
    done_whole = {id(t) for t in ys}
    for fn, t in live:
        done = fn.metadata.get(FINISHED)
        if done is True:
            done_whole.add(id(t))
            if fn in reached:
                earlier.append((fn, t.output_nr, ALL, t))
            continue
        nr = t.output_nr
        if fn not in reached:
            now = NOTHING
        elif fn in supports and (t.dim() == 1 or _is_router(fn)):  # NOTE [ Supports at every node a
            now = supports[fn].get(nr, NOTHING)  # router feeds ] in _graph.py: losses, not logits[:, :-1]
        else:
            now = ALL
        if now is ALL:
            done_whole.add(id(t))
        if now != NOTHING:
            finished.append((fn, nr, now, t))
        before = done.get(nr, NOTHING) if done else NOTHING
        total = merge(before, now)
        left = complement(total, _size_along(t, total))
        if left != NOTHING:
            pending.append((fn, nr, left, t))
    return finished, _one_per_storage(pending, finished, done_whole)


def _one_per_storage(pending: list, finished: list, done_whole: set) -> list:
    """NOTE [ Views of one tensor ]: a view is its base's data under another shape
    (``flat = logits.view(-1)`` for logging). Where the base is finished, so is a
    view of it held besides (moved to ``finished``); where the base is pending too,
    the base alone protects and is named, so one tensor is not listed twice."""
    pending_whole = {id(t) for _, _, part, t in pending if part is ALL}
    out = []
    for entry in pending:
        fn, nr, part, t = entry
        base = t._base if part is ALL else None
        if base is not None and id(base) in done_whole:
            finished.append(entry)
        elif base is None or id(base) not in pending_whole:
            out.append(entry)
    return out


def _tensor_text(t: torch.Tensor, part) -> str:
    """``loss2 (tensor of shape (), ..., created at train.py:31)``: ``part`` of ``t``,
    by the name the user's code has for it where it has one."""
    name = _outputs.name_in_frames(t)
    if name is not None:
        what = index_text(name, part, _size_along(t, part))
    else:
        what = "the live tensor" if part is ALL else "entries of the live tensor"
    return f"{what} ({_outputs.describe(t)})"


def _pending_text(t: torch.Tensor, part) -> str:
    return f"{_tensor_text(t, part)}, not backpropagated through graphprune yet"


_PENDING, _RUN_THROUGH, _EARLIER, _STARTED = 0, 1, 2, 3  # a candidate's rank: the likelier a later
# pass's start first; _EARLIER: an earlier call's pass had run through it


def _candidates(finished: list, pending: list, ys=(), earlier=()) -> list:
    """``(tensor, part, rank)`` of each live tensor a later pass may start from: the
    part that was pending, the whole tensor if this call finished it, or an earlier
    call did (``earlier``: the trunk's x, finished by the first head's call), and the
    call's own outputs last (a second pass from the same loss: gradients by parameter
    group)."""
    out = {id(t): (t, part, _PENDING) for _, _, part, t in pending}
    for _, _, _, t in finished:
        out.setdefault(id(t), (t, ALL, _RUN_THROUGH))
    for _, _, _, t in earlier:
        out.setdefault(id(t), (t, ALL, _EARLIER))
    for t in ys:
        out.setdefault(id(t), (t, ALL, _STARTED))
    return list(out.values())


def _outputs_text(facts: list, edge_names: list) -> str:
    """What a call was given, as its messages name it (``_outputs.facts`` of its
    tensors, the names of its gradient edges' nodes)."""
    return ", ".join([_outputs.described(f) for f in facts] + [f"the gradient into {n}" for n in edge_names])


def _call_text(call: str, what) -> str:
    return f"{call}({what()})"


class Release:
    """Why handles were released: the call, as text (or a callable that writes it,
    called once, when a message first needs it), and the live tensors a later pass
    may have started from, to name in the error that pass meets."""

    # weakly referenced: NOTE [ No node released ]
    __slots__ = ("_text", "_candidates", "note", "routed", "entries_of", "passless", "unseen", "__weakref__")

    def __init__(self, text, candidates: list, note: str | None = None, routed: str | None = None,
                 entries_of: frozenset = frozenset(), passless: bool = False, unseen: bool = False) -> None:
        self._text = text
        self.passless = passless  # a prune_after: no pass of its own, which may have come before the pass
        self.unseen = unseen  # keep=None, an output no tape recorded: NOTE [ Outputs made after the block ]
        self._candidates = [(weakref.ref(t), part, rank) for t, part, rank in candidates]
        self.note = note  # what to do, where keep= cannot help (a lazy head's callable built it)
        self.routed = routed  # the torch call pruning() made this one of, whose code you may not edit
        self.entries_of = entries_of  # ids of the live tensors the call's outputs are views of

    @property
    def text(self) -> str:
        text = self._text
        if not isinstance(text, str):
            text = self._text = text()
        return text

    def __str__(self) -> str:
        if self.routed is None:
            return self.text
        ours, args = self.text.split("(", 1)  # "graphprune.grad(what)": what the routed call was given
        return f"{self.routed}({args} (graphprune.pruning() ran it as {ours})"

    def hint(self, node) -> str | None:
        """What ``keep=`` would have kept ``node``: of the live tensors whose graph
        reaches it, one that no pass had run through (a later pass more likely starts
        there), nearest to it; the call's own outputs last. Where the call's output was
        made after the ``track()`` block, it says so too."""
        hint = self._keep_hint(node)
        if not self.unseen:
            return hint
        return (hint or "Pass keep= what a later pass runs through to that call: a later loss, or the "
                "tensor a later step builds on (h, in a loop's h = cell(x, h)).") + _UNSEEN

    def _keep_hint(self, node) -> str | None:
        if node is None:
            return None
        best = None
        for ref, part, rank in self._candidates:
            t = ref()
            if t is None:
                continue
            found = _part_reaching(t, part, node)
            if found is not None and (best is None or (rank, found[0]) < (best[3], best[0])):
                best = (found[0], t, found[1], rank)
        if best is None:
            return None if self.routed is None else (
                "Open the graphprune.pruning() block with keep= what a later pass runs through: a "
                "later loss, or the tensor a later step builds on (h, in a loop's h = cell(x, h)).")
        _, t, part, rank = best
        name = _outputs.name_in_frames(t, deep=True)
        what = index_text(name or "t", part, _size_along(t, part))
        if name is not None:
            subject, advice = f"{what} ({_outputs.describe(t)})", f"keep={what}"
        else:  # held, but by nothing the nearest frames name: say which tensor, not a wrong name
            subject = f"a tensor that no variable of the nearest frames names ({_outputs.describe(t)})"
            advice = "it as keep=" if what == "t" else f"keep={what}, t that tensor,"
        if self.note is not None:
            return f"The graph of {subject} reaches this node: {self.note}"
        why = {_PENDING: "", _RUN_THROUGH: " (the pass it followed had run through it)",
               _EARLIER: " (an earlier call's pass had run through it)",
               _STARTED: " (that call's own output)"}[rank]
        if rank == _RUN_THROUGH and id(t) in self.entries_of:
            # an entry of losses in a vector (a per-task mean(0)): the pass from per_task[0] ran through it
            why = why[:-1] + (", all of it: only torch.stack, torch.cat, losses[i] = l_i and the entries of "
                              "a 1-d tensor keep track of which entries a pass ran from)")
        where = (f"Pass {advice} to that call" if self.routed is None else
                 f"Open the graphprune.pruning() block with {advice.replace('it as', 'that tensor as')}")
        if rank == _STARTED and self.passless:  # a prune before its output's own pass, or a second pass
            whose = f"{what}'s" if name is not None else "its"
            return (
                f"The graph of {subject} reaches this node, and that call did not keep it{why}. If that "
                f"call came before {whose} backward pass, run the pass first (a prune releases "
                f"what a pass that has run no longer needs); if a later pass starts from it again, "
                f"{where[0].lower()}{where[1:]}."
            )
        several = _ENTRY.fullmatch(what) if name is not None and rank != _PENDING else None
        if several is not None:  # MGDA, GradNorm: a pass through each loss, then one through their sum
            where += f" (or keep={several[1]}, all of them, where a later pass runs through several: a sum)"
        return (
            f"The graph of {subject} reaches this node, and that call did not keep it{why}. "
            f"{where} if a later backward pass starts from it (keep= is a retain_graph for one subgraph)."
        )


_ENTRY = re.compile(r"(.+)\[\d+\]")  # losses[2]: an entry of what the frames call losses


def _made_under_a_tape(t: torch.Tensor, record) -> bool:
    """Whether ``t`` (its record, if any) is one the output recorder saw made, or an
    entry of one (``losses[0]``, taken after the block from losses made in it)."""
    if record is not None and record.ours:
        return True
    base = t._base
    if base is None:
        return False
    ref = _outputs.output_of(base)
    return ref is not None and ref.ours


_UNSEEN = (" That call's output was made after the track() block (or is a custom Function's output no "
           "tracked call used), so keep=None saw no loss made beside it: compute the losses inside `with "
           "graphprune.track():`.")


_HINT_PIECES = 64  # a hint names the entries of a vector that reach a node, of one with at most these


def _part_reaching(t: torch.Tensor, part, node):
    """``(size of the walk, support)`` of what of ``part`` of ``t`` has a graph that
    reaches ``node``, or ``None``."""
    fn = t.grad_fn
    if fn is None:
        return None
    router = _is_router(fn)
    one_by_one = router and part is not ALL and len(part[1]) <= _HINT_PIECES  # a walk per entry
    pieces = [(part[0], frozenset((i,))) for i in sorted(part[1])] if one_by_one else [part]
    hits, size = [], 0
    for piece in pieces:
        walked = reach([fn], supports={fn: {t.output_nr: piece}} if router else None)
        if node in walked:
            hits.append(piece)
            size = max(size, len(walked))
    return (size, functools.reduce(merge, hits)) if hits else None


def _note_task(task: list, zero_only: list, keys: list, grad_outputs) -> None:
    if task[0] is None:
        task[0] = torch._C._current_graph_task_id()
        keys += known_zero(zero_only, task[0])


def _zero_only_released(roots: list, reached: dict, supports: dict) -> list:
    """The released nodes a pass from ``roots`` (reaching ``reached``) runs with zeros
    only: below an edge routing sends no gradient along, and below no other (NOTE
    [ Zeros known without looking ] in ``_zero.py``); none where a node of the pass
    may make a zero gradient non-zero (NOTE [ Zeros that may not stay zeros ])."""
    out: list = []
    seen: set = set()
    stack = [c for node in supports if _is_router(node)  # a node that does not route sends on what it gets
             for c, _ in node.next_functions if c is not None and c not in reached]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if RELEASED in node.metadata:
            out.append(node)
        stack += [c for c, _ in node.next_functions if c is not None and c not in reached and c not in seen]
    if out and _may_make_zeros_nonzero(itertools.chain(roots, reached, seen)):
        return []
    return out


def _may_make_zeros_nonzero(nodes) -> bool:
    """NOTE [ Zeros that may not stay zeros ]
    Routing knows which entries of a stacked loss a pass sends gradients to, and a
    node's backward is linear in its incoming gradient: zeros in, zeros out. A hook
    need not be (``g + noise``, a bias), nor a custom ``Function``'s backward: one on
    the way from the pass's roots to a released node may turn the zeros routing
    promised into a gradient plain PyTorch would send on. So where the pass's graph
    (what it reaches, and the released part routing sends zeros to) holds such a
    node, the pass checks every released node it runs (raising if one gets a
    non-zero gradient), as it does where routing knows nothing: on the CPU at once,
    on a GPU with one wait at the end of the pass. Seen: a node a ``register_hook``
    call under ``track()`` marked, one whose live tensor graphprune knows has hooks,
    a custom ``Function``'s node (a module's backward hooks, a checkpoint, a compiled
    region among them); not seen: a hook on a tensor made after the ``track()`` block,
    or registered outside it on a tensor that has died since, and ``Node`` hooks. On the
    CPU a released node reads its gradients all the same, so what is not seen raises
    there (NOTE [ Zeros read where reading is free ] in ``_zero.py``); on a GPU it
    would give the released node's zeros where plain PyTorch gives the hook's gradient.
    """
    nodes = list(nodes)
    if any(getattr(type(node), "_forward_cls", None) is not None or is_hooked(node) for node in nodes):
        return True
    hooked = _outputs.hooked_nodes()
    return bool(hooked) and not hooked.isdisjoint(nodes)


def _release_after_run(handles: list[SavedHandle], reason: Release, task: list, grad_inputs, grad_outputs):
    """A branch node's post-hook (NOTE [ Release during backward ]): let its handles go
    once its own pass has run it, and guard it then, not when the pass ends: a pass that
    a hook or another thread runs meanwhile (``L[1]`` of stacked losses, while ``L[0]``'s
    runs) sends its zeros through it as through any released node. Its ``RELEASED``
    mark waits for the end of the pass: that pass goes on below it, so a walk made
    meanwhile (the other pass's plan) must go through it to what the pass still needs."""
    if task[0] == torch._C._current_graph_task_id():
        release_all(handles, reason)
        node = torch._C._current_autograd_node()
        if node is not None:
            guard_released(node, reason)
