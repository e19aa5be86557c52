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

import gc
import json
import os
import subprocess
import sys
import tempfile

import psutil
import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

MiB = 2**20
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


def rss() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MiB


def measure(mode: str, out_dir: str) -> dict:
    """A warm-up step and a measured step with ``mode``, in this process; RSS over that before both."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    params, run = setup()
    base, result = rss(), {}
    run(mode)  # warm-up: optimizer state, kernels; what a step leaves held is held into the next
    reports = run(mode, lambda phase: result.update({phase: rss() - base}))
    torch.save({**params, **{k + ".grad": p.grad for k, p in params.items()}}, f"{out_dir}/{mode}.pt")
    result["freed"] = [r.bytes_freed for r in reports]
    if mode == "plain":  # the best keep= written out, for the graphprune process's default to be held against
        result["freed_explicit"] = [r.bytes_freed for r in run("explicit")]
    return result


def main(pattern: str):
    """Each strategy in a fresh process, the gradients compared, one line of results."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave the process (DESIGN.md 11)
    with tempfile.TemporaryDirectory() as tmp:
        procs = {m: subprocess.Popen([sys.executable, __file__, m, tmp], env=env, stdout=subprocess.PIPE)
                 for m in ("plain", "graphprune")}
        res = {m: p.communicate()[0] for m, p in procs.items()}
        if any(p.returncode for p in procs.values()):
            sys.exit(f"{pattern}: a measuring process failed")
        torch.testing.assert_close(torch.load(f"{tmp}/graphprune.pt"), torch.load(f"{tmp}/plain.pt"))
    plain, pruned = (json.loads(res[m].splitlines()[-1]) for m in ("plain", "graphprune"))
    default, explicit = ("[" + ", ".join(f"{b / MiB:.1f}" for b in freed) + "]"
                         for freed in (pruned["freed"], plain["freed_explicit"]))
    print(f"{pattern}: gradients equal plain retain_graph=True | RSS over baseline, MiB: "
          f"middle plain={plain['middle']:.1f} graphprune={pruned['middle']:.1f}, "
          f"end plain={plain['end']:.1f} graphprune={pruned['end']:.1f} | "
          f"freed per call, MiB: default={default} explicit keep={explicit}")


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a measuring process: one strategy
        print(json.dumps(measure(*sys.argv[1:])))
    else:
        main(PATTERN)
