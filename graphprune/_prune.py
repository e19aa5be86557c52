"""``prune_after``, ``explain``, ``backward`` and ``grad``: retain_graph per subgraph."""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import torch
from torch.autograd.graph import Node

from ._graph import MODEL, record_of, stamp
from ._report import KeptReason, PruneReport, exclusive_bytes, unique_bytes
from ._saved import SavedHandle
from ._tape import LIVE
from ._zero import guard_released

__all__ = ["prune_after", "explain", "backward", "grad"]


def _as_outputs(value, call: str, arg: str) -> list[torch.Tensor]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"{call}: {arg} is empty; pass the tensor(s) whose branch is finished")
    for i, t in enumerate(items):
        name = arg if len(items) == 1 and not isinstance(value, (list, tuple)) else f"{arg}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{call}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.grad_fn is None:
            raise ValueError(
                f"{call}: {name} has no grad_fn (it is a leaf or does not require grad), "
                "so there is no graph behind it to prune"
            )
    return items


def _keep_roots(keep, call: str) -> list[tuple[int, str]]:
    """``(node id, description)`` of each root that ``keep`` protects."""
    items = list(keep) if isinstance(keep, (list, tuple)) else [keep]
    roots = []
    for i, k in enumerate(items):
        name = "keep" if not isinstance(keep, (list, tuple)) else f"keep[{i}]"
        if isinstance(k, torch.Tensor):
            if not k.requires_grad:
                raise ValueError(f"{call}: {name} does not require grad; it has no graph to keep")
            if k.grad_fn is not None:
                roots.append((stamp(k.grad_fn), f"{name}: {LIVE.describe(k)}"))
        elif isinstance(k, Node):
            roots.append((stamp(k), f"{name}: node {k.name()}"))
        else:
            raise TypeError(
                f"{call}: {name} must be a tensor, a grad_fn node or a sequence of them, "
                f"got {type(k).__name__}"
            )
    return roots


class _Plan:
    """The partition of the graph behind ``outputs`` into kept and released nodes.

    ``extra`` are tensors protected besides ``keep`` (the gradients a
    ``create_graph=True`` pass made, whose graphs lead back into the branch).
    """

    def __init__(self, call: str, outputs, keep, arg: str = "y", extra=()):
        ys = self.outputs = _as_outputs(outputs, call, arg)
        described = ", ".join(LIVE.describe(t) for t in ys)
        self.reason = f"{call}({described})"
        self._hooks: list = []
        with MODEL.lock:
            MODEL.purge()
            roots = [stamp(t.grad_fn) for t in ys]
            if keep is None:
                live = [(n, e) for n, e in LIVE.roots(tuple(ys)) if n not in MODEL.finished]
                guards = [(n, f"still reachable from the live {e.describe()}") for n, e in live]
            else:
                guards = _keep_roots(keep, call)
            guards += [(stamp(t.grad_fn), "the graph of a gradient made with create_graph=True")
                       for t in extra if t is not None and t.grad_fn is not None]
            self.reach = MODEL.reach(roots)
            guards.sort(key=lambda g: g[0] not in self.reach)  # explain by nearest protector
            self.protected = MODEL.reach((n for n, _ in guards), through_released=False)
            self.guard_text = dict(reversed(guards))
            self.branch = [n for n in self.reach if n not in self.protected]
            self.roots = [n for n in roots if n not in self.protected]
            self.handles_by_node, self.report_args = self._measure()

    def _measure(self) -> tuple[dict[int, list[SavedHandle]], dict]:
        """The branch's live handles by node, and the report's numbers, in one pass."""
        data = MODEL.graph._node
        released: collections.Counter = collections.Counter()
        by_node: dict[int, list[SavedHandle]] = {}
        for n in self.branch:
            live = MODEL.live_handles(n)
            if live:
                released[data[n]["op"]] += 1
                by_node[n] = live
        kept_by: dict[str, list[int]] = collections.defaultdict(list)
        unknown = set()
        for n in self.reach:
            d = data[n]
            if d["foreign"]:
                reason = "saved under other saved-tensor hooks (checkpoint, save_on_cpu, ...)"
            elif d["tape"] is None and not d["op"].endswith("AccumulateGrad"):
                reason = "built outside graphprune.track(); PyTorch holds its saved tensors"
            elif n in self.protected:
                kept_by[self.guard_text[self.protected[n]]].append(n)
                continue
            else:
                continue
            kept_by[reason].append(n)
            unknown.add(reason)
        trunk: list[SavedHandle] = []
        kept = []
        for reason, nodes in kept_by.items():
            held = [h for n in nodes for h in MODEL.live_handles(n) if not h.leaf]
            trunk += held
            kept.append(KeptReason(reason, len(nodes), None if reason in unknown else unique_bytes(held)))
        handles = [h for live in by_node.values() for h in live]
        return by_node, dict(
            released_nodes=dict(released),
            released_tensors=len(handles),
            bytes_freed=exclusive_bytes(handles),
            bytes_kept=unique_bytes(trunk),
            kept=tuple(kept),
        )

    def report(self, call: str, dry_run: bool) -> PruneReport:
        return PruneReport(call=call, dry_run=dry_run, **self.report_args)

    def _saving_wrappers(self):
        """``(node id, wrapper)`` of the branch nodes that saved something.

        The walk goes through kept nodes too: a branch node may hang below one
        (protection stops at nodes that lost tensors, reachability does not)."""
        seen = set()
        stack = [t.grad_fn for t in self.outputs]
        while stack:
            node = stack.pop()
            rec = record_of(node)
            if rec is None or rec.id in seen:
                continue
            seen.add(rec.id)
            if rec.id in self.handles_by_node:
                yield rec.id, node
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)

    def arm(self) -> None:
        """NOTE [ Release during backward ]: each branch node lets its handles go as
        soon as it has run, as ``retain_graph=False`` would; a post-hook, not the
        unpack hook, so a node may read its saved tensors more than once. Only in
        this pass's own graph task: a reentrant pass started by a hook inside it
        (implicit layers) may run the node again."""
        task = [None]
        note = functools.partial(_note_task, task)
        for t in self.outputs:
            self._hooks.append(t.grad_fn.register_prehook(note))
        for n, node in self._saving_wrappers():
            release = functools.partial(_release_after_run, self.handles_by_node[n], self.reason, task)
            self._hooks.append(node.register_hook(release))

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def release(self) -> None:
        """Release every branch handle; the branch's roots protect nothing any more."""
        self._disarm()
        guard_released(node for _, node in self._saving_wrappers())
        for live in self.handles_by_node.values():
            for h in live:
                h.release(self.reason)
        with MODEL.lock:
            MODEL.released.update(n for n in self.handles_by_node if n in MODEL.graph)
            MODEL.finished.update(n for n in self.roots if n in MODEL.graph)

    def abandon(self) -> None:
        """The pass raised: keep what it had not used, and say where the rest went."""
        self._disarm()
        ran = [n for n, live in self.handles_by_node.items() if any(h.released for h in live)]
        for n in ran:
            for h in self.handles_by_node[n]:
                if h.released:
                    h.released_by = f"{self.reason}, whose pass raised before it finished"
        guard_released(node for n, node in self._saving_wrappers() if n in ran)
        with MODEL.lock:
            MODEL.released.update(n for n in ran if n in MODEL.graph)


def _note_task(task: list, grad_outputs) -> None:
    if task[0] is None:
        task[0] = torch._C._current_graph_task_id()


def _release_after_run(handles: list[SavedHandle], reason: str, task: list, grad_inputs, grad_outputs):
    if task[0] == torch._C._current_graph_task_id():
        for h in handles:
            h.release(reason)


def _leaf_grads(outputs: list[torch.Tensor], inputs) -> list[torch.Tensor]:
    """The ``.grad`` a ``backward`` pass wrote: of ``inputs``, or of every leaf."""
    if inputs is not None:
        leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    else:
        leaves, seen, stack = [], set(), [t.grad_fn for t in outputs]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if hasattr(node, "variable"):
                leaves.append(node.variable)
            stack.extend(fn for fn, _ in node.next_functions)
    return [t.grad for t in leaves if t.grad is not None]


def _run(plan: _Plan, pass_fn):
    """Run ``pass_fn`` (retaining the graph), freeing ``plan``'s branch as it goes."""
    plan.arm()
    try:
        result = pass_fn()
    except BaseException:
        plan.abandon()
        raise
    plan.release()
    return result


def prune_after(y: torch.Tensor | Sequence[torch.Tensor], keep=None) -> PruneReport:
    """Release the saved tensors that only ``y``'s branch of the graph still needs.

    A node's saved tensors are released when ``y`` reaches it and no protected root
    does. ``keep=None`` protects every other tensor created under
    :func:`~graphprune.track` that the program still holds; ``keep=`` (a tensor, a
    ``grad_fn`` node or a sequence of them) protects exactly those. Call it after
    ``y``'s backward pass (``.backward(retain_graph=True)`` or
    ``torch.autograd.grad``); it is idempotent and works after the ``with`` block.

    Args:
        y: the finished output, or a sequence of them.
        keep: what must stay differentiable; ``None`` for every live tracked tensor.

    Returns:
        A :class:`PruneReport` of what was released and kept, and why.

    Raises:
        TypeError: ``y`` or ``keep`` is not a tensor (or node, for ``keep``).
        ValueError: ``y`` has no ``grad_fn``, or a ``keep`` tensor needs no grad.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(4, requires_grad=True)
        >>> with gp.track():
        ...     x = w + 10
        ...     y1 = (x * x).sum()
        >>> y1.backward(retain_graph=True)
        >>> report = gp.prune_after(y1)         # x is alive, so its graph stays
        >>> report.released_nodes
        {'MulBackward0': 1}
        >>> x.sqrt().sum().backward()
        >>> y1.backward()
        Traceback (most recent call last):
        ...
        graphprune.errors.ReleasedTensorError: graphprune: a backward pass needs ... of MulBackward0 ...
    """
    plan = _Plan("graphprune.prune_after", y, keep)
    report = plan.report("graphprune.prune_after", dry_run=False)
    plan.release()
    return report


def explain(y: torch.Tensor | Sequence[torch.Tensor], keep=None) -> PruneReport:
    """What :func:`prune_after` would release and keep, releasing nothing.

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
    return _Plan("graphprune.explain", y, keep).report("graphprune.explain", dry_run=True)


def backward(tensors, gradient=None, keep=None, inputs=None, create_graph: bool = False) -> PruneReport:
    """``torch.autograd.backward`` that retains the trunk and frees the branch as it goes.

    The pass runs with ``retain_graph=True``; each saved tensor only the branch
    needs is let go as soon as its node has used it, as ``retain_graph=False`` would,
    so the peak is that of a plain pass on the branch. Branch nodes the pass does
    not run (``inputs=`` stops it) are released when it ends. If the pass raises,
    what it had not used yet is kept.

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
    if create_graph:  # the gradients' graphs lead back into the branch: prune after
        outputs = _as_outputs(tensors, call, "tensors")
        torch.autograd.backward(tensors, gradient, retain_graph=True, create_graph=True, inputs=inputs)
        plan = _Plan(call, tensors, keep, arg="tensors", extra=_leaf_grads(outputs, inputs))
        plan.release()
        return plan.report(call, dry_run=False)
    plan = _Plan(call, tensors, keep, arg="tensors")
    report = plan.report(call, dry_run=False)
    _run(plan, lambda: torch.autograd.backward(tensors, gradient, retain_graph=True, inputs=inputs))
    return report


def grad(outputs, inputs, grad_outputs=None, keep=None, create_graph: bool = False, allow_unused=None):
    """``torch.autograd.grad`` with the trunk retained and the branch freed as it goes.

    Returns what ``torch.autograd.grad`` returns; see :func:`backward`.

    Example::

        >>> import torch, graphprune as gp
        >>> w = torch.ones(2, requires_grad=True)
        >>> with gp.track():
        ...     x = w * 3
        ...     y1 = (x * x).sum()
        >>> gp.grad(y1, w, keep=x)
        (tensor([18., 18.]),)
    """
    def pass_fn():
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph=True,
            create_graph=create_graph,
            allow_unused=allow_unused,
        )

    if create_graph:
        _as_outputs(outputs, "graphprune.grad", "outputs")
        result = pass_fn()
        _Plan("graphprune.grad", outputs, keep, arg="outputs", extra=result).release()
        return result
    return _run(_Plan("graphprune.grad", outputs, keep, arg="outputs"), pass_fn)
