"""The plan of a prune: which nodes ``y`` reaches, which are kept and why, and the
release of the rest (now, or during a backward pass)."""

from __future__ import annotations

import collections
import functools

import torch
from torch.autograd.graph import Node

from ._graph import MODEL, record_of, stamp, walk
from ._report import KeptReason, PruneReport, exclusive_bytes, unique_bytes
from ._saved import SavedHandle
from ._tape import LIVE
from ._zero import guard_released

__all__ = ["Plan", "as_outputs"]


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


class Plan:
    """The partition of the graph behind ``outputs`` into kept and released nodes.

    ``extra`` are tensors protected besides ``keep`` (the gradients a
    ``create_graph=True`` pass made, whose graphs lead back into the branch).
    """

    def __init__(self, call: str, outputs, keep, arg: str = "y", extra=()):
        ys = self.outputs = as_outputs(outputs, call, arg)
        described = ", ".join(LIVE.describe(t) for t in ys)
        self.reason = f"{call}({described})"
        self._hooks: list = []
        self._wrappers: list | None = None
        with MODEL.lock:
            MODEL.purge()
            roots = [stamp(t.grad_fn) for t in ys]
            if keep is None:
                live = LIVE.roots(tuple(ys))
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

    def _saving_wrappers(self) -> list:
        """``(node id, wrapper)`` of the branch nodes that saved something, walked
        once per plan (``arm`` and ``release`` both need them).

        The walk goes through kept nodes too: a branch node may hang below one
        (protection stops at nodes that lost tensors, reachability does not)."""
        if self._wrappers is None:
            saving = self.handles_by_node
            records = ((record_of(node), node) for node in walk(t.grad_fn for t in self.outputs))
            self._wrappers = [(r.id, node) for r, node in records if r is not None and r.id in saving]
        return self._wrappers

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

    def _mark_released(self, node_ids) -> None:
        """Let zero-gradient passes through these nodes; stop protection walks there."""
        node_ids = set(node_ids)
        guard_released(node for n, node in self._saving_wrappers() if n in node_ids)
        with MODEL.lock:
            MODEL.released.update(n for n in node_ids if n in MODEL.graph)

    def release(self) -> None:
        """Release every branch handle; the branch's roots protect nothing any more."""
        self._disarm()
        for live in self.handles_by_node.values():
            for h in live:
                h.release(self.reason)
        self._mark_released(self.handles_by_node)
        with MODEL.lock:
            MODEL.finished.update(n for n in self.roots if n in MODEL.graph)

    def abandon(self) -> None:
        """The pass raised: keep what it had not used, and say where the rest went."""
        self._disarm()
        ran = [n for n, live in self.handles_by_node.items() if any(h.released for h in live)]
        for n in ran:
            for h in self.handles_by_node[n]:
                if h.released:
                    h.released_by = f"{self.reason}, whose pass raised before it finished"
        self._mark_released(ran)


def _note_task(task: list, grad_outputs) -> None:
    if task[0] is None:
        task[0] = torch._C._current_graph_task_id()


def _release_after_run(handles: list[SavedHandle], reason: str, task: list, grad_inputs, grad_outputs):
    if task[0] == torch._C._current_graph_task_id():
        for h in handles:
            h.release(reason)
