"""GraphPruneWarning: a call that cannot free what it is for says so, once per call
site, at the user's line, in a category users can filter."""

import warnings

import pytest
import torch
from torch import nn

import graphprune as gp


def _heads_with_probs_held():
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(32, 128), nn.GELU())
    heads = [nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10)) for _ in range(2)]
    inp, tgt = torch.randn(256, 32), torch.randint(0, 10, (256,))
    with gp.track():
        f = trunk(inp)
        logits = [h(f) for h in heads]
        probs = [x.softmax(-1) for x in logits]  # kept for a metric, still with its graph
        losses = [nn.functional.cross_entropy(x, tgt) for x in logits]
    return probs, losses


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        fn()
    return [w for w in caught if issubclass(w.category, gp.GraphPruneWarning)]


def test_little_freed_because_of_a_held_tensor_warns_naming_it():
    probs, losses = _heads_with_probs_held()
    caught = _record(lambda: gp.backward(losses[0]))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "probs[0] (tensor of shape (256, 10)" in message
    assert "detach them" in message and "keep=[later losses]" in message
    assert caught[0].filename == __file__
    assert issubclass(gp.GraphPruneWarning, UserWarning)


def test_warning_is_filed_once_per_call_site():
    caught = []

    def twice():
        for _ in range(2):
            probs, losses = _heads_with_probs_held()
            gp.backward(losses[0])

    caught = _record(twice)
    assert len(caught) == 1


def test_warning_can_be_filtered_by_category():
    probs, losses = _heads_with_probs_held()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=gp.GraphPruneWarning)
        gp.backward(losses[0])
    assert not caught


def test_heads_held_as_logits_and_losses_warn_nothing():
    probs, losses = _heads_with_probs_held()
    del probs
    assert _record(lambda: [gp.backward(loss) for loss in losses]) == []


def test_graph_built_outside_track_warns_nothing_can_be_released():
    w = torch.ones(3, requires_grad=True)
    y = w.exp().sum()
    caught = _record(lambda: gp.backward(y))
    assert len(caught) == 1
    assert "nothing can be released" in str(caught[0].message)
    assert "outside graphprune.track()" in str(caught[0].message)


def test_keep_made_only_of_leaves_warns_it_protects_nothing():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        y = w.exp().sum()
    caught = _record(lambda: gp.prune_after(y, keep=[w]))
    assert len(caught) == 1
    assert "keep= names only leaf tensors" in str(caught[0].message)


def test_graph_built_under_no_grad_is_an_error_that_says_so():
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        y = w.exp().sum()
    message = r"y has no grad_fn \(it does not require grad: made under torch.no_grad"
    with pytest.raises(ValueError, match=message):
        gp.prune_after(y)
