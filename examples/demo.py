"""The memory a prune gives back: one trunk, three heads, measured by RSS.

Run: ``bash scripts/demo.sh``, or ``python examples/demo.py``, which starts itself again
with ``MALLOC_MMAP_THRESHOLD_=65536`` where that is not set (so that freed tensors really
leave the process and RSS shows them go, DESIGN.md fact 11). Each head's loss is
backpropagated in turn; plain PyTorch keeps every head's saved tensors with
``retain_graph=True``, graphprune frees each finished head and keeps the trunk.
"""

import gc
import os
import sys

import psutil
import torch
from torch import nn

import graphprune as gp

MiB = 2**20
torch.manual_seed(0)
torch.set_num_threads(max(1, os.cpu_count() or 1))
trunk = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU())
heads = [nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 1))
         for _ in range(3)]
inp = torch.randn(2048, 512)


def rss() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MiB


def step(use_graphprune: bool) -> list[tuple[str, float, float]]:
    """RSS over the baseline after each phase, and the bytes graphprune reported freed."""
    base = rss()
    timeline = []
    with gp.track() if use_graphprune else torch.enable_grad():
        feat = trunk(inp)
        losses = [h(feat).square().mean() for h in heads]  # kept, as for logging
    timeline.append(("forward, 3 heads built", rss() - base, 0.0))
    for i, loss in enumerate(losses):
        last = i == len(losses) - 1
        freed = 0.0
        if use_graphprune:  # no keep=: the heads not backpropagated yet keep the trunk
            freed = gp.backward(loss).bytes_freed / MiB
        else:
            loss.backward(retain_graph=not last)
        timeline.append((f"after head {i}'s backward", rss() - base, freed))
    for p in [*trunk.parameters(), *(p for h in heads for p in h.parameters())]:
        p.grad = None
    return timeline


if __name__ == "__main__":
    THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
    if THRESHOLD not in os.environ:  # read by the C library at start only
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, THRESHOLD: "65536"})
    step(False)  # warm up the allocator and the kernels
    plain, pruned = step(False), step(True)
    print(f"RSS over the baseline, MiB (one process, {THRESHOLD}={os.environ[THRESHOLD]})")
    print(f"{'phase':<26} {'retain_graph=True':>18} {'gp.backward':>12} {'report: freed':>14}")
    for (label, a, _), (_, b, freed) in zip(plain, pruned):
        print(f"{label:<26} {a:>18.0f} {b:>12.0f} {freed:>14.0f}")
    print(f"\nbefore the last head's pass graphprune holds {plain[-2][1] - pruned[-2][1]:.0f} MiB less; "
          f"after the step, {plain[-1][1] - pruned[-1][1]:.0f} MiB less (the logged losses keep plain "
          "PyTorch's head graphs alive).")
