"""PyTorch Lightning, manual optimization: two task losses, each backpropagated on its own.

Run: ``python examples/lightning_manual.py``. A ``LightningModule`` with
``automatic_optimization = False`` runs its forward under ``gp.track()`` and calls
``self.manual_backward`` once per loss, as Lightning asks (so that precision plugins
still scale the loss); its ``backward`` hook, which ``manual_backward`` ends in, calls
``gp.backward`` instead of ``loss.backward``. No ``keep=``: the classification loss,
not backpropagated yet, keeps the trunk while the segmentation head is freed. Plain
Lightning needs ``retain_graph=True`` on the first call. The script runs two
``Trainer.fit`` steps on CPU in two fresh processes, one per strategy, checks that the
parameters and gradients are equal and prints RSS over the baseline in the middle of the
second step (between the two passes) and at its end (the losses still held).
"""

import logging

import compare
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import graphprune as gp

PATTERN = "lightning_manual"


class MultiTask(pl.LightningModule):
    def __init__(self, mode: str):
        super().__init__()
        self.automatic_optimization = False
        self.mode = mode  # "plain", "graphprune" or "explicit" (the best keep= written out)
        self.trunk = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
        self.seg = nn.Sequential(nn.Conv2d(32, 128, 1), nn.ReLU(), nn.Conv2d(128, 1, 1))
        self.cls = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(64, 10))
        self.probe = lambda batch_idx, phase: None  # measures RSS (see measure)
        self.reports = []

    def training_step(self, batch, batch_idx):
        images, masks, labels = batch
        opt = self.optimizers()
        opt.zero_grad()
        with gp.track() if self.mode != "plain" else torch.enable_grad():
            feat = self.trunk(images)
            seg_loss = F.binary_cross_entropy_with_logits(self.seg(feat), masks)
            cls_loss = F.cross_entropy(self.cls(feat), labels)
        if self.mode == "plain":
            self.manual_backward(seg_loss, retain_graph=True)
        else:
            self.manual_backward(seg_loss, keep=[cls_loss] if self.mode == "explicit" else None)
        self.probe(batch_idx, "middle")
        if self.mode == "plain":
            self.manual_backward(cls_loss)
        else:
            self.manual_backward(cls_loss, keep=[] if self.mode == "explicit" else None)
        opt.step()
        self.log_dict({"seg_loss": seg_loss, "cls_loss": cls_loss}, batch_size=len(images))
        self.probe(batch_idx, "end")

    def backward(self, loss, *args, **kwargs):
        if self.mode == "plain":
            loss.backward(*args, **kwargs)
        else:  # manual_backward ends here, after the precision plugin's scaling
            self.reports.append(gp.backward(loss, *args, **kwargs))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit(model: MultiTask, loader, steps: int, root: str, callbacks=()):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, train_dataloaders=loader)


def measure(mode: str, out_dir: str) -> dict:
    """Two fit steps with ``mode`` in this process; RSS over that before the first step."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)  # no "GPU available: False" lines
    data = TensorDataset(torch.randn(16, 3, 96, 96), (torch.rand(16, 1, 96, 96) > 0.5).float(),
                         torch.randint(0, 10, (16,)))
    model, result = MultiTask(mode), {}

    class Baseline(pl.Callback):
        def on_train_start(self, trainer, module):
            result["base"] = compare.rss()

    def probe(batch_idx, phase):
        if batch_idx == 1:
            result[phase] = compare.rss() - result["base"]

    model.probe = probe
    fit(model, DataLoader(data, batch_size=8), 2, out_dir, [Baseline()])
    params = dict(model.named_parameters())
    compare.save(params, out_dir, mode)
    result["freed"] = [r.bytes_freed for r in model.reports[2:]]
    if mode == "plain":  # the best keep= written out, for the graphprune process's default to be held against
        model.mode, model.probe = "explicit", lambda batch_idx, phase: None
        fit(model, DataLoader(data, batch_size=8), 1, out_dir)
        result["freed_explicit"] = [r.bytes_freed for r in model.reports]
    return result


if __name__ == "__main__":
    compare.main(PATTERN, __file__, measure_one=measure)
