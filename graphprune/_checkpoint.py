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

The forward does nothing for this. A report finds a foreign node's region through
the unpack hook checkpoint gave the node's saved tensors (a closure over the
region's ``_CheckpointFrame``), and the region's inputs in ``frame.saved_args``:
``SavedTensor`` objects whose ``.data`` is what graphprune's pack hook returned,
read without unpacking (DESIGN.md fact 13).
"""

from __future__ import annotations

import torch

from ._graph import saved_attributes
from ._marks import STRAYS
from ._saved import SavedHandle

__all__ = ["inputs_of"]

try:
    from torch.utils.checkpoint import _CheckpointFrame
except ImportError:  # another torch: no region to find, nothing counted
    _CheckpointFrame = None

_SavedTensor = torch._C._autograd.SavedTensor


def inputs_of(nodes) -> list[SavedHandle]:
    """The live handles graphprune holds for the inputs of the checkpointed regions
    that built ``nodes`` (foreign nodes; others add nothing)."""
    regions: dict[int, object] = {}
    for node in nodes:
        for region in _regions_of(node):
            regions.setdefault(id(region), region)
    handles: dict[int, SavedHandle] = {}
    for region in regions.values():
        for s in getattr(region, "saved_args", None) or ():
            h = s.data if type(s) is _SavedTensor else None
            if type(h) is SavedHandle and h.tensor is not None:
                handles.setdefault(id(h), h)
    return list(handles.values())


def _regions_of(node):
    """The ``_CheckpointFrame`` objects the unpack hooks of ``node``'s saved tensors close over."""
    if _CheckpointFrame is None:
        return
    for attr in saved_attributes(type(node)):
        if attr is STRAYS:  # a CopySlices: no hooks of its own
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a pass that did not retain the graph
            continue
        for s in value if isinstance(value, (list, tuple)) else (value,):
            if type(s) is not _SavedTensor:
                continue
            for cell in getattr(s.unpack_hook, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(content, _CheckpointFrame):
                    yield content
