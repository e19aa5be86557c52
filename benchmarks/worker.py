"""One measurement in one fresh process: ``python -m benchmarks.worker JOB_JSON``.

Prints one JSON object on stdout.  The suite runner (``python -m benchmarks``) uses
:func:`run_isolated`, which forks a child of an interpreter that has imported torch
and nothing else yet (same isolation, ~1.5 s less per job) for the memory jobs, and
runs this module's command line (a new interpreter) for the jobs that time Python
code (NOTE [ Timed in a new interpreter ]); ``--spawn`` uses it for every job.

NOTE [ Timed in a new interpreter ]
A forked child shares its parent's memory copy-on-write: the first write to a page
it inherited (a reference count, a garbage collector's header, of torch's or
graphprune's objects) copies that page, a minor fault of a few µs. A child's code
pays that on each page it touches for the first time, call after call: ``explain``
on a 1k-node chain met 870, 253, 137, then 30-90 faults per call over eight calls
in a forked child (3.4-7.4 µs per node), and none after the second call in a new
interpreter (3.0). Nothing real runs as such a child, so the jobs that time Python
code per call or per node (``timing``, ``scaling``, ``overhead``) run in a new
interpreter; the memory jobs, which read the kernel's counters after a warm-up step,
stay forks. That interpreter starts without ``MALLOC_MMAP_THRESHOLD_`` (the C
library's own allocator, as users run): the threshold the memory method needs makes
every buffer of 64 KiB or more an ``mmap`` and every free a ``munmap``, system calls
that plain PyTorch pays as graphprune does, which on this VM nearly doubled the small
transformer's plain forward (44 ms against 24) and so diluted what tracking adds (its
step read 1.064x under the threshold, 1.117x without, quick runs one after the
other).

Memory method (CPU): ``MALLOC_MMAP_THRESHOLD_=65536`` must be set before the process
starts (DESIGN.md fact 11), so every tensor buffer is its own mmap and freeing it
lowers RSS.  Before each measured step: ``gc.collect()``, read ``VmRSS`` (the baseline:
model, input, gradients, allocator state), then write ``5`` to ``/proc/self/clear_refs``
which resets the kernel's peak-RSS counter ``VmHWM`` to the current RSS.  After the
step, ``VmHWM - baseline`` is the step's peak; it is exact (kernel accounting, no
sampling).  At checkpoints inside the step we read ``VmRSS`` and ``VmHWM`` too: the
"memory held over the step" series.  On CUDA: ``torch.cuda.max_memory_allocated``
and ``memory_allocated`` relative to the same baseline.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # the memory method's setting (see above)

MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class CPUMeter:
    name = "cpu"

    def __init__(self):
        self.can_reset = True
        try:
            self._reset()
        except OSError:
            self.can_reset = False

    @staticmethod
    def _reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def now(self) -> int:
        return _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        return _status_kib("VmHWM") * 1024

    def reset_peak(self):
        if self.can_reset:
            self._reset()

    def sync(self):
        pass


class CUDAMeter:
    name = "cuda"

    def __init__(self):
        import torch

        self.torch = torch
        self.can_reset = True

    def now(self) -> int:
        return self.torch.cuda.memory_allocated()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def reset_peak(self):
        self.torch.cuda.reset_peak_memory_stats()

    def sync(self):
        self.torch.cuda.synchronize()


def machine(device: str = "cpu") -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        mem = _status_kib_meminfo()
    except Exception:
        pass
    out = dict(
        cpu=cpu,
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        ram_gib=round(mem / 1024 / 1024, 1),
        python=platform.python_version(),
        torch=torch.__version__,
        platform=platform.platform(),
        device=device,
        malloc_mmap_threshold=os.environ.get(MMAP_ENV),
    )
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _status_kib_meminfo() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------------------
def run_job(job: dict) -> dict:
    """Run one (config, strategy) job in this process and return its measurements."""
    kind = job["kind"]
    if kind == "scaling":
        from .scaling import run_scaling

        return run_scaling(job)
    if kind == "timing":
        return run_timing(job)
    if kind == "overhead":
        from .overhead import run_overhead

        return run_overhead(job)
    import torch

    from . import workloads as W

    device = job.get("device", "cpu")
    torch.set_num_threads(job.get("threads", 1))
    torch.manual_seed(0)
    cfg = job["config"]
    size = W.SIZES[job["level"]]
    model = W.build(cfg, size).to(device)
    meter = CUDAMeter() if device == "cuda" else CPUMeter()
    result = dict(job=job, ok=True)

    strategy = job["strategy"]
    floor_head = None
    if strategy == "floor":
        acct = W.graph_accounting(model)
        result["graph"] = acct
        floor_head = max(acct["head_bytes"], key=lambda k: acct["head_bytes"][k])
        result["floor_head"] = floor_head
        gc.collect()

        def step(ck):
            return W.floor_step(model, floor_head, ck, rows=cfg["mode"] == "pcgrad")

    else:

        def step(ck):
            return W.run_step(model, strategy, cfg["mode"], ck)

    repeats = job["repeats"]
    times, peaks, series, held_ends, prune_s, bwd_s = [], [], None, [], [], []
    try:
        for rep in range(repeats + 1):  # the first step warms up (allocator, kernels)
            model.zero_grad()
            gc.collect()
            meter.sync()
            base = meter.now()
            points = []
            start = [0.0]

            def ck(label, base=base, points=points, start=start):
                meter.sync()
                t = time.perf_counter() - start[0]
                points.append((label, (meter.now() - base) / MIB, (meter.peak() - base) / MIB, t))

            meter.reset_peak()
            t0 = start[0] = time.perf_counter()
            held = step(ck)
            meter.sync()
            dt = time.perf_counter() - t0
            peak = (meter.peak() - base) / MIB
            held_end = (meter.now() - base) / MIB
            # what the step holds is used as real code would: logged, and a metric
            _ = [float(v.detach()) for v in held["logs"]]
            _ = [float(y.detach().float().mean()) for y in held["outs"]]
            del held
            if rep == 0:
                continue
            times.append(dt)
            peaks.append(peak)
            series = points
            held_ends.append(held_end)
            spans = [(b[0], b[3] - a[3]) for a, b in zip(points, points[1:])]
            for (before, bwd), (label, prune) in zip(spans, spans[1:]):  # each prune, the backward it follows
                if label.startswith("prune") and before.startswith("bwd"):
                    prune_s.append(prune)
                    bwd_s.append(bwd)
    except W.NotApplicable as e:
        return dict(job=job, ok=False, not_applicable=str(e))
    result.update(
        time_s=statistics.median(times),
        times_s=times,
        peak_mib=statistics.median(peaks),
        peaks_mib=peaks,
        series=series,
        held_end_mib=statistics.median(held_ends),
        prune_call_s=statistics.median(prune_s) if prune_s else None,
        backward_call_s=statistics.median(bwd_s) if bwd_s else None,  # of the backwards a prune follows
        prune_shares=[p / b for p, b in zip(prune_s, bwd_s)],  # each prune / the backward it follows
        meter=meter.name,
        peak_resettable=meter.can_reset,
    )
    return result


def run_timing(job: dict) -> dict:
    """Step times of several strategies interleaved in one process.

    Fresh-process timings carry the machine's drift between processes (other load on a
    shared box); here every strategy runs once per round, in a rotating order, so drift
    hits all alike and the ratios to ``retain`` are paired.  Memory is not measured here."""
    import torch

    from . import workloads as W

    torch.set_num_threads(job.get("threads", 1))
    cfg = job["config"]
    model = W.build(cfg, W.SIZES[job["level"]]).to(job.get("device", "cpu"))
    sync = torch.cuda.synchronize if job.get("device") == "cuda" else (lambda: None)
    strategies = list(job["strategies"])
    times: dict = {s: [] for s in strategies}
    na = {}

    def nock(label):
        pass

    for rnd in range(job["reps"] + 1):
        k = rnd % len(strategies)
        for s in strategies[k:] + strategies[:k]:
            if s in na:
                continue
            model.zero_grad()
            gc.collect()
            sync()
            t0 = time.perf_counter()
            try:
                held = W.run_step(model, s, cfg["mode"], nock)
            except W.NotApplicable as e:
                na[s] = str(e)
                continue
            sync()
            dt = time.perf_counter() - t0
            del held
            if rnd > 0:
                times[s].append(dt)
    med = {s: statistics.median(v) for s, v in times.items() if v}
    ratios = {}
    for s, v in times.items():
        if v and times.get("retain"):
            ratios[s] = statistics.median([a / b for a, b in zip(v, times["retain"])])
    return dict(job=job, ok=True, times_s=times, median_s=med, paired_ratio=ratios)


# NOTE [ Timed in a new interpreter ]
TIMED_IN_A_NEW_INTERPRETER = frozenset({"timing", "scaling", "overhead"})


def run_isolated(job: dict, spawn: bool = False, timeout: float = 900) -> dict:
    """Run ``job`` in a fresh process (a fork of this one, or a new interpreter)."""
    if (spawn or job["kind"] in TIMED_IN_A_NEW_INTERPRETER or not hasattr(os, "fork")
            or job.get("device") == "cuda"):
        import subprocess

        env = os.environ
        if job["kind"] in TIMED_IN_A_NEW_INTERPRETER:  # the C library's own allocator (NOTE above)
            env = {k: v for k, v in env.items() if k != MMAP_ENV}
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.worker", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env=env,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            return dict(job=job, ok=False, error=(proc.stderr or proc.stdout)[-3000:])
        return json.loads(lines[-1])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            try:
                out = run_job(job)
            except BaseException:
                out = dict(job=job, ok=False, error=traceback.format_exc()[-3000:])
                code = 1
            data = json.dumps(out).encode()
            with os.fdopen(w, "wb") as f:
                f.write(data)
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            b = f.read(1 << 16)
            if not b:
                break
            chunks.append(b)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        return dict(job=job, ok=False, error=f"worker died (wait status {status})")
    return json.loads(data)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(argv[0])
    try:
        out = run_job(job)
    except Exception:
        out = dict(job=job, ok=False, error=traceback.format_exc()[-3000:])
    out["malloc_mmap_threshold"] = os.environ.get(MMAP_ENV)  # None: the C library's own
    print(json.dumps(out))


if __name__ == "__main__":
    main()
