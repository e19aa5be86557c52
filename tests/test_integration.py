"""graphprune beside the rest of PyTorch: custom Functions, checkpoint, save_on_cpu,
double backward, autocast, threads, nesting and exceptions."""


import pytest
import torch
from torch.autograd.graph import save_on_cpu
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import graphprune as gp

from conftest import run_in_threads


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        assert torch.equal(out, x * ctx.k)
        return g * ctx.k, None


def _two_heads(w, head1, head2, track=True):
    """Reference gradients of two heads on one trunk, and graphprune's."""
    x = w.exp()
    head1(x).backward(retain_graph=True)
    head2(x).backward()
    expected = w.grad.clone()
    w.grad = None
    with gp.track():
        x = w.exp()
        y1 = head1(x)
    y1.backward(retain_graph=True)
    report = gp.prune_after(y1, keep=x)  # head 2 is built after the prune: keep its input
    head2(x).backward()
    assert_close(w.grad, expected)
    return y1, report


@pytest.mark.parametrize(
    "fn", [Cube.apply, lambda t: Scale.apply(t, 2.5)], ids=["ctx-forward", "setup_context"]
)
def test_custom_function_in_branch_is_released(fn):
    w = torch.randn(4, requires_grad=True)
    y1, report = _two_heads(w, lambda x: fn(x * 2).sum(), lambda x: x.sin().sum())
    assert report.released_tensors >= 1
    with pytest.raises(gp.ReleasedTensorError):
        y1.backward()


def test_custom_function_in_trunk_is_kept():
    w = torch.randn(4, requires_grad=True)
    with gp.track():
        x = Cube.apply(w * 1.5)
        y1 = x.sin().sum()
    y1.backward(retain_graph=True)
    gp.prune_after(y1, keep=x)
    w.grad = None
    x.sum().backward()
    assert_close(w.grad, 3 * 1.5 * (1.5 * w.detach()) ** 2)


class Recorder:
    """Counts recomputations of a checkpointed function."""

    def __init__(self):
        self.calls = 0

    def __call__(self, t):
        self.calls += 1
        return (t.sin() * t).cos()


def test_checkpoint_region_is_left_alone_and_not_recomputed():
    w = torch.randn(5, requires_grad=True)
    fn = Recorder()
    with gp.track():
        x = w * 2
        side = (x * x).sum()  # the last node built before the checkpoint
        c = checkpoint(fn, x, use_reentrant=False)
        y1 = c.exp().sum()
    assert fn.calls == 1
    report = gp.explain(y1)
    assert fn.calls == 1, "explain must not trigger checkpoint recomputation"
    assert [k.nodes for k in report.kept if "other saved-tensor hooks" in k.reason] == [3]
    side.backward(retain_graph=True)
    gp.prune_after(side)  # must not release the checkpoint's saved input
    y1.backward()
    expected_w = w.detach().clone().requires_grad_()
    ex = expected_w * 2
    ((ex * ex).sum() + (ex.sin() * ex).cos().exp().sum()).backward()
    assert_close(w.grad, expected_w.grad)


def test_checkpoint_branch_pruned_after_its_backward():
    w = torch.randn(5, requires_grad=True)
    with gp.track():
        x = w * 2
        y1 = checkpoint(Recorder(), x, use_reentrant=False).sum()
    y1.backward(retain_graph=True)
    report = gp.prune_after(y1, keep=x)
    assert "graphprune.prune_after" in str(report)
    x.sum().backward()


def test_save_on_cpu_region_is_left_alone():
    w = torch.randn(5, requires_grad=True)
    with gp.track():
        x = w.exp()
        with save_on_cpu():
            h = x.sin() * x
        y1 = h.sum()
    report = gp.explain(y1, keep=x)
    assert any("other saved-tensor hooks" in k.reason for k in report.kept)
    y1.backward()
    expected = (w.exp().cos() * w.exp() + w.exp().sin()) * w.exp()
    assert_close(w.grad, expected.detach())


def test_double_backward_with_create_graph():
    w = torch.randn(4, requires_grad=True)
    x = w.exp()
    (g,) = torch.autograd.grad((x**3).sum(), w, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), w)
    with gp.track():
        x = w.exp()
        y = (x**3).sum()
        (g2,) = torch.autograd.grad(y, w, create_graph=True)
        penalty = g2.sum()
    (gg2,) = torch.autograd.grad(penalty, w, retain_graph=True)
    assert_close(g2, g)
    assert_close(gg2, gg)
    gp.prune_after(penalty, keep=x)
    with pytest.raises(gp.ReleasedTensorError):
        torch.autograd.grad(penalty, w)


def test_grad_with_create_graph_keeps_trunk():
    w = torch.randn(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = (x * x).sum()
    (g,) = gp.grad(y1, w, keep=x, create_graph=True)
    assert_close(g, 2 * w.detach().exp() ** 2)
    x.sum().backward()
    assert_close(w.grad, w.detach().exp())


def test_autocast_bfloat16_matches_plain():
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    inp = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feat = lin1(inp)
        lin2(feat).float().sum().backward(retain_graph=True)
        feat.float().pow(2).sum().backward()
    expected = [p.grad.clone() for p in lin1.parameters()]
    lin1.zero_grad(), lin2.zero_grad()
    with gp.track(), torch.autocast("cpu", dtype=torch.bfloat16):
        feat = lin1(inp)
        y1 = lin2(feat).float().sum()
    y1.backward(retain_graph=True)
    assert gp.prune_after(y1, keep=feat).released_tensors > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feat.float().pow(2).sum().backward()
    assert_close([p.grad for p in lin1.parameters()], expected)


def test_two_threads_each_with_a_tape():
    results = {}

    def work(i):
        w = torch.full((64,), float(i + 1), requires_grad=True)
        for _ in range(20):
            w.grad = None
            with gp.track():
                x = w.exp() * (i + 1)
                y1 = (x.sin() * x).sum()
            y1.backward(retain_graph=True)
            report = gp.prune_after(y1, keep=x)
            assert report.released_tensors == 3, report
            x.sum().backward()
        results[i] = w.grad.clone()

    assert not run_in_threads(work)
    for i in range(2):
        w = torch.full((64,), float(i + 1), requires_grad=True)
        x = w.exp() * (i + 1)
        (x.sin() * x).sum().backward(retain_graph=True)
        x.sum().backward()
        assert_close(results[i], w.grad)


def test_exception_inside_track_restores_hooks():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="model failed"):
        with gp.track():
            y = (w * 2).sum()
            raise ValueError(f"model failed at {y.item():.1f}")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    s = w.sigmoid()
    s.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):  # PyTorch's own check is back
        s.sum().backward()


def test_nested_tapes_and_reuse_error():
    w = torch.randn(3, requires_grad=True)
    with gp.track() as outer:
        x = w.exp()
        with gp.track() as inner:
            y1 = (x * x).sum()
        with pytest.raises(RuntimeError, match="already active"):
            outer.__enter__()
    assert {d["op"] for _, d in inner.graph().nodes(data=True)} >= {"MulBackward0"}
    assert "ExpBackward0" in {d["op"] for _, d in outer.graph().nodes(data=True)}
    y1.backward(retain_graph=True)
    assert gp.prune_after(y1, keep=x).released_tensors == 2
    x.sum().backward()


def test_prune_after_autograd_grad_pass():
    w = torch.randn(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = (x * x).sum()
    torch.autograd.grad(y1, w, retain_graph=True)
    assert gp.prune_after(y1, keep=x).released_tensors == 2
    (gx,) = torch.autograd.grad(x.sum(), w)
    assert_close(gx, w.detach().exp())


def test_backward_with_inputs_releases_unreached_branch_at_end():
    w = torch.randn(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        mid = x.sin()
        y1 = (mid * mid).sum()
    report = gp.backward(y1, keep=x, inputs=[mid])
    assert report.released_tensors == 3  # SinBackward0 was not run, and still released
    assert mid.grad is not None and w.grad is None
    x.sum().backward()
    assert_close(w.grad, w.detach().exp())


def test_backward_failure_keeps_unused_tensors():
    w = torch.randn(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = x.sin()
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar"):
        gp.backward(y1, keep=x)
    y1.sum().backward()  # nothing was lost
    assert_close(w.grad, (w.exp().cos() * w.exp()).detach())
