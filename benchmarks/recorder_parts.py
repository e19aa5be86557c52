"""Where the forward's tracking cost goes on the small transformer (no target, a
diagnostic): the forward of ``overhead.py``'s transformer under

* ``plain``     -- nothing;
* ``floor``     -- a no-op ``TorchFunctionMode`` and a pack hook that detaches (``_lean``);
* ``pack``      -- the no-op mode and graphprune's pack hook (a handle per saved tensor);
* ``call_site`` -- graphprune's call-site machinery only (the frame read, the call made
  at the caller's line: NOTE [ Warnings at the caller's line ] in ``_tape.py``), the
  detaching pack hook;
* ``recorder``  -- graphprune's output recorder (the call site and the outputs' records),
  the detaching pack hook;
* ``track``     -- ``graphprune.track()``.

Each round runs every variant once, in a shuffled order, timed by the process's CPU
time (``time.process_time``: less moved by other processes than the wall clock on a
shared machine); the table gives each variant's median and its excess over the floor
per torch call the mode sees.  ``python -m benchmarks.recorder_parts [--rounds N]``
(about 30 s at 200 rounds on 2 cores).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

import graphprune as gp
from graphprune import _outputs, _saved, _tape

from .overhead import SIZES, _detach, _identity, _Model, _NoOpMode, census


class _CallSiteOnly(TorchFunctionMode):
    """The recorder's call-site machinery and nothing else (no outputs recorded)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = _tape._getframe(1)
        caller = frame
        if frame.f_code is _tape._HANDLE_TORCH_FUNCTION and frame.f_back is not None:
            caller = frame.f_back.f_back or frame
        call = _tape._call_sites.get((id(caller.f_code), caller.f_lasti)) or _tape._call_site(caller)
        return call(func, args, kwargs if kwargs is not None else {})


def _under(mode, pack, unpack):
    def run(forward):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode():
            out = forward()
        _outputs.settle()  # as a tape's exit does: the records of dead intermediates go
        return out
    return run


def _tracked(forward):
    with gp.track():
        return forward()


VARIANTS = {
    "plain": lambda forward: forward(),
    "floor": _under(_NoOpMode, _detach, _identity),
    "pack": _under(_NoOpMode, _saved.pack_hook(-1), _saved.SavedHandle.unpack),
    "call_site": _under(_CallSiteOnly, _detach, _identity),
    "recorder": _under(_tape._OutputRecorder, _detach, _identity),
    "track": _tracked,
}


def measure(rounds: int, size: str = "full", seed: int = 0) -> dict:
    """``{variant: median seconds}`` of the transformer's forward (``overhead.SIZES[size]``),
    and the torch calls it makes."""
    torch.set_num_threads(1)
    model = _Model(SIZES[size])
    calls = census(lambda: list(model.forward()))["calls"]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = random.Random(seed)
    for rnd in range(rounds + 1):  # round 0 warms up
        names = list(VARIANTS)
        order.shuffle(names)
        for name in names:
            t0 = time.process_time()
            out = VARIANTS[name](model.forward)
            elapsed = time.process_time() - t0
            del out
            if rnd:
                times[name].append(elapsed)
    return {"calls": calls, **{name: statistics.median(ts) for name, ts in times.items()}}


def table(result: dict) -> str:
    calls, floor = result["calls"], result["floor"]
    lines = [f"small transformer forward, CPU time medians, {calls} torch calls the mode sees",
             f"{'variant':<10} {'ms':>8} {'over floor, µs/call':>20}"]
    for name in VARIANTS:
        over = "" if name in ("plain", "floor") else f"{(result[name] - floor) / calls * 1e6:+.2f}"
        lines.append(f"{name:<10} {result[name] * 1e3:>8.2f} {over:>20}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="the tiny transformer (a smoke run)")
    args = parser.parse_args(argv)
    print(table(measure(args.rounds, "tiny" if args.tiny else "full")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
