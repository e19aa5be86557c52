"""The handle a pack hook returns in place of a saved tensor.

With saved-tensor hooks set, a ``SavedVariable`` keeps no data of its own: it keeps
the object the pack hook returned. graphprune returns a :class:`SavedHandle`, so
dropping the handle's tensor frees the storage (unless something else still uses
it) while the autograd node stays intact.

NOTE [ What the forward pays ]
The pack hook runs once per saved tensor of every op of every forward, so a handle
is one small object and nothing else: the tensor, its version, the tape and whether
it is a parameter. Which node owns it, its storage and its size are found at prune
time (``_graph.saved`` reads ``node._raw_saved_*``), never in the forward. The hook
is one closure per tape (no ``functools.partial``, no second call) and reads no
frame: a checkpointed region's inputs are found from the region when a report asks
(NOTE [ What a checkpointed region keeps ] in ``_checkpoint.py``).
"""

from __future__ import annotations

import torch

from ._marks import node_name
from ._zero import in_zero_pass, placeholder
from .errors import InplaceModifiedError, ReleasedTensorError, released_message

__all__ = ["SavedHandle", "pack_hook", "release_all", "storage_of"]


def storage_of(h: SavedHandle) -> tuple[int, int]:
    """Return ``(key, nbytes)`` of the storage behind a live handle's tensor; the key
    is the storage's address, unique while it lives (for a tensor without one, sparse
    or nested, minus the tensor's ``id``).

    A tensor that is no view owns its storage, whose bytes are those it spans; only a
    view asks ``untyped_storage()``, whose Python object the storage then keeps alive
    for as long as it lives: one more object for the garbage collector to walk
    (DESIGN.md fact 14), not worth paying for every saved tensor.
    """
    t = h.tensor
    try:
        if h.view:
            return torch._C._storage_address(t), t.untyped_storage().nbytes()
        if t.is_contiguous():
            return torch._C._storage_address(t), t.storage_offset() * t.element_size() + t.nbytes
        span = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        return torch._C._storage_address(t), (span if t.numel() else 0) * t.element_size()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional tensors
        return -id(t), _unstrided_bytes(t)  # negative: no storage address


def _unstrided_bytes(t: torch.Tensor) -> int:
    """What a tensor without one storage holds: a sparse tensor's indices and values,
    others (nested, functional) their elements."""
    layout = t.layout
    if layout is torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return t.numel() * t.element_size()
    return sum(p.numel() * p.element_size() for p in parts)


class SavedHandle:
    """One saved tensor of one autograd node, as graphprune holds it.

    ``tensor`` is ``t.detach()``, never ``t`` itself: the live tensor carries its
    ``grad_fn``, and for saved outputs that is a reference cycle through C++ that
    ``gc`` cannot break (DESIGN.md fact 2). A leaf (a parameter, an input, a mask)
    has no ``grad_fn``, so it is held as it is: no new object in the forward. ``leaf``
    is also true of a view of a leaf (``weight.t()``): its storage is the leaf's.
    """

    __slots__ = ("tensor", "version", "tape", "leaf", "view", "released_by", "meta", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int, tape: int, leaf: bool, view: bool):
        self.tensor: torch.Tensor | None = tensor
        self.version = version
        self.tape = tape
        self.leaf = leaf  # a parameter or an input: pruning never frees its storage
        self.view = view  # of a storage that may be larger than what it spans

    @property
    def released(self) -> bool:
        return self.tensor is None

    def release(self, reason: str) -> None:
        """Drop the tensor; a later unpack raises :class:`ReleasedTensorError` naming ``reason``."""
        release_all((self,), reason)

    def unpack(self) -> torch.Tensor:
        """Return the saved tensor for a backward pass, checking what PyTorch skips with hooks."""
        t = self.tensor
        if t is None:
            node = torch._C._current_autograd_node()
            if node is not None and in_zero_pass(node) and self.meta[0] is not None:
                return placeholder(*self.meta, node)  # NOTE [ Zero-gradient passes through released nodes ]
            raise ReleasedTensorError(released_message(node, self.released_by))
        if t._version != self.version:
            raise InplaceModifiedError(self._inplace_message(t))
        return t

    def _inplace_message(self, t: torch.Tensor) -> str:
        fix = ("It is a parameter or an input (or a view of one), updated in place: an optimizer.step() "
               "between two backward passes of one graph does that; run every backward pass of the step "
               "before the optimizer's step (an input: clone it before modifying it in place)."
               if self.leaf else "Clone the tensor before modifying it in place.")
        return (
            "graphprune: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation: [{_describe(t)}], saved by "
            f"{node_name(torch._C._current_autograd_node())}, is at version {t._version}; "
            f"expected version {self.version} instead. Hint: PyTorch skips this check while "
            f"saved-tensor hooks are set; graphprune restores it. {fix}"
        )


def release_all(handles, reason) -> None:
    """:meth:`SavedHandle.release` of each of ``handles``, in one call: a prune releases
    a handle per saved tensor of its branch.

    Example::

        >>> h = pack_hook(7)(torch.ones(2, requires_grad=True) * 2)
        >>> release_all([h], "a prune")
        >>> h.released, h.meta[0]
        (True, torch.Size([2]))
    """
    for h in handles:
        t = h.tensor
        if t is not None:
            try:
                shape = t.shape  # a torch.Size: a tuple of ints
            except RuntimeError:  # a strided nested tensor has no single shape
                shape = None
            h.meta = (shape, t.dtype, t.device)
            h.tensor = None  # is no object for the garbage collector to walk
            h.released_by = reason


def pack_hook(tape: int):
    """The pack hook of tape number ``tape``: ``t`` -> its :class:`SavedHandle`.

    Example::

        >>> import torch
        >>> h = pack_hook(7)(torch.ones(2, requires_grad=True) * 2)
        >>> h.tape, h.leaf, h.tensor.grad_fn is None
        (7, False, True)
    """

    def pack(t: torch.Tensor) -> SavedHandle:  # NOTE [ What the forward pays ]
        kind = type(t)
        if kind is not _Tensor and kind is not _Parameter:  # NOTE [ Reads no mode sees ]
            return _subclass_handle(t, tape)
        if _modes_on():
            with _NoTorchFunction():
                return _handle(t, tape)
        if t.is_leaf:
            return SavedHandle(t, t._version, tape, True, t._is_view())
        if t._is_view():  # of a parameter (``weight.t()``, a linear layer's) or of an activation
            return SavedHandle(t.detach(), t._version, tape, t._base.is_leaf, True)
        return SavedHandle(t.detach(), t._version, tape, False, False)

    pack.__graphprune__ = True
    return pack


def _handle(t: torch.Tensor, tape: int) -> SavedHandle:
    if t.is_leaf:
        return SavedHandle(t, t._version, tape, True, t._is_view())
    if t._is_view():
        return SavedHandle(t.detach(), t._version, tape, t._base.is_leaf, True)
    return SavedHandle(t.detach(), t._version, tape, False, False)


def _subclass_handle(t: torch.Tensor, tape: int) -> SavedHandle:
    with _NoTorchFunction():
        leaf, version, view = t.is_leaf, t._version, t._is_view()
        of_a_leaf = view and not leaf and t._base.is_leaf
    if leaf:
        return SavedHandle(t, version, tape, True, view)
    return SavedHandle(t.detach(), version, tape, of_a_leaf, view)


# NOTE [ Reads no mode sees ]
# Inside a torch call the pack hook runs with the recorder off and no other mode on,
# unless the user entered one outside ``track()``; a custom ``Function``'s
# ``save_for_backward`` packs outside any torch call, the recorder on. There, the
# hook's reads (``is_leaf``, ``detach``, ``_is_view``) would reach the modes as calls
# the program never made: they run with torch-function dispatch off (one check per
# saved tensor otherwise). A subclass's tensor is read so too (its ``__torch_function__``
# sees no ``is_leaf`` or ``_version`` that the program did not ask), but detached
# through it: its ``detach`` keeps its type (and what it carries) for the backward.
_modes_on = torch._C._len_torch_function_stack  # how many torch-function modes are on now
_NoTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # a subclass whose __torch_function__ is torch's own, disabled


def _describe(t: torch.Tensor) -> str:
    """``torch.FloatTensor [2, 3]`` as PyTorch's own message writes it; nested tensors
    have no single shape, and PyTorch's message names only their type."""
    if t.is_nested:
        return f"{t.type()} (nested)"
    return f"{t.type()} {list(t.shape)}"
