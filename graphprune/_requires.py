"""The torch graphprune runs on, checked once at import.

Two behaviours of torch 2.13 that graphprune is built on, which older releases lack:

- ``node._raw_saved_<name>.data`` gives back the object a pack hook returned, without
  calling the unpack hook (DESIGN.md fact 13): how a prune finds its handles. No
  ``SavedTensor.data`` before 2.10.
- A ``grad_fn`` wrapper, once made, is kept by its C++ node (DESIGN.md fact 12), so a
  node is the same Python object on every walk: what reports' node ids, the marks
  and the walks left on a trunk rely on. Before 2.13 a node whose wrapper nothing in
  Python holds gets a new one at its next read. The test suite fails 17 tests on
  2.10.0 and 14 on 2.12.1, among them a prune that released a trunk it was told to
  keep (2.10) and a zero-gradient pass that met a released tensor (2.12), both
  raising where plain PyTorch does not.

So the import fails on an older torch, naming the release it needs, rather than
letting a prune fail later where plain PyTorch does not.
"""

from __future__ import annotations

import re

import torch

__all__ = ["require_torch", "MIN_TORCH"]

MIN_TORCH = (2, 13)


def require_torch(found: str = torch.__version__) -> None:
    """Raise ``ImportError`` where torch ``found`` (a version string) is older than
    :data:`MIN_TORCH`; a pre-release or source build of 2.13 is taken as 2.13.

    Example::

        >>> require_torch()  # this torch
        >>> require_torch("2.12.1+cu130")
        Traceback (most recent call last):
        ...
        ImportError: graphprune needs torch>=2.13, and this is torch 2.12.1+cu130: ...
    """
    release = re.match(r"(\d+)\.(\d+)", found)
    if release is not None and tuple(map(int, release.groups())) >= MIN_TORCH:
        return
    need = ".".join(map(str, MIN_TORCH))
    raise ImportError(
        f"graphprune needs torch>={need}, and this is torch {found}: it reads what its saved-tensor "
        "hook packed back from the graph's nodes, and knows a node by its Python object, which "
        f"an older torch makes anew at every read. pip install 'torch>={need}'"
    )


require_torch()
