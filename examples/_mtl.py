"""What the multi-task examples share: a trunk with ``T`` heads, its data, and how they report.

Memory is the bytes the saved tensors of a ``gp.track(timeline=tl)`` forward hold
(``gp.Timeline``): the plain run's forward is tracked too and its passes are plain
PyTorch's, so both columns count the same tensors, with no allocator noise.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.nn import functional as F

T, BATCH, WIDTH = 3, 256, 512
MiB = 2**20


def model(seed: int = 0):
    """A shared MLP trunk and ``T`` heads, the same weights for every ``seed``."""
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(64, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    heads = nn.ModuleList(_head() for _ in range(T))
    g = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(BATCH, 64, generator=g)
    targets = [torch.randn(BATCH, 1, generator=g) for _ in range(T)]
    return trunk, heads, inputs, targets


def _head() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1))


def task_loss(head, feats, target):
    return F.mse_loss(head(feats), target)


def lazy_rows(timeline=None):
    """Every parameter's per-task gradient (``gp.grads_each``), the heads built one at a
    time after the trunk: ``(trunk, heads, shared parameters, all parameters, rows)``."""
    import graphprune as gp

    trunk, heads, inputs, targets = model()
    shared = list(trunk.parameters())
    params = shared + list(heads.parameters())
    with gp.track(timeline=timeline):
        feats = trunk(inputs)

    def build(i):
        with gp.track(timeline=timeline):  # grads_each tracks the head; this lets the timeline count it
            return task_loss(heads[i], feats, targets[i])

    rows = gp.grads_each([lambda i=i: build(i) for i in range(T)], params, materialize_grads=True)
    return trunk, heads, shared, params, rows


def flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in params])


def set_flat_grads(params, vector: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = vector[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def grads(*modules) -> list:
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


def mib(nbytes) -> float:
    return round(nbytes / MiB, 2)


def report(name: str, **numbers) -> None:
    """One line for people, one ``RESULT`` line of JSON for ``tests/test_libraries.py``."""
    text = ", ".join(f"{k}={v}" for k, v in numbers.items())
    print(f"{name}: gradients equal plain PyTorch | {text}")
    print("RESULT " + json.dumps(dict(name=name, **numbers)))
