"""``python -m graphprune explain script.py [args]``: run a script with tracking on and
say, for each ``prune_after`` / ``backward`` / ``grad`` call, each pass of
``backward_each`` / ``grads_each`` and each call a ``pruning()`` block routes, what it
freed and kept.

NOTE [ How the CLI turns tracking on ]
A script that opens its own ``gp.track()`` says where its forward passes are, and
``keep=None`` depends on it (the live tensors made under a tape protect their graphs),
so its own tapes are left as they are: wrapping the whole run in one more tape would
make tensors it built outside its tapes protect graphs they do not protect in a plain
run. A script with no ``track(`` call in its source runs inside one tape, from its first
line to its last. ``--track all`` / ``--track script`` force either. Either way the CLI
replaces ``graphprune.prune_after``, ``backward``, ``grad``, ``backward_each``,
``grads_each``, ``pruning`` (and, for ``--svg`` or ``--modules``, ``track``, and the
tape a per-loss helper opens for a head a callable builds) in the graphprune module for
the run, the way a profiler does: a script that calls
``gp.backward(...)`` gets the reporting version; a module that imported one of them by
name during a run (``from graphprune import backward``, as ``graphprune.distributed``
does) keeps it, which reports to the run in progress and, outside any, is the function
as it is. Each report is shown as its pass ends
(a pass that ran before a call raised too): a per-loss helper's at the helper's line,
one a pass (``pass 2``); a routed call's at the line that made it (a library's own, for
a library's loop). A call made inside another (a helper in a head's callable) shows its
own reports, once (``_prune.capturing``: the innermost block gets them).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import itertools
import os
import runpy
import sys

import graphprune as gp

from . import _each, _pruning
from ._plan import as_outputs, listed
from ._prune import capturing
from ._report import PruneReport, format_bytes

__all__ = ["main"]

_CALLS = ("prune_after", "backward", "grad")
_EACH = ("backward_each", "grads_each")
_FIRST = {"prune_after": "y", "backward": "tensors", "grad": "outputs",  # the output argument's name
          "backward_each": "losses", "grads_each": "losses"}
_ROUTED_OUTPUT = {"Tensor.backward": "self", "torch.autograd.backward": "tensors",
                  "torch.autograd.grad": "outputs"}
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m graphprune",
        description="See what graphprune frees and keeps, call by call, in your own script.",
        epilog="example: python -m graphprune explain --svg pictures/ train.py --epochs 1",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    ex = sub.add_parser(
        "explain",
        help="run a script with tracking on; print the report of each graphprune call that frees",
        description=(
            "Run SCRIPT (as `python SCRIPT ARGS` would, __name__ == '__main__') and print, for "
            "each graphprune.prune_after / backward / grad call, each pass of backward_each / "
            "grads_each and each call a pruning() block routes, the file:line and its "
            "report: what was freed and what was kept, and why. A script that calls "
            "gp.track() itself keeps its own tapes; one that does not runs inside one tape "
            "(--track)."
        ),
    )
    ex.add_argument("--svg", metavar="DIR",
                    help="write a picture of each call's graph, and the memory timeline, to DIR")
    ex.add_argument("--format", default="svg", choices=("svg", "png", "pdf", "dot"),
                    help="picture format for --svg (default: svg)")
    ex.add_argument("--track", default="auto", choices=("auto", "script", "all"),
                    help="auto: the script's own gp.track() blocks if its source has a track( call, "
                         "else one tape around the whole run (all); script: only its own")
    ex.add_argument("--modules", action="store_true",
                    help="record which nn.Module built each node (labels, grouping in pictures)")
    ex.add_argument("script", help="the Python script to run")
    ex.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.command is None:
        parser.print_help(sys.stderr)
        return 2  # as argparse's own usage errors
    if not os.path.isfile(opts.script):
        parser.error(f"{'a directory, not a script' if os.path.isdir(opts.script) else 'no such script'}: "
                     f"{opts.script}")
    if opts.svg is not None and os.path.exists(opts.svg) and not os.path.isdir(opts.svg):
        parser.error(f"--svg takes a directory to write the pictures into: {opts.svg} is a file")
    whole = opts.track == "all" or (opts.track == "auto" and not _calls_track(opts.script))
    session = Session(opts.svg, opts.format, opts.modules)
    print(f"graphprune explain: running {opts.script} "
          f"({'inside one tape' if whole else 'with its own gp.track() blocks'})", flush=True)
    code = 0
    try:
        with session.patched(), _as_main(opts.script, opts.args):
            tape = gp.track(timeline=session.timeline, modules=opts.modules) if whole else None
            with tape or contextlib.nullcontext():
                runpy.run_path(opts.script, run_name="__main__")
    except SystemExit as exit_:  # the script's sys.exit(): its code is ours
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("message"): Python prints the message and exits with 1
            print(exit_.code, file=sys.stderr, flush=True)
            code = 1
    finally:
        session.summary()
    return code


def _calls_track(script: str) -> bool:
    """Whether the script's source calls something named ``track`` (``gp.track()``)."""
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read(), script)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if getattr(fn, "id", None) == "track" or getattr(fn, "attr", None) == "track":
                return True
    return False


@contextlib.contextmanager
def _as_main(script: str, args: list[str]):
    """``sys.argv`` and ``sys.path[0]`` as ``python script args`` sets them."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


class Session:
    """The calls seen in one run: printed as they happen, pictured in ``svg_dir``."""

    def __init__(self, svg_dir: str | None, fmt: str, modules: bool) -> None:
        self.svg_dir = svg_dir
        self.fmt = fmt
        self.modules = modules
        self.timeline = gp.Timeline("this run") if svg_dir else None
        self.own_timelines: list = []  # the script's own track(timeline=), which record its forwards then
        self.reports: list[PruneReport] = []
        self.calls = 0  # the calls that made a report: a per-loss helper's passes count one
        if svg_dir:
            os.makedirs(svg_dir, exist_ok=True)

    @contextlib.contextmanager
    def patched(self):
        originals = {name: getattr(gp, name) for name in (*_CALLS, *_EACH, "pruning", "track")}
        for name in (*_CALLS, *_EACH):
            setattr(gp, name, _reporting(name, originals[name]))
        gp.pruning = functools.wraps(originals["pruning"])(lambda **options: _ShownPruning(**options))
        heads_track = _each.track  # the tape a per-loss helper opens for a head a callable builds
        if self.timeline is not None or self.modules:
            gp.track = self._track(originals["track"])
            _each.track = self._track(heads_track)
        before, _active[0] = _active[0], self
        try:
            yield
        finally:
            _active[0] = before
            _each.track = heads_track
            for name, fn in originals.items():
                setattr(gp, name, fn)

    def _track(self, track):
        @functools.wraps(track)
        def tracked(*, timeline=None, modules=False):
            if timeline is not None and not any(t is timeline for t in self.own_timelines):
                self.own_timelines.append(timeline)
            return track(timeline=timeline or self.timeline, modules=modules or self.modules)

        return tracked

    def _show(self, name: str, where: str, y, report: PruneReport, detail: str = "",
              counted: bool = True) -> None:
        """Print ``report`` (picture it with ``--svg``); ``counted``: the first report of its call."""
        self.reports.append(report)
        self.calls += counted
        n = len(self.reports)
        head = f"[{n}] graphprune.{name} at {where}" + (f", {detail}" if detail else "")
        lines = [head, *("    " + s for s in str(report).splitlines())]
        if self.timeline is not None:
            self.timeline.mark(f"{name} at {where}" + (f", {detail}" if detail else ""))
        if self.svg_dir:
            lines.append("    picture: " + self._picture(name, where, y, report, head, n))
        print("\n".join(lines), flush=True)

    def _picture(self, name: str, where: str, y, report: PruneReport, head: str, n: int) -> str:
        """Draw the graph of ``y``'s outputs that have one; the path, or why there is none.
        Drawing runs inside the call (between a helper's passes): what it raises is said
        here, never raised into the script."""
        if y is None:
            return "none (the losses are callables: their heads are built and freed inside the call)"
        path = os.path.join(self.svg_dir, f"{n:02d}-{name}-{where.replace(':', '-')}.{self.fmt}")
        try:
            tensors, edges = as_outputs(y, "graphprune explain", "y", leaves=True)
            if not tensors and not edges:
                return "none (no output has a graph: a leaf's pass only writes its .grad)"
            gp.render([*tensors, *edges], path=path, report=report,
                      title=f"{head}: {format_bytes(report.bytes_freed)} freed")
        except Exception as e:  # an observer: the script goes on as it would without the CLI
            return f"none (drawing it failed: {type(e).__name__}: {e})"
        return path

    def _relabelled(self, report: PruneReport, old: PruneReport) -> None:
        """A per-loss helper labelled the report of the pass just shown with its strategy."""
        for i in range(len(self.reports) - 1, -1, -1):
            if self.reports[i] is old:
                self.reports[i] = report
                break
        print(f"      strategy: {report.strategy}", flush=True)  # indented as the report's own lines

    def summary(self) -> None:
        freed = sum(r.bytes_freed for r in self.reports)
        passes = f" ({len(self.reports)} report(s))" if len(self.reports) != self.calls else ""
        text = f"graphprune explain: {self.calls} call(s){passes}, {format_bytes(freed)} freed in all"
        if self.timeline is not None and self.timeline.events:
            path = os.path.join(self.svg_dir, f"timeline.{'svg' if self.fmt == 'dot' else self.fmt}")
            # the run's timeline holds the calls' marks; a block that passed its own timeline recorded
            # its saved tensors there instead: the picture is of those, or the run's would read 0 B
            gp.plot_timeline(self.own_timelines or [self.timeline], path)
            text += f"; memory timeline: {path}" + (" (the script's own timeline)" if len(
                self.own_timelines) == 1 else f" (the script's {len(self.own_timelines)} own timelines)"
                if self.own_timelines else "")
        elif not self.reports:
            text += (" (the script made no prune_after/backward/grad/backward_each/grads_each call, "
                     "and no pruning() block routed one)")
        print(text, flush=True)


_active: list = [None]  # the Session of the run in progress (NOTE [ How the CLI turns tracking on ])


def _where(frame) -> str:
    """``file.py:line`` of the first frame from ``frame`` outwards outside graphprune (a
    call ``graphprune.distributed`` makes is filed at the user's call of it)."""
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    return _line(frame)


def _line(frame) -> str:
    """``file.py:line`` of ``frame``, or ``<unknown>`` for none."""
    return "<unknown>" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _reporting(name: str, call):
    """``call``, showing in the run in progress each report it makes as it makes it: one,
    or one a pass for a per-loss helper (``pass 2``); outside a run, ``call`` as it is
    (a module that imported the function during a run keeps this one)."""
    each = name in _EACH

    @functools.wraps(call)
    def reporting(*args, **kwargs):
        session = _active[0]
        if session is None:
            return call(*args, **kwargs)
        where = _where(sys._getframe(1))
        given = args[0] if args else kwargs.get(_FIRST[name])
        y = listed(given)  # a generator: read here, once, for the call and the pictures
        if y is not given:
            args, kwargs = ((y, *args[1:]), kwargs) if args else (args, {**kwargs, _FIRST[name]: y})
        if each and isinstance(y, (list, tuple)) and any(callable(t) for t in y):
            y = None  # heads a callable builds are built and freed inside the call
        passes = itertools.count(1)
        first = []

        def shown(report, relabels, ran):
            if relabels is not None:
                session._relabelled(report, relabels)
            elif not report.dry_run:  # an explain() in a head's callable says what it says
                detail = "" if not each else f"pass {next(passes)}" if ran else "after the passes"
                session._show(name, where, y, report, detail, counted=not first)
                first.append(report)

        with capturing(shown):
            return call(*args, **kwargs)

    return reporting


class _ShownPruning(_pruning.Pruning):
    """``pruning()``'s block in a run: each routed call's report shown as it is made."""

    def _routed(self, site, call, arguments, run):
        session = _active[0]
        if session is None:
            return super()._routed(site, call, arguments, run)
        where = _line(site)
        first = []

        def shown(report, relabels, ran):
            if relabels is None and not report.dry_run:
                session._show("pruning", where, arguments[_ROUTED_OUTPUT[call]], report, f"routed {call}",
                              counted=not first)
                first.append(report)

        with capturing(shown):
            return super()._routed(site, call, arguments, run)
