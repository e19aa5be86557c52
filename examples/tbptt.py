"""Truncated BPTT: an LSTM over a long sequence in chunks, a main and an auxiliary loss per chunk.

Run: ``python examples/tbptt.py``. Each chunk starts from the carried ``(h, c)``, detached;
the chunk's new ``(h, c)`` stays held until the next chunk, as in PyTorch's
word_language_model. The auxiliary loss (predict the next input through a decoder) is
backpropagated first, then the main loss; plain PyTorch needs ``retain_graph=True`` on
the first. graphprune frees the decoder during its own pass and the LSTM during the
main loss's pass, with no ``keep=``: the held ``(h, c)`` are no losses (tensors of more
than one element), so they protect nothing.
The script runs the steps in two fresh processes, one per strategy, checks that the
gradients are equal and prints RSS over the baseline in the middle of a step (between
the two passes) and at its end.
"""


import compare
import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

PATTERN = "tbptt"
BATCH, CHUNK, INPUT, HIDDEN, CLASSES = 64, 50, 64, 512, 10


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(INPUT, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.decoder = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, INPUT))


def step(model, optimizer, chunk, labels, state, mode, probe=lambda phase: None):
    """One chunk; ``mode`` is "plain", "graphprune" or "explicit" (the best keep= written out)."""
    optimizer.zero_grad()
    reports = []
    with gp.track() if mode != "plain" else torch.enable_grad():
        out, state = model.lstm(chunk, state)
        main_loss = F.cross_entropy(model.head(out).flatten(0, 1), labels.flatten())
        aux_loss = F.mse_loss(model.decoder(out[:, :-1]), chunk[:, 1:])  # predict the next input
    if mode == "plain":
        aux_loss.backward(retain_graph=True)
    else:
        reports.append(gp.backward(aux_loss, keep=[main_loss] if mode == "explicit" else None))
    probe("middle")
    if mode == "plain":
        main_loss.backward()
    else:
        reports.append(gp.backward(main_loss, keep=[] if mode == "explicit" else None))
    optimizer.step()
    probe("end")
    return reports, state


def setup():
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sequence, labels = torch.randn(BATCH, 3 * CHUNK, INPUT), torch.randint(0, CLASSES, (BATCH, 3 * CHUNK))
    state = [torch.zeros(1, BATCH, HIDDEN)] * 2
    chunks = iter(range(0, 3 * CHUNK, CHUNK))

    def run(mode, probe=lambda phase: None):
        nonlocal state
        start = next(chunks)
        window = slice(start, start + CHUNK)
        state = tuple(s.detach() for s in state)  # truncate: the carried state starts a new graph
        reports, state = step(model, optimizer, sequence[:, window], labels[:, window], state, mode, probe)
        return reports

    return dict(model.named_parameters()), run


if __name__ == "__main__":
    compare.main(PATTERN, __file__, setup)
