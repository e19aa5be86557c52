"""The plan of a prune: which nodes ``y`` reaches, which are kept and why, and the
release of the rest (now, or during a backward pass)."""

from __future__ import annotations

import collections
import functools

import torch
from torch.autograd.graph import Node

from . import _outputs
from ._graph import FOREIGN, UNTRACKED, name, reach, saved
from ._marks import FINISHED, RELEASED
from ._outputs import live_roots
from ._report import KeptReason, PruneReport, exclusive_bytes, unique_bytes
from ._saved import SavedHandle
from ._zero import guard_released

__all__ = ["Plan", "as_outputs"]

_FOREIGN_REASON = "saved under other saved-tensor hooks (checkpoint, save_on_cpu, ...)"
_UNTRACKED_REASON = (
    "built outside graphprune.track() (or under saved-tensor hooks that keep tensors); "
    "PyTorch or those hooks hold its saved tensors"
)


def as_outputs(value, call: str, arg: str) -> list[torch.Tensor]:
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


def _keep_roots(keep, call: str) -> list[tuple[Node, str]]:
    """``(node, description)`` of each root that ``keep`` protects."""
    items = list(keep) if isinstance(keep, (list, tuple)) else [keep]
    roots = []
    for i, k in enumerate(items):
        name = "keep" if not isinstance(keep, (list, tuple)) else f"keep[{i}]"
        if isinstance(k, torch.Tensor):
            if not k.requires_grad:
                raise ValueError(f"{call}: {name} does not require grad; it has no graph to keep")
            if k.grad_fn is not None:
                roots.append((k.grad_fn, f"{name}: {_outputs.describe(k)}"))
        elif isinstance(k, Node):
            roots.append((k, f"{name}: node {k.name()}"))
        else:
            raise TypeError(
                f"{call}: {name} must be a tensor, a grad_fn node or a sequence of them, "
                f"got {type(k).__name__}"
            )
    return roots


class Plan:
    """The partition of the graph behind ``outputs`` into kept and released nodes.

    ``extra`` are tensors protected besides ``keep`` (the gradients a
    ``create_graph=True`` pass made, whose graphs lead back into the branch).
    """

    def __init__(self, call: str, outputs, keep, arg: str = "y", extra=()):
        ys = self.outputs = as_outputs(outputs, call, arg)
        self.reason = f"{call}({', '.join(_outputs.describe(t) for t in ys)})"
        self._hooks: list = []
        guards = live_roots(ys) if keep is None else _keep_roots(keep, call)
        guards += [(t.grad_fn, "the graph of a gradient made with create_graph=True")
                   for t in extra if t is not None and t.grad_fn is not None]
        self.reach = reach([t.grad_fn for t in ys])
        guards.sort(key=lambda g: g[0] not in self.reach)  # explain by nearest protector
        self.protected = reach((node for node, _ in guards), through_released=False)
        self._guard_text = [text for _, text in guards]
        self.roots = [t.grad_fn for t in ys if t.grad_fn not in self.protected]
        self.handles_by_node, self.report_args = self._measure()

    def _measure(self) -> tuple[dict, dict]:
        """The branch's live handles by node, and the report's numbers, in one pass."""
        released: collections.Counter = collections.Counter()
        by_node: dict = {}
        kept_by: dict[str, list[list[SavedHandle]]] = collections.defaultdict(list)
        for node in self.reach:
            handles, kind = saved(node)
            live = [h for h in handles if h.tensor is not None]
            if kind == FOREIGN:
                reason = _FOREIGN_REASON
            elif kind == UNTRACKED:
                reason = _UNTRACKED_REASON
            elif node in self.protected:
                reason = self._guard_reason(self.protected[node])
            else:
                if live:
                    released[name(node)] += 1
                    by_node[node] = live
                continue
            kept_by[reason].append(live)
        trunk = []
        kept = []
        spans: dict = {}
        for reason, groups in kept_by.items():
            held = [h for live in groups for h in live if not h.leaf]
            trunk += held
            unknown = reason in (_FOREIGN_REASON, _UNTRACKED_REASON)  # not graphprune's handles
            kept.append(KeptReason(reason, len(groups), None if unknown else unique_bytes(held, spans)))
        handles = [h for live in by_node.values() for h in live]
        return by_node, dict(
            released_nodes=dict(released),
            released_tensors=len(handles),
            bytes_freed=exclusive_bytes(handles),
            bytes_kept=unique_bytes(trunk, spans),
            kept=tuple(kept),
        )

    def _guard_reason(self, index: int) -> str:
        text = self._guard_text[index]
        if callable(text):
            text = self._guard_text[index] = text()
        return text

    def report(self, call: str, dry_run: bool) -> PruneReport:
        return PruneReport(call=call, dry_run=dry_run, **self.report_args)

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
        for node, live in self.handles_by_node.items():
            release = functools.partial(_release_after_run, live, self.reason, task)
            self._hooks.append(node.register_hook(release))

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @staticmethod
    def _mark_released(nodes, reason: str) -> None:
        """Let zero-gradient passes through these nodes; stop protection walks there."""
        for node in nodes:
            node.metadata[RELEASED] = reason
            guard_released(node)

    def release(self) -> None:
        """Release every branch handle; the branch's roots protect nothing any more."""
        self._disarm()
        for live in self.handles_by_node.values():
            for h in live:
                h.release(self.reason)
        self._mark_released(self.handles_by_node, self.reason)
        for node in self.roots:
            node.metadata[FINISHED] = True

    def abandon(self) -> None:
        """The pass raised: keep what it had not used, and say where the rest went."""
        self._disarm()
        reason = f"{self.reason}, whose pass raised before it finished"
        ran = [node for node, live in self.handles_by_node.items() if any(h.released for h in live)]
        for node in ran:
            for h in self.handles_by_node[node]:
                if h.released:
                    h.released_by = reason
        self._mark_released(ran, reason)


def _note_task(task: list, grad_outputs) -> None:
    if task[0] is None:
        task[0] = torch._C._current_graph_task_id()


def _release_after_run(handles: list[SavedHandle], reason: str, task: list, grad_inputs, grad_outputs):
    if task[0] == torch._C._current_graph_task_id():
        for h in handles:
            h.release(reason)
