"""The README's support table, row by row: what works under graphprune, checked here."""

import re

import pytest
import torch
from torch import nn

import graphprune as gp


def _compiled_steps(use_graphprune: bool, steps: int = 12):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    head = nn.Linear(32, 1)
    ct, ch = torch.compile(trunk, backend="aot_eager"), torch.compile(head, backend="aot_eager")
    released = []
    for _ in range(steps):
        inp = torch.randn(8, 16)
        with gp.track() if use_graphprune else torch.enable_grad():
            x = ct(inp)
            l1, l2 = ch(x).square().mean(), x.sin().mean()
        if use_graphprune:
            released.append(gp.backward(l1).released_nodes)
            gp.backward(l2)
        else:
            l1.backward(retain_graph=True)
            l2.backward()
    grads = [p.grad.clone() for p in (*trunk.parameters(), *head.parameters())]
    return dict(counters["stats"]), sum(counters["graph_break"].values()), released, grads


# Dynamo reads .grad of the non-leaf input while tracing the head, warning from its own internals
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_torch_compile_adds_no_graph_no_break_and_frees_the_compiled_head():
    plain_stats, plain_breaks, _, plain_grads = _compiled_steps(False)
    stats, breaks, released, grads = _compiled_steps(True)
    assert breaks == plain_breaks == 0
    assert stats["unique_graphs"] <= plain_stats["unique_graphs"] + 1, (stats, plain_stats)
    assert all(r.get("CompiledFunctionBackward") == 1 for r in released), released
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p)


def test_data_parallel_on_cpu_runs_the_module_in_this_thread_and_is_tracked():
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    with gp.track():
        x = model(torch.randn(4, 8))
        l1, l2 = x.exp().sum(), x.sum()
    assert gp.backward(l1).released_node_count == 1  # ExpBackward0; the module's graph stays for l2
    l2.backward()



def test_an_older_torch_is_refused_at_import_with_the_release_it_needs():
    # torch 2.10-2.12 imported graphprune and raised where plain PyTorch does not (a prune
    # released a trunk it was told to keep); 2.2-2.9 failed at the first prune, deep in a walk
    from graphprune._requires import require_torch

    for old in ("2.12.1+cu130", "2.9.1", "2.1.2+cu121", "1.13.1"):
        with pytest.raises(ImportError, match=rf"needs torch>=2\.13, and this is torch {re.escape(old)}:"):
            require_torch(old)
    for new in ("2.13.0+cpu", "2.13.0a0+git1234567", "2.14.1", "2.20.0", torch.__version__):
        require_torch(new)


def test_setup_cfg_asks_for_the_torch_the_import_needs():
    import configparser
    import pathlib

    from graphprune._requires import MIN_TORCH

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).parents[1] / "setup.cfg")
    requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    assert f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},<3" in requires
