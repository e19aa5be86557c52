"""Deep supervision: a small U-Net with a loss at three depths, outputs returned by ``forward``.

Run: ``python examples/deep_supervision.py``. Each depth's loss is backpropagated on its
own (plain PyTorch: ``retain_graph=True`` on all but the last; graphprune: ``gp.backward``
with no ``keep=``, the losses not backpropagated yet keep what they need). The script
runs the step in two fresh processes, one per strategy, checks that the gradients are
equal and prints RSS over the baseline in the middle of the step (after the first loss's
pass) and at its end (the outputs and losses still held, as for logging).
"""


import compare
import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

PATTERN = "deep_supervision"


def block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.enc1, self.enc2, self.enc3 = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.dec2, self.dec1 = block(6 * c, 2 * c), block(3 * c, c)
        self.out1, self.out2, self.out3 = nn.Conv2d(c, 1, 1), nn.Conv2d(2 * c, 1, 1), nn.Conv2d(4 * c, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(e3, scale_factor=2.0), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], 1))
        return self.out1(d1), self.out2(d2), self.out3(e3)  # full, 1/2 and 1/4 resolution


def step(model, optimizer, images, masks, mode, probe=lambda phase: None):
    """One training step; ``mode`` is "plain", "graphprune" or "explicit" (the best keep= written out)."""
    optimizer.zero_grad()
    with gp.track() if mode != "plain" else torch.enable_grad():
        outputs = model(images)
        losses = [F.binary_cross_entropy_with_logits(out, F.adaptive_avg_pool2d(masks, out.shape[-1]))
                  for out in outputs]
    reports = []
    for i, loss in enumerate(losses):
        if mode == "plain":
            loss.backward(retain_graph=i < len(losses) - 1)
        else:
            reports.append(gp.backward(loss, keep=losses[i + 1:] if mode == "explicit" else None))
        if i == 0:
            probe("middle")
    optimizer.step()
    probe("end")  # outputs and losses are still alive here, as in a loop that logs them
    return reports


def setup():
    model = UNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    images, masks = torch.randn(4, 3, 128, 128), (torch.rand(4, 1, 128, 128) > 0.5).float()
    return dict(model.named_parameters()), lambda mode, probe=lambda phase: None: step(
        model, optimizer, images, masks, mode, probe)


if __name__ == "__main__":
    compare.main(PATTERN, __file__, setup)
