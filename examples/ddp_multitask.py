"""Multi-task training under DDP (or FSDP2): one backward pass per task, one gradient sync.

Run: ``torchrun --nproc_per_node=2 examples/ddp_multitask.py`` (gloo, CPU). Options:
``--wrap ddp`` (default), ``ddp-find-unused``, ``ddp-bucket-view``, ``fsdp2`` (trunk and
heads sharded apart) or ``fsdp2-one-group``, comma-separated for several; ``--steps N``.
Each rank trains on its own data; after the last step every rank checks its parameters
against a single-process reference that trains on all ranks' data
(``sum(losses).backward()``, no graphprune), and rank 0 prints what each pass freed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import graphprune as gp
import graphprune.distributed as gpd


class TwoHeads(nn.Module):
    """A shared trunk, a classification head and a regression head."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.cls = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 5))
        self.reg = nn.Sequential(nn.Linear(width, width), nn.Sigmoid(), nn.Linear(width, 1))

    def forward(self, x):
        feat = self.trunk(x)
        return self.cls(feat), self.reg(feat)


def batch(step: int, rank: int, size: int = 8):
    """The data of ``rank`` at ``step``: every process can make every rank's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 16, generator=g), torch.randint(0, 5, (size,), generator=g), \
        torch.randn(size, 1, generator=g)


def task_losses(model, data):
    x, labels, targets = data
    logits, value = model(x)
    return [F.cross_entropy(logits, labels), F.mse_loss(value, targets)]


def wrap(model: nn.Module, how: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if how == "ddp":
        return DDP(model)
    if how == "ddp-find-unused":
        return DDP(model, find_unused_parameters=True)
    if how == "ddp-bucket-view":
        return DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.004)  # several buckets
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for part in (model.trunk, model.cls, model.reg):
            fully_shard(part)
        return fully_shard(model)
    if how == "fsdp2-one-group":  # the heads in the root's parameter group
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.trunk, reshard_after_forward=False)
        return fully_shard(model)
    raise ValueError(f"unknown --wrap {how!r}")


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor (FSDP2's are sharded DTensors: gather them)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def train(how: str, steps: int, verbose: bool) -> float:
    """Train ``steps`` steps with per-task passes; return the largest difference from
    the single-process reference (``assert_close`` has passed on it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, how)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        with gp.track():
            losses = task_losses(wrapped, batch(step, rank))
        reports = gpd.backward_each(wrapped, losses)
        opt.step()
        opt.zero_grad()
        if verbose:
            freed = ", ".join(f"pass {i}: {r.released_node_count} node(s), {r.bytes_freed} B freed"
                              for i, r in enumerate(reports))
            say(f"[{how}] step {step}: losses {[round(t.item(), 4) for t in losses]}; {freed}")
        # Reference: every rank's data in one process, one plain pass (DDP averages ranks).
        ref = [sum(ts) / world for ts in zip(*(task_losses(reference, batch(step, r)) for r in range(world)))]
        sum(ref).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        got = full(p)
        torch.testing.assert_close(got, q.detach(), msg=lambda m, name=name: f"rank {rank}, {name}: {m}")
        worst = max(worst, (got - q.detach()).abs().max().item())
    return worst


def say(line: str) -> None:
    """Print ``line`` in one write: the ranks share one stdout, and unbuffered (torchrun's
    workers may be), ``print`` writes a line and its newline apart, so another rank's line
    could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrap", default="ddp", help="ddp, ddp-find-unused, ddp-bucket-view, fsdp2 or "
                        "fsdp2-one-group (comma-separated for several)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        for how in args.wrap.split(","):
            worst = train(how, args.steps, verbose=rank == 0)
            say(f"[{how}] rank {rank}: {args.steps} steps, parameters equal the single-process "
                f"reference (max difference {worst:.1e})")
    finally:
        gc.collect()  # DDP's reducer lives in reference cycles: let it go while the group is up
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run me with: torchrun --nproc_per_node=2 examples/ddp_multitask.py")
    main()
