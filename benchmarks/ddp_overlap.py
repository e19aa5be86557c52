"""Step time of per-task passes under DDP: graphprune.distributed.backward_each against
the manual pattern (every pass under ``no_sync()``, then one all-reduce by hand).

Run: ``python -m benchmarks.ddp_overlap [--rounds 20] [--width 1024] ...``. It starts
2 gloo ranks on 127.0.0.1 (1 torch thread each) and times, per step, the forward and
the backward passes of a two-head MLP until the gradients are synchronised (the max
over ranks), with the strategies interleaved step by step:

- ``backward_each``: forward armed by DDP, one pass per task, DDP's bucketed all-reduce
  during the last pass;
- ``manual``: forward and every pass under ``no_sync()``, then the gradients flattened
  into one buffer, one ``all_reduce``, divided by the world size and copied back;
- ``no sync``: forward and passes under ``no_sync()``, no communication (compute only);
- ``each, no sync``: backward_each with its forward under ``no_sync()`` (its compute,
  zero root and gradient accumulation included, no communication);
- ``ddp, one pass``: plain DDP, ``sum(losses).backward()`` without graphprune, and
  ``one pass, no sync`` the same under ``no_sync()``: the overlap DDP itself gets on
  this machine, for scale.

``overlap`` in the output is the share of the manual all-reduce's cost (manual minus
no sync) that backward_each hides: (manual - backward_each) / (manual - no sync).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STRATEGIES = ["backward_each", "manual", "no sync", "each, no sync", "ddp, one pass", "one pass, no sync"]


def _parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.ddp_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="measured steps per strategy (after 3 warm-up)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of trunk and heads")
    p.add_argument("--layers", type=int, default=4, help="trunk layers")
    p.add_argument("--batch", type=int, default=64, help="samples per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (DDP's default: 25)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args(argv)


def _model(width: int, layers: int) -> nn.Module:
    trunk = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    heads = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
                          for _ in range(2))
    return nn.ModuleDict(dict(trunk=trunk, heads=heads))


class TwoTasks(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.net = _model(width, layers)

    def forward(self, x):
        feat = self.net["trunk"](x)
        return [head(feat) for head in self.net["heads"]]


def _step(strategy: str, ddp: DDP, x, labels) -> None:
    import graphprune as gp
    import graphprune.distributed as gpd

    sync_off = strategy in ("manual", "no sync", "each, no sync", "one pass, no sync")
    with ddp.no_sync() if sync_off else contextlib.nullcontext():
        with contextlib.nullcontext() if "one pass" in strategy else gp.track():
            losses = [F.cross_entropy(out, labels) for out in ddp(x)]
        if strategy in ("backward_each", "each, no sync"):
            gpd.backward_each(ddp, losses)
        elif "one pass" in strategy:
            sum(losses).backward()
        else:
            for loss in losses:
                gp.backward(loss)
    if strategy == "manual":
        grads = [p.grad for p in ddp.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(TwoTasks(args.width, args.layers), bucket_cap_mb=args.bucket_mb)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    labels = torch.randint(0, 10, (args.batch,), generator=g)
    times = {s: [] for s in STRATEGIES}
    for round_ in range(args.rounds + 3):
        for strategy in STRATEGIES:
            ddp.zero_grad(set_to_none=True)
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            _step(strategy, ddp, x, labels)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= 3:
                times[strategy].append(elapsed.item())
    if rank == 0:
        params = sum(p.numel() for p in ddp.parameters())
        queue.put((params, times))
    del ddp
    gc.collect()  # DDP's reducer sits in reference cycles: drop it while the group is up
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict[str, float]:
    args = _parse(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), args, queue), nprocs=2, start_method="spawn")
    params, times = queue.get()
    median = {s: statistics.median(ts) for s, ts in times.items()}
    print(f"2 gloo ranks on CPU, {args.threads} thread(s) each; two-head MLP, width {args.width}, "
          f"{args.layers} trunk layers, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB of "
          f"gradients), batch {args.batch} per rank, bucket_cap_mb={args.bucket_mb:g}; "
          f"{args.rounds} steps per strategy, interleaved")
    # Paired: each step's time over the manual step of the same round (machine load drifts).
    paired = {s: statistics.median(a / b for a, b in zip(times[s], times["manual"])) for s in STRATEGIES}
    print(f"{'strategy':<16}{'median ms':>10}{'p25 ms':>9}{'p75 ms':>9}{'/ manual, paired':>18}")
    for s in STRATEGIES:
        q1, _, q3 = statistics.quantiles(times[s], n=4)
        print(f"{s:<16}{median[s] * 1e3:>10.1f}{q1 * 1e3:>9.1f}{q3 * 1e3:>9.1f}{paired[s]:>17.3f}x")
    comm = 1 - paired["no sync"]
    hidden = 1 - paired["backward_each"]
    print(f"the manual all-reduce is {comm:.1%} of the manual step; backward_each is {hidden:.1%} faster "
          f"than manual" + (f" (it hides {hidden / comm:.0%} of the all-reduce)" if comm > 0 else ""))
    own = paired["ddp, one pass"] - paired["one pass, no sync"]
    print(f"exposed all-reduce, in manual steps: manual {comm:.3f}, backward_each "
          f"{paired['backward_each'] - paired['each, no sync']:.3f}, plain DDP on one pass {own:.3f}")
    return paired


if __name__ == "__main__":
    main()
