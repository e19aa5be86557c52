"""prune_after / explain cost per node of two checkouts of graphprune, side by side.

Absolute µs per node move with the machine (a shared 2-core box ran at half speed one
day); two versions compared in the same hour, processes alternating, do not. Each
process builds ``_chain`` of ``nodes`` nodes (``scaling.py``) under ``track()``, runs
the retained backward, ``explain(y, keep=x)`` and ``prune_after(y, keep=x)``, after a
warm-up run, and prints the medians of ``repeats`` runs (gc on, as in the suite)::

    git worktree add /tmp/before <commit>
    python -m benchmarks.compare_prune /tmp/before . --nodes 10000 --rounds 2

The small transformer's prune (``overhead.py``) is compared with ``--transformer``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def _measure_chain(nodes: int, repeats: int) -> dict:
    import torch

    import graphprune as gp
    from benchmarks.scaling import _chain

    torch.set_num_threads(1)
    w = torch.randn(64, requires_grad=True)
    explain, prune = [], []
    for rep in range(repeats + 1):
        with gp.track():
            x, y = _chain(w, nodes)
        y.backward(retain_graph=True)
        t0 = time.perf_counter()
        e = gp.explain(y, keep=x)
        t1 = time.perf_counter()
        r = gp.prune_after(y, keep=x)
        t2 = time.perf_counter()
        if rep:
            explain.append((t1 - t0) / nodes * 1e6)
            prune.append((t2 - t1) / nodes * 1e6)
        del x, y, e, r
        gc.collect()
        w.grad = None
    return dict(explain_us_per_node=statistics.median(explain), prune_us_per_node=statistics.median(prune))


def _measure_transformer(budget_s: float) -> dict:
    import torch

    from benchmarks import overhead

    torch.set_num_threads(1)  # as the suite's overhead job runs it
    size = dict(overhead.SIZES["quick"], budget_s=budget_s, steps=400)
    r = overhead.run_transformer(size)
    return dict(prune_ms=r["median_s"]["gp_prune"] * 1e3, prune_share=r["prune_share"], steps=r["steps"])


def _child(args) -> None:
    out = _measure_transformer(args.budget) if args.transformer else _measure_chain(args.nodes, args.repeats)
    import graphprune

    print(json.dumps(dict(out, graphprune=os.path.dirname(graphprune.__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkouts", nargs="+", help="repository roots (their graphprune and benchmarks)")
    p.add_argument("--nodes", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per process, after a warm-up")
    p.add_argument("--rounds", type=int, default=2, help="processes per checkout, alternating")
    p.add_argument("--transformer", action="store_true", help="the small transformer's prune instead")
    p.add_argument("--budget", type=float, default=10.0, help="seconds per transformer process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    rows = {root: [] for root in args.checkouts}
    for _ in range(args.rounds):
        for root in args.checkouts:
            # this file runs the child (an older checkout may not have it); root's
            # graphprune and benchmarks come first on the path
            cmd = [sys.executable, os.path.abspath(__file__), "--child", root, "--nodes", str(args.nodes),
                   "--repeats", str(args.repeats), "--budget", str(args.budget)]
            cmd += ["--transformer"] if args.transformer else []
            env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
            proc = subprocess.run(cmd, cwd=os.path.abspath(root), env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{root}: {proc.stderr[-2000:]}")
            rows[root].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for root, runs in rows.items():
        keys = [k for k in runs[0] if k != "graphprune"]
        cells = ", ".join(f"{k} {' / '.join(f'{r[k]:.3g}' for r in runs)}" for k in keys)
        print(f"{root}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
