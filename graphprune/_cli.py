"""``python -m graphprune explain script.py [args]``: run a script with tracking on and
say, for each ``prune_after`` / ``backward`` / ``grad`` call, what it freed and kept (the
passes of ``backward_each`` / ``grads_each`` and the calls ``pruning()`` routes are not
shown: they call graphprune's passes from inside the library).

NOTE [ How the CLI turns tracking on ]
A script that opens its own ``gp.track()`` says where its forward passes are, and
``keep=None`` depends on it (the live tensors made under a tape protect their graphs),
so its own tapes are left as they are: wrapping the whole run in one more tape would
make tensors it built outside its tapes protect graphs they do not protect in a plain
run. A script with no ``track(`` call in its source runs inside one tape, from its first
line to its last. ``--track all`` / ``--track script`` force either. Either way the CLI
replaces ``graphprune.prune_after``, ``backward``, ``grad`` (and, for ``--timeline`` or
``--modules``, ``track``) in the graphprune module for the run, the way a profiler
does: a script that calls ``gp.backward(...)`` gets the reporting version.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import runpy
import sys

import graphprune as gp

from ._report import PruneReport, format_bytes

__all__ = ["main"]

_CALLS = ("prune_after", "backward", "grad")
_FIRST = {"prune_after": "y", "backward": "tensors", "grad": "outputs"}  # the output argument's name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m graphprune",
        description="See what graphprune frees and keeps, call by call, in your own script.",
        epilog="example: python -m graphprune explain --svg pictures/ train.py --epochs 1",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    ex = sub.add_parser(
        "explain",
        help="run a script with tracking on; print each prune_after/backward/grad call's report",
        description=(
            "Run SCRIPT (as `python SCRIPT ARGS` would, __name__ == '__main__') and print, for "
            "each graphprune.prune_after / backward / grad call, the user's file:line and its "
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
        originals = {name: getattr(gp, name) for name in (*_CALLS, "track")}
        for name in _CALLS:
            setattr(gp, name, self._reporting(name, originals[name]))
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

    def _show(self, name: str, where: str, y, report: PruneReport) -> None:
        self.reports.append(report)
        n = len(self.reports)
        lines = [f"[{n}] graphprune.{name} at {where}", *("    " + s for s in str(report).splitlines())]
        if self.timeline is not None:
            self.timeline.mark(f"{name} at {where}")
        if self.svg_dir:
            path = os.path.join(self.svg_dir, f"{n:02d}-{name}-{where.replace(':', '-')}.{self.fmt}")
            gp.render(y, path=path, report=report, title=f"[{n}] graphprune.{name} at {where}: "
                      f"{format_bytes(report.bytes_freed)} freed")
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
            text += (" (the script made no prune_after/backward/grad call; the passes of "
                     "backward_each/grads_each and the calls pruning() routes are not shown)")
        print(text, flush=True)
