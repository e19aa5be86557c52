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
``grads_each``, ``pruning`` (and, for ``--svg`` or ``--modules``, ``track``) in the
graphprune module for the run, the way a profiler does: a script that calls
``gp.backward(...)`` gets the reporting version. A per-loss helper's passes are shown
when it returns, one report each, at the helper's line; a routed call as it ends, at
the line that made it (a library's own, for a library's loop).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import runpy
import sys

import torch

import graphprune as gp

from . import _pruning
from ._plan import listed
from ._prune import capturing
from ._report import PruneReport, format_bytes

__all__ = ["main"]

_CALLS = ("prune_after", "backward", "grad")
_EACH = ("backward_each", "grads_each")
_FIRST = {"prune_after": "y", "backward": "tensors", "grad": "outputs",  # the output argument's name
          "backward_each": "losses", "grads_each": "losses"}
_ROUTED_OUTPUT = {"Tensor.backward": "self", "torch.autograd.backward": "tensors",
                  "torch.autograd.grad": "outputs"}
_OUTSIDE = (os.path.dirname(os.path.abspath(gp.__file__)) + os.sep,
            os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


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
        parser.print_help()
        return 0
    if not os.path.isfile(opts.script):
        parser.error(f"no such script: {opts.script}")
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
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
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
        self.reports: list[PruneReport] = []
        if svg_dir:
            os.makedirs(svg_dir, exist_ok=True)

    @contextlib.contextmanager
    def patched(self):
        originals = {name: getattr(gp, name) for name in (*_CALLS, *_EACH, "pruning", "track")}
        for name in _CALLS:
            setattr(gp, name, self._reporting(name, originals[name]))
        for name in _EACH:
            setattr(gp, name, self._reporting_each(name, originals[name]))
        gp.pruning = self._pruning(originals["pruning"])
        if self.timeline is not None or self.modules:
            gp.track = self._track(originals["track"])
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(gp, name, fn)

    def _track(self, track):
        @functools.wraps(track)
        def tracked(*, timeline=None, modules=False):
            return track(timeline=timeline or self.timeline, modules=modules or self.modules)

        return tracked

    def _reporting(self, name: str, call):
        @functools.wraps(call)
        def reporting(*args, **kwargs):
            frame = sys._getframe(1)
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            result = call(*args, **kwargs)
            report = result if isinstance(result, PruneReport) else gp.last_report()
            y = args[0] if args else kwargs[_FIRST[name]]
            self._show(name, where, y, report)
            return result

        return reporting

    def _reporting_each(self, name: str, call):
        """``backward_each`` / ``grads_each``, showing each pass's report when it returns."""
        @functools.wraps(call)
        def reporting(*args, **kwargs):
            frame = sys._getframe(1)
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            given = args[0] if args else kwargs.get(_FIRST[name])
            losses = listed(given)  # a generator: read here, once, for the call and the pictures
            if losses is not given:
                args, kwargs = ((losses, *args[1:]), kwargs) if args else (args, {**kwargs, "losses": losses})
            with capturing() as made:
                result = call(*args, **kwargs)
            # backward_each returns its reports; grads_each's are the ones its passes made
            reports = result if name == "backward_each" else [
                r for r in made if r.call == f"graphprune.{name}"]
            y = losses if isinstance(losses, torch.Tensor) or (
                isinstance(losses, (list, tuple)) and not any(callable(t) for t in losses)) else None
            for i, report in enumerate(reports):
                self._show(name, where, y, report, f"pass {i + 1} of {len(reports)}")
            return result

        return reporting

    def _pruning(self, pruning):
        session = self

        class ShownPruning(_pruning.Pruning):
            """The block's mode, showing each routed call's report as the call ends."""

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func not in _pruning._SIGNATURES:
                    return super().__torch_function__(func, types, args, kwargs)
                before = len(self.reports)
                result = super().__torch_function__(func, types, args, kwargs)
                if len(self.reports) > before:
                    frame = _outside_graphprune_and_torch(sys._getframe(1))
                    where = "<unknown>" if frame is None else (
                        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
                    call = ("Tensor.backward" if func is torch.Tensor.backward else
                            f"torch.autograd.{func.__name__}")
                    bound = _pruning._SIGNATURES[func].bind(*args, **(kwargs or {})).arguments
                    for report in self.reports[before:]:
                        session._show("pruning", where, bound[_ROUTED_OUTPUT[call]], report, f"routed {call}")
                return result

        @functools.wraps(pruning)
        def shown(*, keep=None):
            return ShownPruning(keep)

        return shown

    def _show(self, name: str, where: str, y, report: PruneReport, detail: str = "") -> None:
        self.reports.append(report)
        n = len(self.reports)
        head = f"[{n}] graphprune.{name} at {where}" + (f", {detail}" if detail else "")
        lines = [head, *("    " + s for s in str(report).splitlines())]
        if self.timeline is not None:
            self.timeline.mark(f"{name} at {where}")
        if self.svg_dir and y is None:
            lines.append("    picture: none (the losses are callables: their heads are built and freed "
                         "inside the call)")
        elif self.svg_dir:
            path = os.path.join(self.svg_dir, f"{n:02d}-{name}-{where.replace(':', '-')}.{self.fmt}")
            gp.render(y, path=path, report=report, title=f"{head}: {format_bytes(report.bytes_freed)} freed")
            lines.append(f"    picture: {path}")
        print("\n".join(lines), flush=True)

    def summary(self) -> None:
        freed = sum(r.bytes_freed for r in self.reports)
        text = f"graphprune explain: {len(self.reports)} call(s), {format_bytes(freed)} freed in all"
        if self.timeline is not None and self.timeline.events:
            path = os.path.join(self.svg_dir, f"timeline.{'svg' if self.fmt == 'dot' else self.fmt}")
            gp.plot_timeline([self.timeline], path)
            text += f"; memory timeline: {path}"
        elif not self.reports:
            text += (" (the script made no prune_after/backward/grad/backward_each/grads_each call, "
                     "and no pruning() block routed one)")
        print(text, flush=True)


def _outside_graphprune_and_torch(frame):
    """The first frame from ``frame`` outwards whose code is neither graphprune's nor
    torch's: the line that called ``backward`` or ``grad`` (a library's, or the script's)."""
    while frame is not None and frame.f_code.co_filename.startswith(_OUTSIDE):
        frame = frame.f_back
    return frame
