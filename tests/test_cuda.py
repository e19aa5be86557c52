"""On a GPU, memory is really given back to the caching allocator."""

import pytest
import torch

import graphprune as gp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MiB = 2**20
N = 64 * MiB // 4


def _branchy(w):
    with gp.track():
        x = w.exp()
        y1 = x.sin().cos().sin().cos().sum()  # 3 branch-only activations of 64 MiB
    return x, y1


def test_prune_after_lowers_allocated_bytes():
    w = torch.randn(N, device="cuda", requires_grad=True)
    x, y1 = _branchy(w)
    y1.backward(retain_graph=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    report = gp.prune_after(y1, keep=x)
    after = torch.cuda.memory_allocated()
    assert report.bytes_freed == 3 * 64 * MiB
    assert before - after == 3 * 64 * MiB
    x.sum().backward()


def test_backward_keep_peak_is_lower_than_retain_graph():
    peaks = {}
    for mode in ("retain", "keep"):
        w = torch.randn(N, device="cuda", requires_grad=True)
        x, y1 = _branchy(w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if mode == "retain":
            y1.backward(retain_graph=True)
            gp.prune_after(y1, keep=x)
        else:
            gp.backward(y1, keep=x)
        peaks[mode] = torch.cuda.max_memory_allocated() - start
        del w, x, y1
    assert peaks["retain"] - peaks["keep"] >= 2 * 64 * MiB, peaks


def test_tracked_step_adds_no_host_device_synchronisation():
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    heads = [torch.nn.Linear(64, 1).cuda() for _ in range(2)]
    inp = torch.randn(32, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with gp.track():
            x = trunk(inp)
            l1, l2 = (h(x).square().mean() for h in heads)
        gp.backward(l1, keep=x)
        l2.backward(retain_graph=True)
        gp.prune_after(l2)
        gp.explain(l2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(p.grad is not None for p in trunk.parameters())


def test_stacked_loss_passes_through_released_heads_add_no_synchronisation():
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    heads = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
             for _ in range(3)]
    inp = torch.randn(32, 64, device="cuda")
    with gp.track():
        x = trunk(inp)
        losses = torch.stack([h(x).square().mean() for h in heads])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # each later pass runs the released heads with zeros: known from routing, never read
        for i in range(3):
            gp.backward(losses[i])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(p.grad is not None for h in heads for p in h.parameters())


def test_plain_pass_through_a_released_head_checks_once_at_its_end():
    w = torch.linspace(0.1, 0.9, 4, device="cuda").requires_grad_()
    with gp.track():
        x = w.exp()
        losses = torch.stack([x.sin().sum(), x.log().sum()])
    gp.backward(losses[0])
    w.grad = None
    losses[1].backward(retain_graph=True)  # deferred: one read when the pass ends
    torch.testing.assert_close(w.grad, torch.ones(4, device="cuda"))
    with pytest.raises(gp.ReleasedTensorError, match="end of the pass"):
        losses.sum().backward()
