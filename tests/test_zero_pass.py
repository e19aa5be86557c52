"""Later passes through released nodes with all-zero gradients (DESIGN.md fact 9).

``losses = torch.stack([l0, l1, ...])``: ``losses[1].backward()`` runs head 0's
nodes too, with zero gradients. Once head 0 is pruned, that must still work.
"""

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import graphprune as gp

from _subprocess import run_script

HEADS = {
    "sin": lambda x: x.sin().sum(),
    "div": lambda x: (x / (x - 0.5)).sum(),  # on zero placeholders: 0 / 0 = NaN
    "log": lambda x: x.log().sum(),  # likewise
    "acos": lambda x: (x * 0.1).acos().sum(),
}


def _stacked(w, heads):
    x = w.exp()
    per_head = [h(x) for h in heads]
    return x, per_head, torch.stack(per_head)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_stacked_losses_each_backward_matches_plain(name):
    heads = [HEADS[name], lambda x: (x * x).sum(), lambda x: x.tanh().sum()]
    w0 = torch.linspace(-1.0, 0.3, 5)
    w = w0.clone().requires_grad_()
    _, _, losses = _stacked(w, heads)
    expected = [torch.autograd.grad(losses[i], w, retain_graph=True)[0] for i in range(len(heads))]

    w = w0.clone().requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, heads)
    for i in range(len(heads)):
        (got,) = torch.autograd.grad(losses[i], w, retain_graph=True)
        assert_close(got, expected[i])
        report = gp.prune_after(per_head[i], keep=[x, *per_head[i + 1 :]])
        assert report.released_tensors >= 1


def _pruned_head_0(w):
    """Two stacked heads, head 0 (``sin`` of ``x``: its node saves ``x``) backpropagated
    and pruned; returns ``(losses, the output of head 0's released node)``."""
    with gp.track():
        x = w.exp()
        s = x.sin()
        losses = torch.stack([s.sum(), (x * x).sum()])
    losses[0].backward(retain_graph=True)
    gp.prune_after(losses[0])
    return losses, s


def test_the_guard_sees_the_gradient_a_user_hook_made_nonzero():
    # NOTE [ A guard registered when first needed ]: the check runs after every tensor
    # hook, one the user registered after the prune included: plain PyTorch would
    # compute with this gradient, which the released node can no longer do
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    losses, s = _pruned_head_0(w)
    s.register_hook(lambda g: g + 1)
    with pytest.raises(gp.ReleasedTensorError, match="SinBackward0"):
        losses[1].backward(retain_graph=True)


def test_the_guard_sees_the_gradient_a_user_hook_made_zero():
    w0 = torch.linspace(0.1, 0.9, 4)
    w = w0.clone().requires_grad_()
    losses, s = _pruned_head_0(w)
    s.register_hook(torch.zeros_like)
    w.grad = None
    losses.sum().backward()  # head 0 gets ones, which the hook makes zeros
    assert_close(w.grad, 2 * w0.exp() ** 2)  # head 1's alone, as in plain PyTorch


def test_nonzero_gradient_into_released_node_still_raises():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, [HEADS["sin"], lambda t: (t * t).sum()])
    losses[0].backward(retain_graph=True)
    gp.prune_after(per_head[0], keep=[x, per_head[1]])
    w.grad = None
    losses[1].backward(retain_graph=True)  # head 0 gets zeros: fine
    assert_close(w.grad, 2 * w.detach().exp() ** 2)
    with pytest.raises(gp.ReleasedTensorError, match="SinBackward0"):
        losses.sum().backward()  # head 0 gets ones: its tensors are gone


@pytest.fixture
def deferred(monkeypatch):
    """The deferred check of devices other than the CPU, exercised on the CPU."""
    from graphprune import _zero

    monkeypatch.setattr(_zero, "IMMEDIATE", set())


def _stacked_heads_one_released():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, [HEADS["sin"], HEADS["log"], lambda t: (t * t).sum()])
    gp.backward(losses[0])  # head 0 is released; losses[1:] keep the rest
    w.grad = None
    return w, losses


def test_a_pass_that_routing_says_sends_zeros_reads_no_gradient_value_off_the_cpu(monkeypatch, deferred):
    # NOTE [ Zeros known without looking ]: on a GPU a read would wait for the device
    w, losses = _stacked_heads_one_released()
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k))
    gp.backward(losses[1])  # head 0 is off the route: marked zero-only before the pass
    monkeypatch.undo()
    assert reads == []
    assert_close(w.grad, torch.ones(4))  # d/dw log(exp(w))


def test_a_pass_that_routing_says_sends_zeros_reads_them_on_the_cpu(monkeypatch):
    # NOTE [ Zeros read where reading is free ]: what routing cannot see still raises
    w, losses = _stacked_heads_one_released()
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k))
    gp.backward(losses[1])
    monkeypatch.undo()
    assert reads
    assert_close(w.grad, torch.ones(4))


def _released_head_0_under(hook_it, prune=True):
    """Head 0 of two stacked losses released by a pass of ``gp.backward`` (``prune``;
    else plain PyTorch's retained pass), with ``hook_it(b)`` run on head 0's ``b``, made
    after the ``track()`` block, as losses often are; then the pass from ``losses[1]``
    (``gp.backward``'s, which routing tells that head 0 gets zeros only): its ``w.grad``."""
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track() if prune else contextlib.nullcontext():
        x = w.exp()
        a = x.sin()  # its node saves x: released
    b = a * 3.0
    hook_it(b)
    losses = torch.stack([b.sum(), (x * x).sum()])
    if prune:
        gp.backward(losses[0])
        w.grad = None
        gp.backward(losses[1])  # routing: head 0 gets zeros only
    else:
        losses[0].backward(retain_graph=True)
        w.grad = None
        losses[1].backward(retain_graph=True)
    return w.grad


def _add_half(grads):
    return tuple(None if g is None else g + 0.5 for g in grads)


HOOKS_GRAPHPRUNE_CANNOT_SEE = {
    "a tensor hook on a tensor made after the block": lambda b: b.register_hook(lambda g: g + 0.5),
    "a Node post-hook above the released node": lambda b: b.grad_fn.register_hook(
        lambda grad_inputs, grad_outputs: _add_half(grad_inputs)),
}


@pytest.mark.parametrize("name", sorted(HOOKS_GRAPHPRUNE_CANNOT_SEE))
def test_a_hook_that_makes_a_routed_zero_nonzero_raises_not_a_wrong_gradient(name):
    # reproduced in review: gp.backward(losses[1]) gave head 1's gradient alone, where plain
    # PyTorch adds what the hook sent through head 0
    hook_it = HOOKS_GRAPHPRUNE_CANNOT_SEE[name]
    plain = _released_head_0_under(hook_it, prune=False)
    assert not torch.equal(plain, _released_head_0_under(lambda b: None, prune=False))
    with pytest.raises(gp.ReleasedTensorError, match="SinBackward0"):
        _released_head_0_under(hook_it)


def test_a_node_pre_hook_registered_after_the_guard_is_checked_after_it():
    # NOTE [ Pre-hooks after the guard ]: a first zero pass registers the guard; a
    # pre-hook registered after it runs after it, and makes the zeros non-zero
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    losses, s = _pruned_head_0(w)
    losses[1].backward(retain_graph=True)  # zeros into head 0: the guard is registered
    s.grad_fn.register_prehook(_add_half)
    with pytest.raises(gp.ReleasedTensorError, match="SinBackward0"):
        losses[1].backward(retain_graph=True)


def test_a_node_pre_hook_registered_after_the_guard_that_keeps_zeros_gives_plain_gradients():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    losses, s = _pruned_head_0(w)
    losses[1].backward(retain_graph=True)
    s.grad_fn.register_prehook(lambda grads: None)
    w.grad = None
    losses[1].backward(retain_graph=True)
    assert_close(w.grad, 2 * w.detach().exp() ** 2)


@pytest.mark.parametrize("call", ["torch.autograd.grad", "gp.grad"])
def test_a_zero_gradient_that_depends_on_a_weight_raises_in_a_create_graph_pass(call):
    # NOTE [ Zeros whose derivative is not zero ]: reproduced in review, a GradNorm-like
    # step gave c.grad[0] == 0 where plain PyTorch gives the derivative through head 0
    def step(prune):
        w = torch.linspace(0.1, 0.9, 4).requires_grad_()
        c = torch.tensor([0.0, 1.0], requires_grad=True)  # task 0's weight at 0
        with gp.track() if prune else contextlib.nullcontext():
            x = w.exp()
            losses = torch.stack([x.sin().sum(), (x * x).sum()])
        if prune:
            gp.backward(losses[0])
        else:
            losses[0].backward(retain_graph=True)
        grad = gp.grad if prune and call == "gp.grad" else torch.autograd.grad
        kwargs = {"keep": losses} if grad is gp.grad else {"retain_graph": True}
        (g,) = grad((c * losses).sum(), w, create_graph=True, **kwargs)
        g.norm().backward()
        return c.grad

    assert step(prune=False)[0] != 0  # the derivative through head 0
    with pytest.raises(gp.ReleasedTensorError, match="create_graph=True"):
        step(prune=True)


def test_a_create_graph_pass_that_routing_says_sends_zeros_gives_plain_gradients():
    # an entry a stack gives no gradient to is zero whatever it depends on, its derivative too
    def step(prune):
        w = torch.linspace(0.1, 0.9, 4).requires_grad_()
        with gp.track() if prune else contextlib.nullcontext():
            x = w.exp()
            losses = torch.stack([x.sin().sum(), (x * x).sum()])
        if prune:
            gp.backward(losses[0])
            (g,) = gp.grad(losses[1], w, create_graph=True, keep=losses[1])
        else:
            losses[0].backward(retain_graph=True)
            (g,) = torch.autograd.grad(losses[1], w, create_graph=True, retain_graph=True)
        w.grad = None
        g.sum().backward()
        return g.detach(), w.grad

    for got, want in zip(step(prune=True), step(prune=False)):
        assert_close(got, want)


def test_a_plain_pass_still_checks_released_nodes_for_zeros(monkeypatch):
    w, losses = _stacked_heads_one_released()
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k))
    losses[1].backward(retain_graph=True)  # not graphprune's pass: no routing known, the data check runs
    monkeypatch.undo()
    assert reads


def test_deferred_check_lets_zero_passes_through_and_gives_plain_gradients(deferred):
    w, losses = _stacked_heads_one_released()
    losses[1].backward(retain_graph=True)  # plain pass: head 0 gets zeros, checked at the end
    assert_close(w.grad, torch.ones(4))


def test_deferred_check_raises_at_the_end_of_the_pass_naming_the_node(deferred):
    w, losses = _stacked_heads_one_released()
    with pytest.raises(gp.ReleasedTensorError, match=r"non-zero gradient into SinBackward0.*end of the pass"):
        losses.sum().backward(retain_graph=True)


def _deep_head(t):
    """A head of saving nodes one after another, each NaN on a zero placeholder."""
    return (((t * 0.3).acos() / (3.0 - t)).log().sin() / t).sum()


def test_zero_passes_through_a_deep_released_head_match_plain():
    w0 = torch.linspace(0.1, 0.9, 4)
    heads = [_deep_head, lambda t: (t * t).sum(), lambda t: t.tanh().sum()]
    w = w0.clone().requires_grad_()
    _, _, losses = _stacked(w, heads)
    expected = [torch.autograd.grad(losses[i], w, retain_graph=True)[0] for i in (1, 2)]
    w = w0.clone().requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, heads)
    losses[0].backward(retain_graph=True)
    gp.prune_after(per_head[0], keep=[x, *per_head[1:]])
    for i, want in zip((1, 2), expected):  # head 0 gets zeros, twice: placeholders, zeroed outputs
        (got,) = torch.autograd.grad(losses[i], w, retain_graph=True)
        assert_close(got, want)
    with pytest.raises(gp.ReleasedTensorError):
        losses.sum().backward()


# Each of the cases below broke under a design (tried, reviewed, reverted) that guarded
# only the released nodes a pass enters a branch by and let those guard the nodes below
# them as the pass ran: some raised where plain PyTorch computes zeros, two gave NaN.
def _zeros_after(build, prunes, zero_pass):
    """Build under track(), run ``prunes(*built)``, then ``zero_pass(*built)``; the
    gradient equals plain PyTorch's (zeros)."""
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        built = build(w)
    prunes(*built)
    w.grad = None
    zero_pass(*built)
    assert_close(w.grad, torch.zeros(4))


@pytest.mark.parametrize("join", ["view", "scalar_mul", "checkpoint"])
def test_a_zero_pass_through_the_regions_of_two_prunes_joined_by_a_node_that_lost_nothing_gives_zeros(join):
    from torch.utils.checkpoint import checkpoint

    def build(w):
        x = w.exp().sin()  # dies: the trunk's top is reached from the heads only
        if join == "view":  # saves nothing
            return _deep_head(x.view(2, 2)), (x * x).sum()
        if join == "scalar_mul":  # saves a wrapped number only: never released
            top = (x * 0.5).tanh()
        else:  # saved under checkpoint's hooks: kept
            top = checkpoint(lambda t: t.cos().exp(), x.view(2, 2), use_reentrant=False).tanh()
        return top.sum(), (x * x).sum()

    def prunes(l0, l1):
        l0.backward(retain_graph=True)
        gp.prune_after(l0, keep=l1)
        l1.backward(retain_graph=True)
        gp.prune_after(l1, keep=[])  # the trunk goes too

    _zeros_after(build, prunes, lambda l0, l1: (l0 * 0.0).backward())


@pytest.mark.parametrize("saving", [True, False])
def test_a_zero_pass_from_a_live_metric_of_a_dead_intermediate_of_a_released_head_gives_zeros(saving):
    def build(w):
        x = w.exp()
        h = x.sin()  # dies: the metric enters the head below its top
        metric = h.exp().tanh() if saving else -(h + 1.0)
        return x, h.cos().sum(), metric

    def prunes(x, l0, metric):
        l0.backward(retain_graph=True)
        gp.prune_after(l0, keep=x)

    _zeros_after(build, prunes, lambda x, l0, metric: (metric * 0.0).sum().backward())


def test_a_zero_pass_from_a_tensor_made_outside_track_from_a_released_heads_intermediate_gives_zeros():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x = w.exp()
        h = x.sin()
        l0 = h.cos().sum()
    l2 = h.sum() * 0.0  # outside track(): no prune sees it
    del h
    l0.backward(retain_graph=True)
    gp.prune_after(l0, keep=x)
    w.grad = None
    l2.backward()
    assert_close(w.grad, torch.zeros(4))


def test_gp_backward_on_stacked_losses_after_two_prunes_gives_zeros_not_nan():
    def build(w):
        x = w.log()  # its placeholder is 0: 0 / 0 = NaN unless the outputs are zeroed
        l0 = (x * 0.5).tanh().sum()
        l1 = (x * x).sum()
        return l0, l1, torch.stack([l0, (w * 0.0).sum()])

    def prunes(l0, l1, losses):
        gp.backward(losses[0])
        gp.backward(l1)

    _zeros_after(build, prunes, lambda l0, l1, losses: gp.backward(losses[1]))


def _square(x):
    return x[:, :4].reshape(4, 4) + 4 * torch.eye(4)


# heads whose released node saved an integer tensor: indices along a dim of size 1, where
# only 0 is in range, and LU pivots, which are 1-based
INTEGER_SAVING_HEADS = {
    "max_indices": lambda x: x[:, :1].max(dim=1).values.sum(),
    "sort_indices": lambda x: x[:, :1].sort(dim=1).values.sum(),
    "topk_indices": lambda x: x[:, :1].topk(1, dim=1).values.sum(),
    "gather_index": lambda x: x[:, :1].gather(1, torch.zeros(4, 1, dtype=torch.long)).sum(),
    "nll_target": lambda x: F.nll_loss(x[:, :1].log_softmax(1), torch.zeros(4, dtype=torch.long)),
    "det_pivots": lambda x: torch.linalg.det(_square(x)),
    "solve_pivots": lambda x: torch.linalg.solve(_square(x), torch.ones(4)).sum(),
    "lu_factor_pivots": lambda x: torch.linalg.lu_factor(_square(x))[0].sum(),
}


def _zero_pass_grad(head, tracked):
    """``w.grad`` of ``losses[1]``'s pass, ``losses = stack([head(x), ...])``, after
    ``losses[0]``'s pass (and, tracked, its prune): ``head`` runs with zeros."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    with gp.track() if tracked else contextlib.nullcontext():
        x = w * 2
        losses = torch.stack([head(x), x.sin().sum()])
    losses[0].backward(retain_graph=True)
    if tracked:
        would = gp.explain(losses[0])
        report = gp.prune_after(losses[0])
        assert report.released_tensors >= 1
        assert (report.released_nodes, report.bytes_freed) == (would.released_nodes, would.bytes_freed)
    w.grad = None
    losses[1].backward()  # head 0's released nodes run with zeros, on placeholders
    return w.grad


@pytest.mark.parametrize("name", sorted(INTEGER_SAVING_HEADS))
def test_a_zero_pass_through_a_released_node_that_saved_integers_matches_plain(name):
    head = INTEGER_SAVING_HEADS[name]
    assert_close(_zero_pass_grad(head, tracked=True), _zero_pass_grad(head, tracked=False))


def _assign_masked(x):
    z = torch.zeros(4, 4)
    z[x[:, 0] > 0] = x[x[:, 0] > 0].exp()
    return z.sum()


_MASK = torch.tensor([True, False, True, True])
# heads that saved a boolean mask (NOTE [ Masks stay ] in _zero.py): a placeholder cannot
# give the kernel the mask's count of True entries
MASK_SAVING_HEADS = {
    "masked_token_loss": lambda x: F.cross_entropy(x[_MASK], torch.tensor([1, 0, 3])),
    "positive_entries": lambda x: x[x > 0].exp().sum(),
    "masked_assignment": _assign_masked,
    "where": lambda x: torch.where(x > 0, x.exp(), x.sin()).sum(),
}


@pytest.mark.parametrize("name", sorted(MASK_SAVING_HEADS))
def test_a_zero_pass_through_a_released_head_that_saved_a_boolean_mask_matches_plain(name):
    head = MASK_SAVING_HEADS[name]  # the masked node runs on its own mask
    assert_close(_zero_pass_grad(head, tracked=True), _zero_pass_grad(head, tracked=False))


def test_a_prune_frees_no_boolean_mask_and_counts_none():
    w = torch.randn(1000, requires_grad=True)
    with gp.track():
        x = w * 2
        l0 = x[x > 0].exp().sum()  # IndexBackward saves the mask only; ExpBackward its result
        l1 = x.sin().sum()  # noqa: F841 (a pending loss: the trunk x is kept)
    l0.backward(retain_graph=True)
    report = gp.prune_after(l0)
    assert report.released_nodes == {"ExpBackward0": 1}
    assert report.bytes_freed == 4 * int((x > 0).sum())  # the exp's result, not the mask's 1000 B


def test_graphprune_imported_under_inference_mode_and_a_default_device_still_guards():
    # the shared hooks of NOTE [ A guard registered when first needed ] hang on a tensor
    # made at import: whatever mode or default device the import ran under
    out = run_script(
        """
        import json, torch
        with torch.inference_mode(), torch.device("meta"):
            import graphprune as gp
        w = torch.linspace(0.1, 0.9, 4).requires_grad_()
        with gp.track():
            x = w.exp()
            losses = torch.stack([x.sin().sum(), (x * x).sum()])
        losses[0].backward(retain_graph=True)
        released = gp.prune_after(losses[0]).released_tensors
        w.grad = None
        losses[1].backward(retain_graph=True)  # a zero pass through the released head
        try:
            losses.sum().backward()
            raised = False
        except gp.ReleasedTensorError:
            raised = True
        print(json.dumps(dict(released=released, grad=w.grad.tolist(), raised=raised)))
        """
    )
    assert out["released"] >= 1 and out["raised"]
    assert_close(torch.tensor(out["grad"]), 2 * torch.linspace(0.1, 0.9, 4).exp() ** 2)


class _Biased(torch.autograd.Function):
    """A custom Function whose backward is not linear: zeros in, 0.1 out."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g + 0.1


@pytest.mark.parametrize("where", ["hook on a head feature", "hook on the stacked losses", "custom Function"])
def test_a_pass_where_a_node_may_make_zeros_nonzero_checks_the_released_heads(where):
    """NOTE [ Zeros that may not stay zeros ] in _plan.py: gp.backward(losses[1]) marked
    head 0 zero-only from routing alone, and a hook or a Function there made its zero
    gradient 0.1: the released node's outputs were zeroed, a different .grad with no
    error. Plain PyTorch computes with that gradient; graphprune cannot, and says so."""
    torch.manual_seed(0)
    w, h0, h1 = (torch.randn(4, requires_grad=True) for _ in range(3))
    with gp.track():
        x = w.exp()
        a = (x * h0).sin()
        if where == "hook on a head feature":
            a.register_hook(lambda g: g + 0.1)
        elif where == "custom Function":
            a = _Biased.apply(a)
        losses = torch.stack([(a * a).sum(), (x * h1).cos().sum()])
        if where == "hook on the stacked losses":
            losses.register_hook(lambda g: g + 0.1)
    gp.backward(losses[0])
    with pytest.raises(gp.ReleasedTensorError, match="released by graphprune.backward"):
        gp.backward(losses[1])


def test_a_node_post_hook_registered_before_the_prune_sees_zeros_not_nan():
    # the user's hook on a released Div node runs after graphprune zeroes the node's
    # outputs, though it was registered first: it sees what plain PyTorch gives (zeros)
    w0 = torch.linspace(0.1, 0.9, 4)
    seen = []
    w = w0.clone().requires_grad_()
    with gp.track():
        x = w.exp()
        d = x / (x - 0.5)  # its node saves x and x - 0.5: zero placeholders give 0 / 0
        losses = torch.stack([d.sum(), (x * x).sum()])
    handle = d.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs))
    losses[0].backward(retain_graph=True)
    gp.prune_after(losses[0])
    seen.clear()
    w.grad = None
    losses[1].backward(retain_graph=True)
    assert_close(w.grad, 2 * w0.exp() ** 2)
    assert len(seen) == 1
    for g in seen[0]:
        assert_close(g, torch.zeros_like(g))
    handle.remove()  # the user's handle still removes the user's hook
    losses[1].backward()
    assert len(seen) == 1


def test_two_threads_first_zero_passes_through_a_released_node_register_its_zeroing_hook_once(monkeypatch):
    # thread A's first zero pass through the released Div node pauses while it registers
    # the zeroing post-hook; thread B's pass reaches the same node meanwhile. One hook,
    # and both passes give plain PyTorch's gradient
    from graphprune import _zero

    w0 = torch.linspace(0.1, 0.9, 4)
    w = w0.clone().requires_grad_()
    with gp.track():
        x = w.exp()
        d = x / (x - 0.5)
        losses = torch.stack([d.sum(), (x * x).sum()])
    losses[0].backward(retain_graph=True)
    gp.prune_after(losses[0])

    grads, calls = {}, []
    register = _zero._register_zeroing

    def second_pass():
        grads["B"] = torch.autograd.grad(losses[1], w, retain_graph=True)[0]

    def paused_register(node):
        calls.append(node.name())
        if len(calls) == 1:  # thread A: let B run while A is inside
            other = threading.Thread(target=second_pass)
            other.start()
            other.join(timeout=0.5)
            threads.append(other)
        register(node)

    threads: list = []
    monkeypatch.setattr(_zero, "_register_zeroing", paused_register)
    grads["A"] = torch.autograd.grad(losses[1], w, retain_graph=True)[0]
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()
    assert calls == ["DivBackward0"]
    for got in grads.values():
        assert_close(got, 2 * w0.exp() ** 2)
    assert sorted(grads) == ["A", "B"]


def test_a_pass_a_hook_runs_during_gp_backward_sends_its_zeros_through_what_that_pass_released():
    # L[1]'s pass, started by a hook inside L[0]'s gp.backward, ran head 0's nodes that
    # L[0]'s pass had released as it went, with zeros: they had no guard until that
    # pass ended, and raised ReleasedTensorError where plain PyTorch runs
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    heads = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    inp = torch.randn(4, 8)

    def run(backward):
        for p in (w, *heads):
            p.grad = None
        with gp.track():
            x = (inp @ w).tanh()
            losses, mids = [], []
            for h in heads:
                z = (x @ h).sin()
                mids.append(z)
                losses.append((z @ h).sin().pow(2).mean())
            stacked = torch.stack(losses)
            first, second = stacked[0], stacked[1]
        done = []

        def hook(g):
            if not done:
                done.append(True)
                backward(second)
            return g

        mids[0].register_hook(hook)
        backward(first)
        assert done
        return [p.grad.clone() for p in (w, *heads)]

    expected = run(lambda loss: loss.backward(retain_graph=True))
    for got, want in zip(run(gp.backward), expected):
        assert_close(got, want)


def _checkpointed_head_0(use_graphprune: bool):
    """Stacked losses whose head 0 is a reentrant checkpoint of ``log`` (a zero
    placeholder makes it -inf) and a linear layer; head 0's pass, then ``L[1]``'s."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    trunk, h0, h1 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    with gp.track() if use_graphprune else contextlib.nullcontext():
        x = torch.sigmoid(trunk(torch.randn(3, 4)))
        l0 = checkpoint(lambda z: h0(z.log()), x, use_reentrant=True).pow(2).mean()
        losses = torch.stack([l0, h1(x).exp().mean()])
    if use_graphprune:
        gp.backward(losses[0])
    else:
        losses[0].backward(retain_graph=True)
    return losses, h0


def test_a_zero_pass_into_a_released_reentrant_checkpoint_raises_before_it_recomputes():
    # NOTE [ Backwards that run a pass ]: reproduced in review, the recomputation on
    # placeholders ran a pass of its own that wrote NaN into the region's .grad
    losses, h0 = _checkpointed_head_0(use_graphprune=True)
    before = h0.weight.grad.clone()
    with pytest.raises(gp.ReleasedTensorError, match="reentrant checkpoint"):
        gp.backward(losses[1])
    assert_close(h0.weight.grad, before)
    plain, h0_plain = _checkpointed_head_0(use_graphprune=False)
    plain[1].backward()
    assert_close(h0_plain.weight.grad, before)  # plain PyTorch adds zeros to it


def test_a_compiled_regions_placeholder_has_the_strides_of_a_contiguous_tensor():
    # inductor's backward asserts the strides of what it saved: a zero-stride placeholder
    # failed a zero pass through a released compiled head (AssertionError, found in review)
    from graphprune import _zero

    w = torch.ones(3, requires_grad=True)
    node = torch.compile(lambda t: (t * t).sin(), backend="aot_eager")(w).grad_fn
    assert type(node).__name__ == "CompiledFunctionBackward"
    p = _zero.placeholder(torch.Size([2, 3]), torch.float32, torch.device("cpu"), node)
    assert p.stride() == (3, 1) and not p.any()
    q = _zero.placeholder(torch.Size([2, 3]), torch.float32, torch.device("cpu"), w.sin().grad_fn)
    assert q.stride() == (0, 0)
