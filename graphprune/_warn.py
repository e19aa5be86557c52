"""graphprune's warnings, filed at the user's line (the first frame outside graphprune).

Each goes through ``warnings.warn_explicit`` with that frame's module and registry, so
Python's filters apply as to any warning raised there: under the default filter a
call site warns once; ``warnings.filterwarnings("ignore", category=GraphPruneWarning)``
silences them all.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

from .errors import GraphPruneWarning

__all__ = ["warn_at_caller", "is_module_namespace", "warning_namespace", "stands_for", "function_at"]

_OWN_DIR = os.path.dirname(__file__) + os.sep  # not a file of yours beside it: graphprune_demo.py


class _Text(str):
    """A warning's text that Python's registries take as equal to every other of the
    same ``kind``: a message that carries numbers (bytes, a batch's shape) is still
    shown once per call site under the default filter; its text, for filters that
    match it and for what is shown, is the whole message.

    Example::

        >>> _Text("freed 1 B", "freed") == _Text("freed 2 B", "freed")
        True
    """

    def __new__(cls, text: str, kind: str) -> _Text:
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __eq__(self, other) -> bool:
        if type(other) is _Text:
            return self.kind == other.kind
        return str.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.kind)


def warn_at_caller(message: str, kind: str | None = None,
                   category: type[Warning] = GraphPruneWarning) -> None:
    """Warn ``message`` (a :class:`GraphPruneWarning`, or ``category``: PyTorch's own
    warning of an argument graphprune passes on) at the first frame outside
    graphprune; ``kind``: what makes two messages the same warning, where the message
    carries numbers that change from call to call."""
    if kind is not None:
        message = _Text(message, kind)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    where = dict(
        module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )
    try:  # module_globals: the line's source, through the module's loader
        warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                               module_globals=module_globals, **where)
    except Warning:  # a filter made it an error
        raise
    except Exception:  # the loader gives no such line, where plain warn() reads none: `python -c`,
        # stdin (ImportError), code exec'd with a module's globals past its last line (IndexError)
        warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, **where)


def is_module_namespace(namespace: dict) -> bool:
    """Whether ``namespace`` (a frame's globals) is the namespace of a module in
    ``sys.modules``, which lives as long as the program whatever holds it; not the
    globals of ``exec``'d code or a doctest.

    Example::

        >>> is_module_namespace(vars(os)), is_module_namespace({"__name__": "os"})
        (True, False)
    """
    name = namespace.get("__name__")
    module = sys.modules.get(name) if type(name) is str else None
    return module is not None and getattr(module, "__dict__", None) is namespace


_WARNING_KEYS = ("__name__", "__file__", "__loader__", "__spec__", "__builtins__")


def warning_namespace(namespace: dict) -> dict:
    """What a function compiled to stand at a line of a module (NOTE [ Warnings at the
    caller's line ] in ``_tape.py``) needs of the module's ``namespace`` for a warning
    raised under it to be filed as one raised there: the module's name (filters), its
    loader and spec (the source line) and its warning registry, which the module and
    the function then share (made here where the module has none yet). The rest, a
    script's tensors among it, is not held: a namespace that ``runpy`` or a notebook's
    ``%run`` made dies as it would.

    Example::

        >>> ns = warning_namespace(vars(os))
        >>> ns["__name__"], ns["__warningregistry__"] is vars(os)["__warningregistry__"], "path" in ns
        ('os', True, False)
    """
    small = {key: namespace[key] for key in _WARNING_KEYS if key in namespace}
    small["__warningregistry__"] = namespace.setdefault("__warningregistry__", {})
    return small


def stands_for(small: dict, namespace: dict) -> bool:
    """Whether ``small`` is what :func:`warning_namespace` made of ``namespace``."""
    return small.get("__warningregistry__") is namespace.get("__warningregistry__", False)


def function_at(code: types.CodeType, namespace: dict, name: str) -> tuple[types.FunctionType, bool]:
    """A function of ``code`` (compiled to stand at a line of the frame whose globals
    are ``namespace``: NOTE [ Warnings at the caller's line ] in ``_tape.py``), and
    whether it may be kept for that line: in a module's namespace it gets
    :func:`warning_namespace`'s small one, which holds nothing of the module's; in the
    globals of ``exec``'d code (a doctest's) it gets those, and is made per call so
    that they are not kept alive.

    Example::

        >>> code = compile("1", "<site>", "eval")
        >>> [keep for _, keep in (function_at(code, vars(os), "f"), function_at(code, {}, "f"))]
        [True, False]
    """
    if is_module_namespace(namespace):
        return types.FunctionType(code, warning_namespace(namespace), name), True
    return types.FunctionType(code, namespace, name), False
