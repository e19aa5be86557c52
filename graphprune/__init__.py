"""graphprune: ``retain_graph`` per subgraph.

Keep the autograd graph that leads to a shared tensor, free the branch that a
finished output alone needs::

    with graphprune.track():
        x = trunk(inp)
        y1 = head1(x)
    y1.backward(retain_graph=True)
    graphprune.prune_after(y1)      # y1's branch is freed; x's graph stays
"""

from importlib.metadata import PackageNotFoundError, version

from . import _requires  # noqa: F401  (first: it refuses a torch too old, by name)
from ._each import backward_each, grads_each
from ._prune import backward, explain, grad, last_report, prune_after
from ._pruning import pruning
from ._render import render
from ._report import KeptReason, PruneReport
from ._tape import Tape, track
from ._timeline import Event, Timeline, plot_timeline
from .errors import GraphPruneError, GraphPruneWarning, InplaceModifiedError, ReleasedTensorError

try:
    __version__ = version("graphprune")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "track",
    "Tape",
    "prune_after",
    "explain",
    "backward",
    "grad",
    "backward_each",
    "grads_each",
    "pruning",
    "last_report",
    "PruneReport",
    "KeptReason",
    "render",
    "Timeline",
    "Event",
    "plot_timeline",
    "GraphPruneError",
    "GraphPruneWarning",
    "ReleasedTensorError",
    "InplaceModifiedError",
    "__version__",
]
