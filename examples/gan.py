"""A GAN step: the discriminator's loss on real and fake images, then the generator's loss.

Run: ``python examples/gan.py``. ``fake`` is not detached for the discriminator's loss,
so plain PyTorch backpropagates that loss with ``retain_graph=True`` (the generator's
graph is needed again for the generator's loss) and holds ``fake`` for image logging.
graphprune's ``gp.backward`` frees both discriminator passes during the first pass and
the rest during the second. The one ``keep=`` is the one the keep=None rule asks for:
the generator's loss is built on ``fake`` *after* the first pass has run through it.
The script runs the step in two fresh processes, one per strategy, checks that the
gradients are equal and prints RSS over the baseline in the middle of the step (between
the two passes) and at its end (``fake`` and both losses still held).
"""


import compare
import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

PATTERN = "gan"
Z, IMAGE, HIDDEN, BATCH = 128, 28 * 28, 1024, 1024


def step(G, D, opt_g, opt_d, real, mode, probe=lambda phase: None):
    """One GAN step; ``mode`` is "plain", "graphprune" or "explicit" (the best keep= written out)."""
    reports = []
    with gp.track() if mode != "plain" else torch.enable_grad():
        fake = G(torch.randn(BATCH, Z))  # held until the end of the step, for image logging
        d_real, d_fake = D(real), D(fake)
        loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        opt_d.zero_grad()
        if mode == "plain":
            loss_d.backward(retain_graph=True)
        else:  # keep=fake: loss_g below is built on fake after this pass has run through it
            reports.append(gp.backward(loss_d, keep=fake))
        opt_d.step()
        probe("middle")
        d_fake = D(fake)
        loss_g = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        opt_g.zero_grad()
        if mode == "plain":
            loss_g.backward()
        else:
            reports.append(gp.backward(loss_g, keep=[] if mode == "explicit" else None))
        opt_g.step()
    probe("end")
    return reports


def setup():
    G = nn.Sequential(nn.Linear(Z, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                      nn.Linear(HIDDEN, IMAGE), nn.Tanh())
    D = nn.Sequential(nn.Linear(IMAGE, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, HIDDEN),
                      nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = torch.rand(BATCH, IMAGE) * 2 - 1
    params = dict(nn.ModuleDict(dict(G=G, D=D)).named_parameters())
    return params, lambda mode, probe=lambda phase: None: step(G, D, opt_g, opt_d, real, mode, probe)


if __name__ == "__main__":
    compare.main(PATTERN, __file__, setup)
