"""Which ``nn.Module`` built each node: recorded only under ``track(modules=...)``.

NOTE [ Module names by sequence number ]
Autograd numbers the nodes a thread builds (``node._sequence_nr()``, DESIGN.md fact 4),
and a module call builds the nodes numbered from its start to its end. So a module call
costs one list ``[start, end, name]`` (global forward hooks, installed only while such a
tape is open), and nothing per op: a node's module is the innermost call whose window
holds its number, looked up when a picture asks. The recorders of the last
``KEEP`` tapes that recorded names are kept (bounded: a training loop would otherwise
grow them forever); an older graph is drawn without module names.
"""

from __future__ import annotations

import bisect
import collections
import threading

import torch
from torch.nn.modules import module as _nn_module

__all__ = ["ModuleRecorder", "module_of", "parameter_names"]

KEEP = 16
_recent: collections.deque = collections.deque(maxlen=KEEP)


class ModuleRecorder:
    """The module calls of one tape's thread. ``root`` (an ``nn.Module``) names modules by
    their qualified names in it (``trunk.0``); without it, a module called from no other
    is named by its class (``Sequential``, then ``Sequential#2`` for another one), the
    others by their attribute in their caller (``Sequential#2.0``)."""

    def __init__(self, modules) -> None:
        """``modules``: ``True``, or the root ``nn.Module`` to name modules by."""
        if modules is True:
            root = None
        elif isinstance(modules, torch.nn.Module):
            root = modules
        else:
            raise TypeError(
                f"graphprune.track: modules must be True or an nn.Module, got {type(modules).__name__}"
            )
        self.calls: list[list] = []  # [start, end, name], in start order
        self._starts: list[int] = []
        self._stack: list[tuple[list, object]] = []  # (call, module) of the calls running
        self._thread = None
        self._names = {} if root is None else {id(m): n or type(m).__name__ for n, m in root.named_modules()}
        self._params = {} if root is None else {id(p): n for n, p in root.named_parameters()}
        self._tops: dict[int, str] = {}  # id of a module called from no other -> its name
        self._hooks: list = []

    def start(self) -> None:
        self._thread = threading.get_ident()
        self._hooks = [
            _nn_module.register_module_forward_pre_hook(self._enter),
            _nn_module.register_module_forward_hook(self._exit, always_call=True),
        ]
        _recent.append(self)

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._stack.clear()

    def _enter(self, module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        name = self._names.get(id(module)) or self._child_name(module)
        call = [torch._C._autograd._get_sequence_nr(), None, name]
        self.calls.append(call)
        self._starts.append(call[0])
        self._stack.append((call, module))

    def _exit(self, module, args, output) -> None:
        if threading.get_ident() == self._thread and self._stack:
            self._stack.pop()[0][1] = torch._C._autograd._get_sequence_nr()

    def _child_name(self, module) -> str:
        """``Sequential.0``: the caller's name and the attribute it holds ``module`` by."""
        if not self._stack:  # called from no module: its class, numbered from the second on
            name = self._tops.get(id(module))
            if name is None:
                cls = type(module).__name__
                same = sum(n == cls or n.startswith(cls + "#") for n in self._tops.values())
                name = self._tops[id(module)] = cls if not same else f"{cls}#{same + 1}"
            return name
        (_, _, parent), caller = self._stack[-1]
        attr = next((k for k, m in caller._modules.items() if m is module), None)
        return f"{parent}.{attr or type(module).__name__}"

    def name_of(self, seq: int) -> str | None:
        """The innermost recorded module call whose window holds node number ``seq``:
        walking back from the last call that started before it, the first that had not
        ended (the calls after it that started earlier had ended: they nest)."""
        for i in range(bisect.bisect_right(self._starts, seq) - 1, -1, -1):
            _, end, name = self.calls[i]
            if end is None or seq < end:
                return name
        return None


def module_of(node) -> str | None:
    """The module that built ``node``, if a recent tape recorded module names."""
    if node.name().endswith("AccumulateGrad"):
        return None
    seq = node._sequence_nr()
    for rec in reversed(_recent):
        name = rec.name_of(seq)
        if name is not None:
            return name
    return None


def parameter_names() -> dict[int, str]:
    """``id(parameter) -> qualified name`` from the roots that recent tapes were given."""
    out: dict[int, str] = {}
    for rec in _recent:
        out.update(rec._params)
    return out
