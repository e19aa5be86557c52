"""The inputs of ``checkpoint`` regions, which graphprune holds for their recomputation.

NOTE [ What a checkpointed region keeps ]
``torch.utils.checkpoint(fn, *args, use_reentrant=False)`` keeps no activation of
``fn``: its nodes save holders under checkpoint's own saved-tensor hooks (innermost
wins, so graphprune never sees them: their nodes are "foreign"), and recompute from
``args`` when a pass needs them. ``args`` are saved once per region, through
``_CheckpointFrame.save_inputs`` and *before* checkpoint's hooks are set, so through
graphprune's pack hook: graphprune holds them, outside any node, for as long as the
region's nodes live. A prune cannot free them (the region may be recomputed), but a
report must count them, or they would be held and not said.

The pack hook tells such a save by its caller's code (``save_inputs``, or the list
comprehension in it: one frame lookup per save) and files the handle under the
region's frame object (weakly). A report finds a foreign node's region by the
holders the node saved, which the frame lists (weakly) as it packs them.
"""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._saved import SavedHandle

__all__ = ["CHECKPOINT_CODES", "note_input", "inputs_of"]

try:
    from torch.utils.checkpoint import _CheckpointFrame

    _SAVE_INPUTS = _CheckpointFrame.save_inputs.__code__
    CHECKPOINT_CODES = frozenset(
        [_SAVE_INPUTS, *(c for c in _SAVE_INPUTS.co_consts if isinstance(c, types.CodeType))]
    )
except (ImportError, AttributeError):  # another torch: nothing to tell, nothing counted
    _SAVE_INPUTS = None
    CHECKPOINT_CODES = frozenset()

_inputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # frame -> [SavedHandle]


def note_input(handle: SavedHandle, caller) -> None:
    """File ``handle`` under the checkpoint frame whose ``save_inputs`` (``caller`` or
    its caller) packed it."""
    frame = caller if caller.f_code is _SAVE_INPUTS else caller.f_back
    region = frame.f_locals.get("self") if frame is not None else None
    if region is not None:
        _inputs.setdefault(region, []).append(handle)


def inputs_of(holder_ids: set[int]) -> list[SavedHandle]:
    """The live input handles of the regions that saved one of these holders."""
    out: list[SavedHandle] = []
    if not holder_ids:
        return out
    for region, handles in list(_inputs.items()):
        if any(id(ref()) in holder_ids for ref in region.weak_holders):
            out += [h for h in handles if h.tensor is not None]
    return out
