"""The three reference scenarios, each compared with plain PyTorch gradients."""

import copy

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

import graphprune as gp

from conftest import grads_of


def _seed_forward(w):
    x = w + 10
    x1 = x * x
    y1 = x1 * x1
    return x, x1, y1


def _seed_reference():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x, x1, y1 = _seed_forward(w)
    y1.sum().backward(retain_graph=True)
    g1 = w.grad.clone()
    (torch.sqrt(x) / 2).sum().backward()
    return g1, w.grad.clone()


def test_seed_example_keeps_trunk_and_frees_branch():
    g1_ref, g2_ref = _seed_reference()
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x, x1, y1 = _seed_forward(w)
        y1 = y1.sum()
    y1.backward(retain_graph=True)
    assert_close(w.grad, g1_ref)
    del x1  # the user no longer holds x -> x1, so that branch goes too
    report = gp.prune_after(y1)
    assert report.released_nodes == {"MulBackward0": 2}
    assert report.released_tensors == 4
    x2 = torch.sqrt(x)
    y2 = (x2 / 2).sum()
    y2.backward()
    assert_close(w.grad, g2_ref)
    with pytest.raises(gp.ReleasedTensorError, match=r"MulBackward0.*prune_after.*keep="):
        y1.backward()


def test_live_intermediate_inside_the_pruned_graph_is_finished():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x, x1, y1 = _seed_forward(w)
    y1.backward(torch.ones(3), retain_graph=True)
    report = gp.prune_after(y1)  # y1's pass ran through x1: held, but finished
    assert report.released_nodes == {"MulBackward0": 2}
    message = r"The graph of x1 \(tensor of shape \(3,\).*had run through it\). Pass keep=x1 to that call"
    with pytest.raises(gp.ReleasedTensorError, match=message):
        x1.sum().backward()


def test_a_live_intermediate_no_variable_names_is_described_not_misnamed():
    # x1 held only inside a nested dict: the message named it "x", which here is another tensor
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x, x1, y1 = _seed_forward(w)
    state = {"run": {"feature": x1}}
    del x1
    y1.backward(torch.ones(3), retain_graph=True)
    gp.prune_after(y1)
    message = (r"The graph of a tensor that no variable of the nearest frames names \(tensor of shape \(3,\)"
               r".*Pass it as keep= to that")
    with pytest.raises(gp.ReleasedTensorError, match=message):
        state["run"]["feature"].sum().backward()
    assert x.shape == (3,)


def test_a_second_pass_from_the_same_loss_is_told_to_keep_the_loss():
    # gradients by parameter group: the error named no tensor, since the call's own
    # output was no candidate for keep=
    w, v = torch.tensor([1.0, 2.0, 3.0], requires_grad=True), torch.ones(3, requires_grad=True)
    with gp.track():
        loss = (w.exp() * v).sin().sum()
    gp.grad(loss, v)
    message = (r"The graph of loss \(tensor of shape \(\), .*did not keep it \(that call's own output\)\. "
               r"Pass keep=loss to that call")
    with pytest.raises(gp.ReleasedTensorError, match=message):
        gp.grad(loss, w)


def _two_heads_and_their_sum(w):
    x = w.exp()  # the trunk: ExpBackward0 saves x
    l1 = x.sin().cos().sum()
    l2 = x.tanh().sigmoid().sum()
    return x, l1, l2, l1 + l2  # the sum, held for logging


@pytest.mark.parametrize("second", ["backward", "prune_after"])
def test_a_loss_that_a_held_sum_protected_is_finished_once_its_pass_ran(second):
    # gp.backward(l1) with total = l1 + l2 held: total protected l1's node, which so
    # was never marked finished; after del total, l2's prune kept the trunk for l1,
    # "not backpropagated yet", where PyTorch's pass from l2 frees it
    w = torch.linspace(0.1, 1.0, 64, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    _, l1_ref, l2_ref, _ = _two_heads_and_their_sum(w_ref)
    torch.autograd.backward([l1_ref, l2_ref])
    with gp.track():
        x, l1, l2, total = _two_heads_and_their_sum(w)
    with pytest.warns(gp.GraphPruneWarning, match="total"):
        first = gp.backward(l1)
    assert first.released_tensors == 0  # total still reaches all of it
    del total
    if second == "backward":
        last = gp.backward(l2)
    else:
        l2.backward(retain_graph=True)
        last = gp.prune_after(l2)
    assert "ExpBackward0" in last.released_nodes, last  # the trunk goes, as torch's pass from l2 frees it
    assert not any("l1" in k.reason for k in last.kept), last
    assert_close(w.grad, w_ref.grad)


def test_keep_names_a_live_intermediate_to_backpropagate_later():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x, x1, y1 = _seed_forward(w)
    y1.backward(torch.ones(3), retain_graph=True)
    report = gp.prune_after(y1, keep=x1)  # only y1 = x1 * x1 is released
    assert report.released_nodes == {"MulBackward0": 1}
    assert any("keep: tensor of shape (3,)" in k.reason for k in report.kept)
    x1.sum().backward()
    assert_close(w.grad, 4 * (w + 10) ** 3 + 2 * (w + 10))


@pytest.mark.parametrize("way", ["prune_after", "backward", "grad"])
def test_seed_wish_retain_graph_up_to_x(way):
    g1_ref, g2_ref = _seed_reference()
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x, x1, y1 = _seed_forward(w)
        y1 = y1.sum()
    del x1
    if way == "prune_after":
        y1.backward(retain_graph=True)
        report = gp.prune_after(y1, keep=x)
    elif way == "backward":
        report = gp.backward(y1, keep=x)
    else:
        (w.grad,) = gp.grad(y1, w, keep=x)
        report = None
    assert_close(w.grad, g1_ref)
    if report is not None:
        assert report.released_tensors == 4
    (torch.sqrt(x) / 2).sum().backward()
    assert_close(w.grad, g2_ref)
    with pytest.raises(gp.ReleasedTensorError):
        y1.backward()


def test_mean_then_sum_of_shared_node():
    a = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    b = a**2
    c = b * 2
    c.mean().backward(retain_graph=True)
    c.sum().backward()
    expected = a.grad.clone()
    a.grad = None

    with gp.track():
        b = a**2
        c = b * 2
        d = c.mean()
        e = c.sum()
    d.backward(retain_graph=True)
    report = gp.prune_after(d)  # c is alive and e is alive: nothing saved may go
    assert report.released_tensors == 0
    e.backward()
    assert_close(a.grad, expected)


def _multitask_losses(net, inp, target):
    feat = net.trunk(inp)
    loss1 = F.cross_entropy(net.head1(feat), target)
    loss2 = net.head2(feat).mean()
    return feat, loss1, loss2


def test_multitask_two_heads_then_optimizer_step(multitask, images):
    inp, target = images
    reference = copy.deepcopy(multitask)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    _, l1, l2 = _multitask_losses(reference, inp, target)
    l1.backward(retain_graph=True)
    l2.backward()
    opt_ref.step()

    opt = torch.optim.SGD(multitask.parameters(), lr=0.1)
    with gp.track():
        feat, loss1, loss2 = _multitask_losses(multitask, inp, target)
    loss1.backward(retain_graph=True)
    report = gp.prune_after(loss1)
    assert report.released_tensors > 0
    assert report.bytes_kept > 0
    loss2.backward()
    assert_close(grads_of(multitask.parameters()), grads_of(reference.parameters()))
    opt.step()
    for p, q in zip(multitask.parameters(), reference.parameters()):
        assert_close(p, q)
    with pytest.raises(gp.ReleasedTensorError, match="keep="):
        loss1.backward()


def test_multitask_backward_keep_frees_head_during_pass(multitask, images):
    inp, target = images
    reference = copy.deepcopy(multitask)
    _, l1, l2 = _multitask_losses(reference, inp, target)
    (l1 + l2).backward()

    with gp.track():
        feat, loss1, loss2 = _multitask_losses(multitask, inp, target)
    first = gp.backward(loss1, keep=[feat, loss2])
    assert first.released_tensors > 0
    gp.backward(loss2)  # keep=None: nothing else is alive, the whole graph goes
    assert_close(grads_of(multitask.parameters()), grads_of(reference.parameters()))
    with pytest.raises(gp.ReleasedTensorError):
        loss2.backward()


@pytest.mark.parametrize("call", ["grad", "grad_create_graph", "backward"])
def test_a_pass_stopped_at_an_intermediate_keeps_the_graph_below_it_as_torch_does(call):
    # gp.grad(l, z) released the graph below z, which the pass did not run and
    # autograd.grad keeps without retain_graph: z.backward(g) after it raised.
    # autograd.backward(l, inputs=[z]) frees it, and so does gp.backward
    def run(grad, backward):
        torch.manual_seed(0)
        w, v, x = torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True), torch.randn(3, 4)
        with gp.track():
            z = torch.tanh(x @ w)
            loss = (z * v).sin().sum()
        if call == "backward":
            z.retain_grad()
            backward(loss, inputs=[z])
            g = z.grad
        else:
            (g,) = grad(loss, z, create_graph=call == "grad_create_graph")
        z.backward(g.detach())
        return w.grad, v.grad, loss

    if call == "backward":
        for backward in (torch.autograd.backward, gp.backward):
            with pytest.raises(RuntimeError, match="backward through the graph a second time|released"):
                run(None, backward)
        return
    want_w, want_v, _ = run(torch.autograd.grad, None)
    got_w, got_v, loss = run(gp.grad, None)
    torch.testing.assert_close(got_w, want_w)
    assert want_v is None and got_v is None
    kept = [k.reason for k in gp.last_report().kept if "an input the pass stops at" in k.reason]
    assert kept and kept[0].startswith("inputs[0]: tensor of shape (3, 4)")
    if call == "grad":
        with pytest.raises(gp.ReleasedTensorError):
            loss.backward()  # the branch above z was released
