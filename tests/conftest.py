"""Shared models and references for the graphprune tests."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import graphprune as gp


class MultiTaskNet(nn.Module):
    """A shared conv trunk with two heads, the multi-task pattern graphprune is for."""

    def __init__(self, channels: int = 8, classes: int = 5):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        )
        self.head1 = nn.Sequential(nn.Flatten(), nn.Linear(channels * 8 * 8, classes))
        self.head2 = nn.Sequential(nn.Conv2d(channels, 1, 1), nn.Sigmoid())


@pytest.fixture
def multitask():
    torch.manual_seed(0)
    return MultiTaskNet()


@pytest.fixture
def images():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


class Square(torch.autograd.Function):
    """``a * a`` as a custom ``Function``: its node saves ``a`` (``_raw_saved_tensors``),
    and ``apply`` is no torch call the recorder sees."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 2 * ctx.saved_tensors[0] * g  # reads its saved tensors twice, as code does


def run_in_threads(target, count: int = 2) -> list[BaseException]:
    """Run ``target(i)`` in ``count`` threads at once; return what they raised."""
    errors: list[BaseException] = []

    def guarded(i):
        try:
            target(i)
        except Exception as exc:  # surfaced to the test by the return value
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def grads_of(params) -> list[torch.Tensor]:
    """Copies of the ``.grad`` of each parameter (``None`` kept as ``None``)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(torch=torch, gp=gp)
