"""``prune_after``, ``explain``, ``backward`` and ``grad``: retain_graph per subgraph."""

from __future__ import annotations

import collections
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
    """The partition of the graph behind ``outputs`` into kept and released nodes."""

    def __init__(self, call: str, outputs, keep, arg: str = "y"):
        ys = self.outputs = _as_outputs(outputs, call, arg)
        described = ", ".join(LIVE.describe(t) for t in ys)
        self.reason = f"{call}({described})"
        with MODEL.lock:
            MODEL.purge()
            roots = [stamp(t.grad_fn) for t in ys]
            if keep is None:
                live = LIVE.roots(tuple(ys))
                guards = [(n, f"still reachable from the live {e.describe()}") for n, e in live]
            else:
                guards = _keep_roots(keep, call)
            self.reach = MODEL.reach(roots)
            guards.sort(key=lambda g: g[0] not in self.reach)  # explain by nearest protector
            self.protected = MODEL.reach((n for n, _ in guards), through_released=False)
            self.guard_text = dict(reversed(guards))
            self.branch = [n for n in self.reach if n not in self.protected]
            self.handles, self.report_args = self._measure()

    def _measure(self) -> tuple[list[SavedHandle], dict]:
        """The branch's live handles, and the report's numbers, in one pass."""
        data = MODEL.graph._node
        released: collections.Counter = collections.Counter()
        handles: list[SavedHandle] = []
        self.saving_nodes = set()
        for n in self.branch:
            live = MODEL.live_handles(n)
            if live:
                released[data[n]["op"]] += 1
                handles += live
                self.saving_nodes.add(n)
        kept_by: dict[str, list[int]] = collections.defaultdict(list)
        for n in self.reach:
            d = data[n]
            if d["foreign"]:
                kept_by["saved under other saved-tensor hooks (checkpoint, save_on_cpu, ...)"].append(n)
            elif d["tape"] is None and not d["op"].endswith("AccumulateGrad"):
                kept_by["built outside graphprune.track(); PyTorch holds its saved tensors"].append(n)
            elif n in self.protected:
                kept_by[self.guard_text[self.protected[n]]].append(n)
        trunk: list[SavedHandle] = []
        kept = []
        for reason, nodes in kept_by.items():
            held = [h for n in nodes for h in MODEL.live_handles(n)]
            trunk += held
            kept.append(KeptReason(reason, len(nodes), unique_bytes(held)))
        return handles, dict(
            released_nodes=dict(released),
            released_tensors=len(handles),
            bytes_freed=exclusive_bytes(handles),
            bytes_kept=unique_bytes(trunk),
            kept=tuple(kept),
        )

    def report(self, call: str, dry_run: bool) -> PruneReport:
        return PruneReport(call=call, dry_run=dry_run, **self.report_args)

    def arm(self) -> None:
        """Let each branch handle go as soon as its node has unpacked it."""
        for h in self.handles:
            h.release_on_unpack = self.reason

    def disarm(self) -> None:
        for h in self.handles:
            h.release_on_unpack = None

    def _saving_wrappers(self):
        """The branch nodes that saved something, walked from the outputs."""
        branch, seen = set(self.branch), set()
        stack = [t.grad_fn for t in self.outputs]
        while stack:
            node = stack.pop()
            rec = record_of(node)
            if rec is None or rec.id not in branch or rec.id in seen:
                continue
            seen.add(rec.id)
            if rec.id in self.saving_nodes:
                yield node
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)

    def release(self) -> None:
        guard_released(self._saving_wrappers())
        for h in self.handles:
            h.release(self.reason)
        with MODEL.lock:
            # The whole branch is finished, not only nodes that saved something: a
            # finished output no longer protects what lies behind it.
            MODEL.released.update(n for n in self.branch if n in MODEL.graph)
        self.handles = []


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
    plan = _Plan("graphprune.backward", tensors, keep, arg="tensors")
    report = plan.report("graphprune.backward", dry_run=False)
    plan.arm()
    try:
        torch.autograd.backward(
            tensors, gradient, retain_graph=True, create_graph=create_graph, inputs=inputs
        )
    except BaseException:
        plan.disarm()
        raise
    plan.release()
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
    plan = _Plan("graphprune.grad", outputs, keep, arg="outputs")
    plan.arm()
    try:
        result = torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph=True,
            create_graph=create_graph,
            allow_unused=allow_unused,
        )
    except BaseException:
        plan.disarm()
        raise
    plan.release()
    return result
