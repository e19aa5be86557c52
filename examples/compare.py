"""What the pattern examples share: run a step's strategies in fresh processes, compare.

An example defines ``setup()`` (its model and a ``run(mode, probe)`` that does one
step: ``mode`` is ``"plain"`` (``retain_graph=True``), ``"graphprune"`` (no ``keep=``
but where the rule asks) or ``"explicit"`` (the best ``keep=`` written out), and
``probe(phase)`` is called in the middle and at the end of the step) and ends with
``compare.main(PATTERN, __file__, setup)``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile

import psutil
import torch

MiB = 2**20


def rss() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MiB


def measure(setup, mode: str, out_dir: str) -> dict:
    """A warm-up step and a measured step with ``mode``, in this process; RSS over that before both."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    params, run = setup()
    base, result = rss(), {}
    run(mode)  # warm-up: optimizer state, kernels; what a step leaves held is held into the next
    reports = run(mode, lambda phase: result.update({phase: rss() - base}))
    save(params, out_dir, mode)
    result["freed"] = [r.bytes_freed for r in reports]
    if mode == "plain":  # the best keep= written out, for the graphprune process's default to be held against
        result["freed_explicit"] = [r.bytes_freed for r in run("explicit")]
    return result


def save(params: dict, out_dir: str, mode: str) -> None:
    torch.save({**params, **{k + ".grad": p.grad for k, p in params.items()}}, f"{out_dir}/{mode}.pt")


def main(pattern: str, script: str, setup=None, measure_one=None) -> None:
    """As a measuring process (``script MODE DIR``): one strategy, one JSON line. Else
    each strategy in a fresh process, the gradients compared, one line of results."""
    if len(sys.argv) == 3:
        mode, out_dir = sys.argv[1:]
        print(json.dumps(measure_one(mode, out_dir) if measure_one else measure(setup, mode, out_dir)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave the process (DESIGN.md 11)
    with tempfile.TemporaryDirectory() as tmp:
        procs = {m: subprocess.Popen([sys.executable, script, m, tmp], env=env, stdout=subprocess.PIPE)
                 for m in ("plain", "graphprune")}
        res = {m: p.communicate()[0] for m, p in procs.items()}
        if any(p.returncode for p in procs.values()):
            sys.exit(f"{pattern}: a measuring process failed")
        torch.testing.assert_close(torch.load(f"{tmp}/graphprune.pt"), torch.load(f"{tmp}/plain.pt"))
    plain, pruned = (json.loads(res[m].splitlines()[-1]) for m in ("plain", "graphprune"))
    default, explicit = ("[" + ", ".join(f"{b / MiB:.1f}" for b in freed) + "]"
                         for freed in (pruned["freed"], plain["freed_explicit"]))
    print(f"{pattern}: gradients equal plain retain_graph=True | RSS over baseline, MiB: "
          f"middle plain={plain['middle']:.1f} graphprune={pruned['middle']:.1f}, "
          f"end plain={plain['end']:.1f} graphprune={pruned['end']:.1f} | "
          f"freed per call, MiB: default={default} explicit keep={explicit}")
