"""Run the whole benchmark suite: ``python -m benchmarks [--quick] [--device cuda]``.

Writes ``RESULTS.md``, ``results.json`` and PNG plots into the output folder
(``benchmarks/`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .worker import MMAP_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    lvl = p.add_mutually_exclusive_group()
    lvl.add_argument("--quick", action="store_true", help="a pass of about a minute, small sizes")
    lvl.add_argument("--tiny", action="store_true", help="CI smoke run: tiny sizes, numbers meaningless")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=None,
                   help="fresh processes per (workload, strategy); rounds are interleaved so that "
                   "machine noise hits every strategy alike (default: 2 full, 1 quick/tiny)")
    p.add_argument("--repeats", type=int, default=None, help="measured steps per process (after one warm-up)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (default 1: stable timings)")
    p.add_argument("--only", default=None,
                   help="comma-separated workload names to run (seed,lazy,eager,pcgrad,depth)")
    p.add_argument("--no-scaling", action="store_true", help="skip the prune-cost scaling benchmark")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the tracking-overhead jobs (tiny-op chain, small transformer, bytes per node)")
    p.add_argument("--spawn", action="store_true", help="new interpreter per job instead of a fork")
    p.add_argument("--out", default=HERE, help="output folder (default: benchmarks/)")
    return p.parse_args(argv)


def _source_hash() -> str:
    """A hash of graphprune's source, to tie the results to the code they measured."""
    import hashlib

    h = hashlib.sha256()
    pkg = os.path.join(ROOT, "graphprune")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:12]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(MMAP_ENV) is None:  # must be set before the C library starts
        env = dict(os.environ, **{MMAP_ENV: "65536"})
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *argv], env)
    args = _parse(argv)
    level = "tiny" if args.tiny else "quick" if args.quick else "full"
    rounds = args.rounds or (2 if level == "full" else 1)
    repeats = args.repeats or (2 if level == "full" else 1)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)

    import torch  # noqa: F401  (imported once; every job runs in a fork of this state)
    import torch._dynamo  # noqa: F401  (torch.utils.checkpoint imports it on first use: 3 s)

    import graphprune  # noqa: F401

    from . import overhead, report, scaling
    from . import workloads as W
    from .worker import machine, run_isolated

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available here")

    cfgs = W.configs(level)
    if args.only:
        wanted = set(args.only.split(","))
        cfgs = [c for c in cfgs if c["workload"] in wanted]
    jobs = []
    for r in range(rounds):
        for cfg in cfgs:
            for s in ["floor"] + cfg["strategies"]:
                jobs.append(dict(kind="step", config=cfg, strategy=s, level=level, repeats=repeats,
                                 device=args.device, threads=args.threads, round=r))
    reps = {"full": 11, "quick": 1, "tiny": 1}[level]  # paired ratios of a shared machine: ±5% a round
    for cfg in cfgs:
        jobs.append(dict(kind="timing", config=cfg, strategies=[s for s in cfg["strategies"]],
                         level=level, reps=reps, device=args.device, threads=args.threads))
    if not args.no_scaling:
        jobs += scaling.jobs(level, args.threads)
    if not args.no_overhead:
        jobs += overhead.jobs(level, args.device)

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    t_start = time.time()
    src_before = _source_hash()
    results = []
    bar = tqdm(total=len(jobs), unit="job", dynamic_ncols=True) if tqdm else None
    for i, job in enumerate(jobs):
        if job["kind"] == "step":
            label = f"{W.config_name(job['config'])}/{job['strategy']}"
        elif job["kind"] == "timing":
            label = f"timing/{W.config_name(job['config'])}"
        elif job["kind"] == "overhead":
            label = f"overhead/{job['part']}"
        else:
            label = f"scaling/{job['shape']}/{job['nodes']}"
        if bar is not None:
            bar.set_description(label[:40])
        else:
            print(f"[{i + 1}/{len(jobs)}] {label}", file=sys.stderr, flush=True)
        results.append(run_isolated(job, spawn=args.spawn))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.time() - t_start
    src_after = _source_hash()

    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        machine=machine(args.device),
        level=level,
        rounds=rounds,
        repeats=repeats,
        timing_rounds=reps,
        threads=args.threads,
        command="python -m benchmarks " + " ".join(argv),
        elapsed_s=elapsed,
        graphprune_source=src_before,
        graphprune_changed_during_run=src_before != src_after,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f)
    path = report.write(results, meta, args.out)
    failed = [r for r in results if not r.get("ok") and not r.get("not_applicable")]
    print(f"wrote {path} ({elapsed:.0f} s, {len(failed)} failed job(s))")
    for r in failed:
        print("FAILED:", json.dumps(r["job"]), "\n", r.get("error", ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
