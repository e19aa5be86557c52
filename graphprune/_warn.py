"""graphprune's warnings, filed at the user's line (the first frame outside graphprune).

Each goes through ``warnings.warn_explicit`` with that frame's module and registry, so
Python's filters apply as to any warning raised there: under the default filter a
call site warns once; ``warnings.filterwarnings("ignore", category=GraphPruneWarning)``
silences them all.
"""

from __future__ import annotations

import os
import sys
import warnings

from .errors import GraphPruneWarning

__all__ = ["warn_at_caller"]

_OWN_DIR = os.path.dirname(__file__)


def warn_at_caller(message: str) -> None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, GraphPruneWarning, stacklevel=2)
        return
    module_globals = frame.f_globals
    where = dict(
        module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )
    try:  # module_globals: the line's source, through the module's loader
        warnings.warn_explicit(message, GraphPruneWarning, frame.f_code.co_filename, frame.f_lineno,
                               module_globals=module_globals, **where)
    except ImportError:  # `python -c`, stdin: __main__'s loader has no source to give
        warnings.warn_explicit(message, GraphPruneWarning, frame.f_code.co_filename, frame.f_lineno, **where)
