"""The handle a pack hook returns in place of a saved tensor.

With saved-tensor hooks set, a ``SavedVariable`` keeps no data of its own: it keeps
the object the pack hook returned. graphprune returns a :class:`SavedHandle`, so
dropping the handle's tensor frees the storage (unless something else still uses
it) while the autograd node stays intact.
"""

from __future__ import annotations

import torch

from ._zero import in_zero_pass, placeholder
from .errors import InplaceModifiedError, ReleasedTensorError

__all__ = ["SavedHandle", "storage_of"]


def storage_of(t: torch.Tensor) -> tuple[tuple, int]:
    """Return ``(key, nbytes)`` of the storage behind ``t``; the key is unique while it lives."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional tensors
        return ("tensor", id(t)), t.numel() * t.element_size()


class SavedHandle:
    """One saved tensor of one autograd node, as graphprune holds it.

    ``tensor`` is ``t.detach()``, never ``t`` itself: the live tensor carries its
    ``grad_fn``, and for saved outputs that is a reference cycle through C++ that
    ``gc`` cannot break (DESIGN.md fact 2).
    """

    __slots__ = (
        "tensor",
        "version",
        "seq",
        "tape_id",
        "node_name",
        "storage_key",
        "nbytes",
        "released_by",
        "meta",
        "leaf",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor, seq: int, tape_id: int):
        self.tensor: torch.Tensor | None = t.detach()
        self.version = t._version
        self.seq = seq
        self.tape_id = tape_id
        self.node_name: str | None = None
        self.storage_key, self.nbytes = storage_of(t)
        self.released_by: str | None = None
        self.meta: tuple | None = None  # shape, dtype, device of a released tensor
        self.leaf = t.is_leaf  # a parameter or input: pruning never frees its storage

    @property
    def released(self) -> bool:
        return self.tensor is None

    def release(self, reason: str) -> None:
        """Drop the tensor; a later unpack raises :class:`ReleasedTensorError` naming ``reason``."""
        t = self.tensor
        if t is not None:
            self.meta = (t.shape, t.dtype, t.device)
            self.tensor = None
            self.released_by = reason

    def unpack(self) -> torch.Tensor:
        """Return the saved tensor for a backward pass, checking what PyTorch skips with hooks."""
        t = self.tensor
        if t is None:
            if in_zero_pass():  # NOTE [ Zero-gradient passes through released nodes ]
                return placeholder(*self.meta)
            raise ReleasedTensorError(self._released_message())
        if t._version != self.version:
            raise InplaceModifiedError(self._inplace_message(t))
        return t

    def _name(self) -> str:
        if self.node_name is not None:
            return self.node_name
        node = torch._C._current_autograd_node()
        return node.name() if node is not None else "an autograd node"

    def _released_message(self) -> str:
        return (
            f"graphprune: a backward pass needs a saved tensor of {self._name()} that was "
            f"released by {self.released_by}. Pass keep=<the tensor you backpropagate later> "
            "to that call, or run this backward before pruning."
        )

    def _inplace_message(self, t: torch.Tensor) -> str:
        return (
            "graphprune: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation: [{t.type()} {list(t.shape)}], saved by "
            f"{self._name()}, is at version {t._version}; expected version {self.version} "
            "instead. Hint: PyTorch skips this check while saved-tensor hooks are set; "
            "graphprune restores it. Clone the tensor before modifying it in place."
        )
