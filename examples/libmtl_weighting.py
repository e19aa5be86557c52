"""LibMTL's own weighting classes (PCGrad, MGDA, CAGrad, GradNorm), unmodified, under graphprune.

Run: ``python examples/libmtl_weighting.py`` (needs ``LibMTL`` and ``scipy``). The model
is LibMTL's ``HPS`` architecture mixed with a weighting class, as its ``Trainer``
builds it, and the losses are assigned into ``torch.zeros(task_num)`` as its
``_compute_loss`` does. graphprune goes where a user would put it: ``gp.track()``
around the forward and the losses, ``gp.pruning()`` around ``model.backward(losses)``.
Inside, each ``losses[tn].backward(retain_graph=True)`` of LibMTL's
``_compute_grad`` runs as ``gp.backward``, freeing head ``tn`` during its pass (the
un-run entries of ``losses`` keep the trunk); the last task's plain pass, and
GradNorm's backward of its loss scales, are PyTorch's. One SGD step per weighting,
with and without graphprune, must give the same parameters.

LibMTL 1.1.5's package ``__init__`` imports its ResNet models, which need
``torchvision.models.utils``, gone since torchvision 0.13; the weighting classes and
architectures need none of it, so ``import_libmtl`` loads the package without
running that ``__init__``. It was written for torch < 2.0, whose ``zero_grad()`` left
zero gradients that its ``_reset_grad`` writes into: the model's
``zero_grad_share_params`` keeps them as zeros. No LibMTL code is changed.
"""

import importlib
import importlib.util
import random
import sys
import types

import numpy as np
import torch
from _mtl import T, mib, model, report
from torch.nn import functional as F

import graphprune as gp

WEIGHT_ARGS = {"PCGrad": {}, "MGDA": {"mgda_gn": "none"}, "CAGrad": {"calpha": 0.5, "rescale": 1},
               "GradNorm": {"alpha": 1.5}}
TASKS = [f"task{i}" for i in range(T)]  # CAGrad in LibMTL 1.1.5 assumes three tasks


def import_libmtl():
    """``LibMTL.architecture`` and ``LibMTL.weighting``, without the package's ``__init__``."""
    if "LibMTL" not in sys.modules:
        spec = importlib.util.find_spec("LibMTL")
        if spec is None:
            raise ImportError("LibMTL is not installed: pip install LibMTL==1.1.5 --no-deps scipy")
        package = types.ModuleType("LibMTL")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["LibMTL"] = package
    return importlib.import_module("LibMTL.architecture"), importlib.import_module("LibMTL.weighting")


def build(name: str):
    """LibMTL's ``MTLmodel``: its HPS architecture mixed with the weighting ``name``."""
    architecture, weighting = import_libmtl()
    trunk, heads, inputs, targets = model()

    class MTLmodel(architecture.HPS, getattr(weighting, name)):
        def __init__(self):
            super().__init__(TASKS, lambda: trunk, dict(zip(TASKS, heads)), rep_grad=False, multi_input=False,
                             device=torch.device("cpu"))
            self.init_param()

        def zero_grad_share_params(self):
            # LibMTL 1.1.5 was written for torch < 2.0, whose zero_grad() left zeros;
            # its _reset_grad writes into those grads, so keep them as zeros.
            self.encoder.zero_grad(set_to_none=False)

    net = MTLmodel()
    net.epoch, net.train_loss_buffer = 1, np.full((T, 2), 2.0)  # GradNorm reads these from the Trainer
    return net, inputs, dict(zip(TASKS, targets))


def step(name: str, with_graphprune: bool):
    net, inputs, gts = build(name)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    random.seed(0)  # PCGrad shuffles the tasks
    with gp.track() if with_graphprune else torch.enable_grad():
        preds = net(inputs)
        losses = torch.zeros(net.task_num)  # LibMTL's Trainer._compute_loss
        for tn, task in enumerate(TASKS):
            losses[tn] = F.mse_loss(preds[task], gts[task])
    optimizer.zero_grad()
    if with_graphprune:
        with gp.pruning() as p:
            net.backward(losses, **WEIGHT_ARGS[name])
    else:
        net.backward(losses, **WEIGHT_ARGS[name])
        p = None
    optimizer.step()
    return [q.detach().clone() for q in net.parameters()], p


if __name__ == "__main__":
    freed = {}
    for name in WEIGHT_ARGS:
        want, _ = step(name, False)
        got, p = step(name, True)
        torch.testing.assert_close(got, want)
        freed[name] = [mib(r.bytes_freed) for r in p.reports]
    report("libmtl_weighting", freed_per_routed_pass_mib=freed)
