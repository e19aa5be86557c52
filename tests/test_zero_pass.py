"""Later passes through released nodes with all-zero gradients (DESIGN.md fact 9).

``losses = torch.stack([l0, l1, ...])``: ``losses[1].backward()`` runs head 0's
nodes too, with zero gradients. Once head 0 is pruned, that must still work.
"""

import pytest
import torch
from torch.testing import assert_close

import graphprune as gp

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


def _stacked_heads_one_released():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, [HEADS["sin"], HEADS["log"], lambda t: (t * t).sum()])
    gp.backward(losses[0])  # head 0 is released; losses[1:] keep the rest
    w.grad = None
    return w, losses


def test_a_pass_that_routing_says_sends_zeros_reads_no_gradient_value(monkeypatch):
    w, losses = _stacked_heads_one_released()
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k))
    gp.backward(losses[1])  # head 0 is off the route: marked zero-only before the pass
    monkeypatch.undo()
    assert reads == []
    assert_close(w.grad, torch.ones(4))  # d/dw log(exp(w))


def test_a_plain_pass_still_checks_released_nodes_for_zeros(monkeypatch):
    w, losses = _stacked_heads_one_released()
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k))
    losses[1].backward(retain_graph=True)  # not graphprune's pass: no routing known, the data check runs
    monkeypatch.undo()
    assert reads


@pytest.fixture
def deferred(monkeypatch):
    """The deferred check of devices other than the CPU, exercised on the CPU."""
    from graphprune import _zero

    monkeypatch.setattr(_zero, "IMMEDIATE", set())


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


def _guarded(nodes):
    from graphprune._marks import GUARDED

    return {n for n in nodes if GUARDED in n.metadata}


def test_a_prune_guards_only_the_released_nodes_a_pass_enters_by():
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x, per_head, losses = _stacked(w, [_deep_head, lambda t: (t * t).sum()])
    losses[0].backward(retain_graph=True)
    gp.prune_after(per_head[0], keep=[x, per_head[1]])
    released = [n for n in gp._graph.walk([per_head[0].grad_fn]) if gp._marks.RELEASED in n.metadata]
    assert len(released) >= 5
    assert len(_guarded(released)) == 1  # the head's top saving node; the others wait for it


def test_a_zero_pass_guards_the_released_nodes_below_as_it_runs_and_matches_plain():
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
    released = [n for n in gp._graph.walk([per_head[0].grad_fn]) if gp._marks.RELEASED in n.metadata]
    assert _guarded(released) == set(released)
    with pytest.raises(gp.ReleasedTensorError):
        losses.sum().backward()


def test_a_zero_pass_guards_released_nodes_of_a_later_prune_below_an_earlier_ones_region():
    # head 0 reaches the trunk through a view (a node that saves nothing, outside head
    # 1's graph); the last prune releases the trunk, whose only other parent is head 1
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x = w.exp().sin()
        l0 = _deep_head(x.view(2, 2))
        l1 = (x * x).sum()
    del x
    l0.backward(retain_graph=True)
    gp.prune_after(l0, keep=l1)
    l1.backward(retain_graph=True)
    gp.prune_after(l1, keep=[])
    w.grad = None
    (l0 * 0.0).backward()  # zeros through head 0, its view, then the trunk
    assert_close(w.grad, torch.zeros(4))


def _pruned_with_an_unseen_entry():
    """Head 0 (sin, cos) pruned with keep=x; l2, built outside track() from the sin's
    output, enters it below its top by a graph no prune walked."""
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x = w.exp()
        h = x.sin()
        l0 = h.cos().sum()
    l2 = h.sum() * 0.0
    del h
    l0.backward(retain_graph=True)
    gp.prune_after(l0, keep=x)  # the sin is released, and unguarded: its only seen parent is the cos
    w.grad = None
    return w, l0, l2


def test_a_prune_guards_the_released_nodes_that_what_it_keeps_leads_into():
    w, l0, l2 = _pruned_with_an_unseen_entry()
    gp.prune_after(l0, keep=l2)  # l2's graph leads into the sin: guarded now
    l2.backward()
    assert_close(w.grad, torch.zeros(4))


def test_a_pass_entering_a_released_region_below_its_frontier_from_an_unwalked_graph_raises():
    # NOTE [ Guards at the frontier ]: nothing guards the node l2 enters by; even zeros
    # raise there
    _, _, l2 = _pruned_with_an_unseen_entry()
    with pytest.raises(gp.ReleasedTensorError, match="SinBackward0"):
        l2.backward()


def test_a_zero_pass_from_a_live_tensor_made_from_a_dead_intermediate_of_the_branch_matches_plain():
    # shifted (held for a metric) is made from h1, which died, by ops that save nothing:
    # its graph enters the branch below the top, through nodes outside the walk
    w = torch.linspace(0.1, 0.9, 4).requires_grad_()
    with gp.track():
        x = w.exp()
        h1 = x.sin()
        shifted = -(h1 + 1.0)
        l0 = h1.cos().sum()
    del h1
    l0.backward(retain_graph=True)
    gp.prune_after(l0, keep=x)
    w.grad = None
    (shifted * 0.0).sum().backward()
    assert_close(w.grad, torch.zeros(4))
