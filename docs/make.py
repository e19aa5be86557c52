"""Make the README's pictures (``bash scripts/docs.sh``): the graphs of its examples,
coloured by what their prunes do, and the memory timeline of ``examples/demo.py``'s step.

Everything drawn is computed here, from the examples' own models: nothing is typed in.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn import functional as F

import graphprune as gp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def seed() -> None:
    """``examples/seed_example.py``: ``prune_after(y1, keep=x)``, before it runs."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x = w + 10
        x1 = x * x
        y1 = (x1 * x1).sum()
    gp.render(y1, keep=x, path=os.path.join(HERE, "seed.svg"),
              title="gp.explain(y1, keep=x): seed_example.py")


def multitask() -> None:
    """``examples/multitask.py``: what ``gp.backward(loss1)`` (no ``keep=``) frees, with
    the module that built each node."""
    torch.manual_seed(0)
    import multitask as ex  # runs the example once (it checks its gradients)

    with gp.track(modules=ex.model):
        feat = ex.model["trunk"](ex.images)
        loss1 = F.binary_cross_entropy_with_logits(ex.model["seg"](feat), ex.masks)
        loss2 = F.cross_entropy(ex.model["cls"](feat), ex.labels)
    gp.render(loss1, path=os.path.join(HERE, "multitask.svg"),
              title="gp.explain(loss1): multitask.py, loss2 not backpropagated yet")
    del feat, loss2


def timeline() -> None:
    """``examples/demo.py``'s step, ``retain_graph=True`` against ``gp.backward``."""
    import demo

    runs = []
    for label, pruned in (("retain_graph=True", False), ("gp.backward", True)):
        tl = gp.Timeline(label)
        with gp.track(timeline=tl):
            feat = demo.trunk(demo.inp)
            losses = [h(feat).square().mean() for h in demo.heads]  # kept, as for logging
        tl.mark("forward, 3 heads built")
        for i, loss in enumerate(losses):
            if pruned:
                gp.backward(loss)
            else:
                loss.backward(retain_graph=i < len(losses) - 1)
            tl.mark(f"after head {i}'s backward")
        del feat, losses, loss
        tl.mark("losses dropped")
        runs.append(tl)
    gp.plot_timeline(runs, os.path.join(HERE, "timeline.svg"),
                     title="examples/demo.py: bytes held by the graph's saved tensors over one step")
    for tl in runs:
        marks = [f"{e.label}: {e.bytes / 2**20:.0f} MiB" for e in tl.events if e.kind == "mark"]
        print(f"{tl.label}: peak {tl.peak / 2**20:.0f} MiB; " + "; ".join(marks))


if __name__ == "__main__":
    seed()
    multitask()
    timeline()
    print("wrote", ", ".join(sorted(f for f in os.listdir(HERE) if f.endswith(".svg"))), "in docs/")
