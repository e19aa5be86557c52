"""graphprune.distributed.backward_each under DDP and FSDP2: 2 gloo ranks on 127.0.0.1.

The ranks run ``examples/ddp_multitask.py`` under torchrun: two SGD steps of a
two-head model, one pass per task, each rank training on its own data; each rank
compares its parameters with a single-process reference trained on every rank's data
(``torch.testing.assert_close``) and prints a line when they are equal.
"""

from __future__ import annotations

import copy
import gc
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import graphprune as gp
import graphprune.distributed as gpd

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ddp_multitask.py"
WRAPS = ["ddp", "ddp-find-unused", "ddp-bucket-view", "fsdp2", "fsdp2-one-group"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def torchrun_output() -> str:
    """One torchrun of the example for every wrapping (one start-up cost for all)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(EXAMPLE),
           "--wrap", ",".join(WRAPS), "--steps", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("wrap", WRAPS)
def test_every_rank_equals_the_single_process_reference(torchrun_output, wrap):
    for rank in (0, 1):
        assert f"[{wrap}] rank {rank}: 2 steps, parameters equal the single-process reference" in \
            torchrun_output, torchrun_output


def test_each_pass_frees_its_own_head(torchrun_output):
    # rank 0 prints the reports: the first pass freed the classification head
    lines = [line for line in torchrun_output.splitlines() if line.startswith("[ddp] step")]
    assert len(lines) == 2, torchrun_output
    assert all("pass 0: 5 node(s)" in line and "pass 1: 8 node(s)" in line for line in lines), lines


def test_the_example_asks_for_torchrun():
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert proc.returncode != 0 and "torchrun --nproc_per_node=2" in proc.stderr


def _loss():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        return (w * 2).sum()


@pytest.mark.parametrize("losses, error, match", [
    ([], ValueError, r"losses is empty"),
    (torch.ones(2, requires_grad=True).sum(), TypeError, r"losses must be a list or tuple .* got a tensor"),
    ((x for x in ()), TypeError, r"losses must be a list or tuple .* got generator"),
    ([torch.ones(2, requires_grad=True)], ValueError, r"losses\[0\] has no grad_fn \(it is a leaf\)"),
    (["loss"], TypeError, r"losses\[0\] must be a torch.Tensor, got str"),
])
def test_bad_losses_are_named(losses, error, match):
    with pytest.raises(error, match=match):
        gpd.backward_each(nn.Linear(2, 2), losses)



def test_what_a_later_pass_would_refuse_is_refused_before_any_pass():
    # a non-scalar loss without its gradient, a loss given twice: they failed in the last
    # pass, after the earlier ones had released their heads and written .grad
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        la, lb = x.sin().sum(), x.cos()
    message = r"losses\[1\] has shape \(3,\): a gradient can be made implicitly only for a scalar; pass its"
    with pytest.raises(ValueError, match=message):
        gpd.backward_each(nn.Linear(2, 2), [la, lb])
    with pytest.raises(ValueError, match=r"losses\[1\] is losses\[0\]: pass it once"):
        gpd.backward_each(nn.Linear(2, 2), [la, la])
    assert w.grad is None
    torch.autograd.backward([la, lb.sum()])  # nothing was released

def test_grad_tensors_need_one_entry_per_loss():
    with pytest.raises(ValueError, match=r"grad_tensors must hold one entry per loss \(2\), got 1 item"):
        gpd.backward_each(nn.Linear(2, 2), [_loss(), _loss()], [None])


def test_a_plain_module_is_refused():
    with pytest.raises(TypeError, match=r"model must be the DistributedDataParallel wrapper .* got Linear\. "
                       r"Without a distributed wrapper, call graphprune.backward"):
        gpd.backward_each(nn.Linear(2, 2), [_loss()])


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process, to build DDP models."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # DDP's reducer sits in reference cycles: drop it while the group is up
        dist.destroy_process_group()


def test_ddp_errors(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"got Linear\. "):  # the inner module
        gpd.backward_each(ddp.module, [_loss()])
    with pytest.raises(TypeError, match=r"got Sequential \(it contains one: pass that module\)"):
        gpd.backward_each(nn.Sequential(ddp), [_loss()])
    static = DDP(nn.Linear(2, 2), static_graph=True)
    with gp.track():
        out = static(torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"static_graph=True\) is not supported"):
        gpd.backward_each(static, [out.sum(), out.mean()])
    del ddp, static, out


def test_ddp_one_rank_gradients_equal_one_plain_pass(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def losses_of(m, x):
        feat = m["trunk"](x).tanh()
        return [m["head1"](feat).square().mean(), m["head2"](feat).exp().mean()]

    torch.manual_seed(0)
    model = nn.ModuleDict(dict(trunk=nn.Linear(4, 8), head1=nn.Linear(8, 1), head2=nn.Linear(8, 1)))
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    x = torch.randn(5, 4)
    sum(losses_of(reference, x)).backward()
    for _ in range(2):  # the second step would raise if the first one's reduction had not finished
        model.zero_grad()
        with gp.track():
            losses = losses_of(ddp.module, x)
        reports = gpd.backward_each(ddp, losses)
        assert [r.released_node_count > 0 for r in reports] == [True, True]
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    del ddp


def test_accumulate_takes_a_gradient_laid_out_like_the_parameter_and_copies_others():
    p = torch.zeros(2, 3, requires_grad=True)
    own = torch.ones(2, 3)
    gpd._accumulate(p, own)
    assert p.grad is own
    q = torch.zeros(2, 3, requires_grad=True)
    gpd._accumulate(q, torch.ones(()).expand(2, 3))  # zero-stride: AccumulateGrad would clone it
    assert q.grad.stride() == q.stride()
    gpd._accumulate(q, torch.ones(2, 3))
    torch.testing.assert_close(q.grad, torch.full((2, 3), 2.0))
    r = torch.zeros(3, requires_grad=True)
    flat = torch.arange(6.0)
    gpd._accumulate(r, flat[3:])  # a view of a larger buffer: not kept alive through .grad
    assert r.grad._base is None and r.grad.tolist() == [3.0, 4.0, 5.0]



def _trunk_and_heads(embedding: bool = False):
    torch.manual_seed(0)
    trunk = nn.EmbeddingBag(10, 4, sparse=True, mode="sum") if embedding else nn.Linear(4, 8)
    width = 4 if embedding else 8
    return nn.ModuleDict(dict(trunk=trunk, head1=nn.Linear(width, 1), head2=nn.Linear(width, 1)))


def _two_losses(m, x):
    feat = m["trunk"](x).tanh()
    return [m["head1"](feat).square().mean(), m["head2"](feat).exp().mean()]


def test_a_leaf_outside_the_wrapper_gets_the_gradient_of_every_loss(one_rank_group):
    """NOTE [ DDP: the last pass covers every parameter once ], 4.: uncertainty weighting's
    log-variances, kept outside DDP, got only the last loss's gradient (the earlier passes
    asked autograd.grad for the wrapper's parameters only)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x = _trunk_and_heads(), torch.randn(5, 4)
    reference = copy.deepcopy(model)
    log_var, log_var_ref = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)

    def weighted(losses, s):
        return [loss * torch.exp(-s[i]) + s[i] for i, loss in enumerate(losses)]

    sum(weighted(_two_losses(reference, x), log_var_ref)).backward()
    ddp = DDP(model)
    with gp.track():
        losses = weighted(_two_losses(ddp.module, x), log_var)
    gpd.backward_each(ddp, losses)
    torch.testing.assert_close(log_var.grad, log_var_ref.grad)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    del ddp


def test_a_reentrant_checkpoint_is_refused_before_any_pass(one_rank_group):
    # autograd.grad does not run its region for the parameters inside: their gradients from
    # the earlier losses were lost, in silence
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    model = _trunk_and_heads()
    ddp = DDP(model)
    with gp.track():
        feat = checkpoint(model["trunk"], torch.randn(5, 4, requires_grad=True), use_reentrant=True).tanh()
        losses = [model["head1"](feat).square().mean(), model["head2"](feat).exp().mean()]
    with pytest.raises(ValueError, match=r"reentrant checkpoint .* use_reentrant=False\)"):
        gpd.backward_each(ddp, losses)
    assert all(p.grad is None for p in model.parameters())
    del ddp


def test_a_sparse_embedding_s_gradients_are_summed_and_synchronised(one_rank_group):
    # the earlier pass's sparse gradient was copied into a dense tensor (copy_ raised), and
    # the zero root gave DDP a dense gradient for a parameter whose gradients are sparse
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x = _trunk_and_heads(embedding=True), torch.randint(0, 10, (5, 3))
    reference = copy.deepcopy(model)
    sum(_two_losses(reference, x)).backward()
    ddp = DDP(model)
    for _ in range(2):  # the second step would raise if the first one's reduction had not finished
        model.zero_grad(set_to_none=True)
        with gp.track():
            losses = _two_losses(ddp.module, x)
        gpd.backward_each(ddp, losses)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense())
    del ddp
