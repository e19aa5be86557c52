"""Python's cyclic garbage collector, paused while graphprune walks a graph.

NOTE [ The collector and the walk ]
Python runs its cyclic collector on allocation counts: a young collection every 700
objects created and not freed, and a full one, over every object of the process
(~100 ms with torch imported, on a 2-core machine), once the objects that survived
the young ones reach a quarter of the old. A tracked forward leaves a handle and a
detached tensor per saved tensor, and a walk wraps every node it reads (a wrapper
and a metadata dict that live as long as the C++ node): a prune of a 10k-node graph
after a 10k-op forward met a full collection on most runs, 100 ms in a call of 60,
for garbage that was none of its own (DESIGN.md fact 14).

Nothing a walk allocates is garbage in a cycle: its temporaries die by reference
count, what it keeps lives as long as the graph. So graphprune pauses the collector
for a walk and what it measures and marks (never for a backward pass or user code),
and turns it back on after, unless it was off already. The collections the walk
would have run happen after it, if the objects they would look at still live by
then; the step-time benchmarks time them wherever they land. ``prune_after`` and
``explain`` keep it paused until their plan (its lists and dicts of nodes and
handles) is dropped, and show their warning after: a young collection that the
forward, the backward or the walk made due then looks at what outlives the call only
(it ran inside ``explain``: 2.3 ms of a 10k-node chain's 40, on the plan's
temporaries too).

One pause at a time for the whole process (the collector is global): nested or
concurrent walks share it, and the last one out turns it back on.

Example::

    >>> import gc
    >>> with paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading

__all__ = ["paused", "walks"]

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was on when the first walk paused it


def _pause() -> None:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1


def _unpause() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and _resume:
            gc.enable()


@contextlib.contextmanager
def paused():
    """The collector off inside the block (NOTE [ The collector and the walk ])."""
    _pause()
    try:
        yield
    finally:
        _unpause()


def walks(method):
    """Run ``method`` with the collector paused: a method that walks a graph (no
    ``contextlib`` generator per call: a prune makes several such calls)."""

    @functools.wraps(method)
    def paused_method(*args, **kwargs):
        _pause()
        try:
            return method(*args, **kwargs)
        finally:
            _unpause()

    return paused_method
