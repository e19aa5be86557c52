"""NOTE [ The trunk walked once ] (``_trunk.py``): a prune with one ``keep=`` root walks
the trunk once, and the next head's prune does not walk it again; what it releases,
reports and leaves differentiable is exactly what the walk of the whole graph gives."""

import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import graphprune as gp
from graphprune import _graph, _plan, _trunk


def _summary(report):
    kept = tuple((k.reason, k.nodes, k.saved_bytes) for k in report.kept)
    return (report.released_nodes, report.released_tensors, report.bytes_freed, report.bytes_kept, kept)


@pytest.fixture
def whole_walk(monkeypatch):
    """Prunes walk the whole graph from ``y``, and the trunk again, as before the trunk was
    walked once."""
    def disabled():
        monkeypatch.setattr(_plan, "walk_trunk_once", lambda *args: (None, None, None, None))
    return disabled


def _trunk_heads(w, k, skip=False):
    """A trunk, ``x``, and ``k`` heads on it (``skip``: each head also reads an early
    trunk feature)."""
    h = (w * 1.5).tanh()
    x = (h @ w.T).sin()
    heads = [((x * (i + 1)).exp() + (h.cos() if skip else 0)).sum() for i in range(k)]
    return x, heads


def _lazy(w, keep_of, skip=False, k=5):
    """The seed pattern: one backward and one prune per head; the reports and ``w.grad``."""
    with gp.track():
        x, heads = _trunk_heads(w, k, skip)
    reports = []
    for i, loss in enumerate(heads):
        if i < k - 1:
            loss.backward(retain_graph=True)
            reports.append(_summary(gp.prune_after(loss, keep=keep_of(x, heads, i))))
        else:
            loss.backward()
    return reports, w.grad


def _plain_grad(w0, skip=False, k=5):
    w = w0.clone().requires_grad_()
    _, heads = _trunk_heads(w, k, skip)
    sum(heads).backward()
    return w.grad


KEEPS = {
    "x": lambda x, heads, i: x,
    "[x]": lambda x, heads, i: [x],
    "x.grad_fn": lambda x, heads, i: x.grad_fn,
    "the next head": lambda x, heads, i: heads[i + 1],
}


@pytest.mark.parametrize("skip", [False, True], ids=["heads_on_x", "heads_on_x_and_an_early_feature"])
@pytest.mark.parametrize("keep", sorted(KEEPS))
def test_lazy_heads_release_and_report_what_the_whole_walk_gives(keep, skip, whole_walk):
    w0 = torch.randn(6, 6, dtype=torch.float64)
    w = w0.clone().requires_grad_()
    fast, fast_grad = _lazy(w, KEEPS[keep], skip)
    whole_walk()
    w = w0.clone().requires_grad_()
    slow, slow_grad = _lazy(w, KEEPS[keep], skip)
    assert fast == slow
    assert all(r[1] >= 1 for r in fast)
    assert_close(fast_grad, _plain_grad(w0, skip))
    assert_close(slow_grad, fast_grad)


def _prune_the_first_of_two(x, y1, y2):
    y1.backward(retain_graph=True)
    report = gp.prune_after(y1, keep=x)
    y2.backward()
    return [_summary(report)]


def _scenario_stack_slice(w):
    """``x`` a slice of a stack: the walk from ``y`` reaches the stack with part of it."""
    with gp.track():
        s = torch.stack([w.exp(), w.sin()])
        x = s[0]
        y1 = (s[1] * 2).cos().sum()
        y2 = x.tanh().sum()
    return _prune_the_first_of_two(x, y1, y2)


def _scenario_keep_outside_y(w):
    with gp.track():
        x = w.exp()
        other = w.cos() * 2
        y1 = (x * other).sum()
    y1.backward(retain_graph=True)
    return [_summary(gp.prune_after(y1, keep=other))]


def _scenario_checkpointed_trunk(w):
    with gp.track():
        x = checkpoint(lambda t: (t * 2).sin().exp(), w, use_reentrant=False)
        y1 = (x * x).sum()
        y2 = x.cos().sum()
    return _prune_the_first_of_two(x, y1, y2)


def _scenario_module_trunk(w):
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 8), nn.LayerNorm(8))
    heads = [nn.Linear(8, 1) for _ in range(3)]
    reports = []
    with gp.track():
        x = trunk(w)
    for i, head in enumerate(heads):
        with gp.track():
            loss = head(x).square().mean()
        loss.backward(retain_graph=i < 2)
        if i < 2:
            reports.append(_summary(gp.prune_after(loss, keep=x)))
    return reports + [tuple(p.grad.sum().item() for p in trunk.parameters())]


def _scenario_trunk_walk_stops_at_a_released_node(w):
    """``x``'s graph lost a node to an earlier prune: the walk from ``y`` goes on
    through it, to a node that only the pending loss the earlier prune kept holds."""
    with gp.track():
        a = w.exp()
        c = a.sin()
        x = c * 2
        lc = c.sum()
        other = a.cos().sum()
    lc.backward(retain_graph=True)
    first = gp.prune_after(lc)  # releases c's node; other keeps a's
    with gp.track():
        y1 = (x * x).sum()
    report = gp.explain(y1, keep=x)
    other.backward()  # a's node was kept for it
    return [_summary(first), _summary(report)]


def _scenario_y_reaches_the_trunk_with_more_than_x_covers(w):
    """``x`` is built on part of a stack, ``y`` on all of it: the walk from ``y`` goes on
    from the stack into what ``x``'s graph does not hold."""
    with gp.track():
        s = torch.stack([w.exp(), w.sin()])
        x = s[0] * 1.5
        y = s.sum() + (x * x).sum()
    y.backward(retain_graph=True)
    return [_summary(gp.prune_after(y, keep=x))]


def _scenario_a_walk_left_on_x_then_a_prune_releases_part_of_it(w):
    with gp.track():
        a = w.exp()
        c = a.sin()
        x = c * 2
        other = a.cos().sum()
        y0 = (x * 3).sum()
    y0.backward(retain_graph=True)
    first = gp.prune_after(y0, keep=x)  # leaves x's walk on its node
    with gp.track():
        lc = c.sum()
    lc.backward(retain_graph=True)
    second = gp.prune_after(lc, keep=other)  # releases c's node, in x's graph
    with gp.track():
        y1 = (x * x).sum()
    return [_summary(first), _summary(second), _summary(gp.explain(y1, keep=x))]


def _scenario_y_reaches_x_with_less_than_x(w):
    """``x`` is a stack and ``y`` is built on one of its rows: ``x``'s graph holds more
    than the walk from ``y`` reaches."""
    with gp.track():
        x = torch.stack([w.exp(), w.sin()])
        y = (x[0] * 2).sum()
    y.backward(retain_graph=True)
    return [_summary(gp.explain(y, keep=x)), _summary(gp.prune_after(y, keep=x))]


def _scenario_a_plain_pass_frees_part_of_a_measured_trunk(w):
    """The trunk was measured at the first head's prune; a pass that did not retain the
    graph then freed part of it, with no mark: the next prune's numbers say so."""
    with gp.track():
        h = w.exp()  # its node saves h; nothing else in the trunk does
        x = h * 3.0
        y1 = (x * 2).sum()
        y2 = (x * 4).sum()
        y3 = x.tanh().sum()
    reports = []
    for y in (y1, y2):  # the first prune keeps the trunk's measure, the second reads it
        y.backward(retain_graph=True)
        reports.append(_summary(gp.prune_after(y, keep=x)))
    h.sum().backward()  # frees what h's graph saved
    return reports + [_summary(gp.explain(y3, keep=x))]


def _scenario_the_root_itself_released_since_its_walk_was_left(w):
    """A prune with another ``keep=`` released ``x``'s own node after a ``keep=x`` prune
    left its walk there: the next ``keep=x`` prune protects nothing below it (a walk
    stops at a released node), and frees what only ``x`` kept."""
    with gp.track():
        a = w.exp()  # its node saves a, as x's node does
        x = a.sin()
        other = (a * 2).sum()
        y0 = (x * 3).sum()
    del a
    y0.backward(retain_graph=True)
    reports = [_summary(gp.prune_after(y0, keep=x))]  # leaves the walk on x's node
    with gp.track():
        lx = x.sum()
    lx.backward(retain_graph=True)
    reports.append(_summary(gp.prune_after(lx, keep=other)))  # releases x's node
    with gp.track():
        y1 = (x * x).sum()
    with pytest.warns(gp.GraphPruneWarning, match="keep= reaches no node of the graph"):
        reports.append(_summary(gp.prune_after(y1, keep=x)))  # x's own node is released
    exp_node = x.grad_fn.next_functions[0][0]
    return reports + [exp_node._raw_saved_result.data.tensor is None]


def _scenario_a_plain_pass_frees_what_other_hooks_or_pytorch_held(w, built_outside):
    """A trunk whose saved tensors checkpoint (or PyTorch: built outside ``track()``)
    holds, measured at every prune; a plain pass then frees them, with no handle of
    graphprune's to tell: the next report counts those nodes as freed."""
    if built_outside:
        c = w.sin().exp()
        with gp.track():
            x = c * 2.0
            heads = [(x * (i + 1)).cos().sum() for i in range(3)]
    else:
        with gp.track():
            c = checkpoint(lambda t: t.sin().exp(), w, use_reentrant=False)
            x = c * 2.0
            heads = [(x * (i + 1)).cos().sum() for i in range(3)]
    reports = []
    for y in heads[:2]:
        y.backward(retain_graph=True)
        reports.append(_summary(gp.prune_after(y, keep=x)))
    c.sum().backward()
    return reports + [_summary(gp.explain(heads[2], keep=x))]


def _scenario_reasons_met_in_the_trunk_and_in_the_head(w):
    """Nodes other hooks hold in the trunk, a node built outside ``track()`` deep in the
    head: the reasons are listed in one order, whichever walk met them first."""
    u = torch.randn(4, 6, requires_grad=True).sin()  # PyTorch holds its saved tensor
    with gp.track():
        with torch.autograd.graph.save_on_cpu():
            c = w.exp()
        x = c * 2.0
        heads = []
        for _ in range(3):
            h = u
            for _ in range(4):
                h = h + 1.0  # saves nothing: puts u's node deep in the head
            heads.append((x * h).sum())
    reports = []
    for y in heads:
        y.backward(retain_graph=True)
        reports.append(_summary(gp.prune_after(y, keep=x)))
    return reports


def _scenario_y_reaches_entries_of_losses_inside_the_trunk(w, walk_left=False):
    """The losses' vector ``L`` sits under ``x = L[1]``'s node, in the trunk: ``y``'s pass
    runs through its other entries too, and the walk from ``y`` stops at its node. What
    the pass ran through of ``L`` is every entry (after ``x``'s own pass, a ``keep=None``
    prune has nothing of ``L`` left to protect), not the one the trunk's walk found;
    ``walk_left``: a first head's prune left that walk on ``x``'s node."""
    with gp.track():
        a = w.exp()
        L = torch.stack([(a * (i + 1)).sin().sum() for i in range(3)]) * 1.0  # not a routing node
        x = L[1]
        y0 = (x * 3).exp()
        y = L[0] + x * 2 + L[2]
    reports = []
    if walk_left:
        y0.backward(retain_graph=True)
        reports.append(_summary(gp.prune_after(y0, keep=x)))
    y.backward(retain_graph=True)
    reports.append(_summary(gp.prune_after(y, keep=x)))
    x.backward(retain_graph=True)
    return reports + [_summary(gp.prune_after(x)), _summary(gp.explain(x))]


SCENARIOS = {
    "the root itself released since its walk was left":
        _scenario_the_root_itself_released_since_its_walk_was_left,
    "a plain pass frees what checkpoint held": functools.partial(
        _scenario_a_plain_pass_frees_what_other_hooks_or_pytorch_held, built_outside=False),
    "a plain pass frees what PyTorch held": functools.partial(
        _scenario_a_plain_pass_frees_what_other_hooks_or_pytorch_held, built_outside=True),
    "reasons met in the trunk and in the head": _scenario_reasons_met_in_the_trunk_and_in_the_head,
    "a plain pass frees part of a measured trunk": _scenario_a_plain_pass_frees_part_of_a_measured_trunk,
    "y reaches x with less than x": _scenario_y_reaches_x_with_less_than_x,
    "the trunk's walk stops at a released node": _scenario_trunk_walk_stops_at_a_released_node,
    "y reaches the trunk with more than x covers": _scenario_y_reaches_the_trunk_with_more_than_x_covers,
    "a walk left on x, then part of it released": _scenario_a_walk_left_on_x_then_a_prune_releases_part_of_it,
    "x a slice of a stack": _scenario_stack_slice,
    "keep outside y's graph": _scenario_keep_outside_y,
    "checkpointed trunk": _scenario_checkpointed_trunk,
    "module trunk with dropout": _scenario_module_trunk,
    "y reaches entries of losses inside the trunk": _scenario_y_reaches_entries_of_losses_inside_the_trunk,
    "y reaches entries of losses inside a trunk walked before": functools.partial(
        _scenario_y_reaches_entries_of_losses_inside_the_trunk, walk_left=True),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_prunes_give_what_the_whole_walk_gives(name, whole_walk):
    w0 = torch.randn(4, 6)
    torch.manual_seed(1)
    fast = SCENARIOS[name](w0.clone().requires_grad_())
    whole_walk()
    torch.manual_seed(1)
    slow = SCENARIOS[name](w0.clone().requires_grad_())
    assert fast == slow


def test_the_next_heads_prune_does_not_walk_the_trunk_again(monkeypatch):
    """The first prune walks the trunk and reads its saved tensors; every later one
    walks and reads only its head."""
    walked, read = [], []

    def counting_reach(*args, **kwargs):
        out = _graph.reach(*args, **kwargs)
        walked.append(len(out) if kwargs.get("stop") is None else sum(n not in kwargs["stop"] for n in out))
        return out

    def counting_classify(nodes, protected):
        nodes = list(nodes)
        read.append(len(nodes))
        return classify(nodes, protected)

    def counting_classify_kept(nodes, key):
        nodes = list(nodes)
        read.append(len(nodes))
        return classify_kept(nodes, key)

    classify, classify_kept = _plan._classify, _plan._classify_kept
    monkeypatch.setattr(_trunk, "reach", counting_reach)
    monkeypatch.setattr(_plan, "reach", counting_reach)
    monkeypatch.setattr(_plan, "_classify", counting_classify)
    monkeypatch.setattr(_plan, "_classify_kept", counting_classify_kept)
    w = torch.randn(8, requires_grad=True)
    with gp.track():
        h = w
        for _ in range(300):
            h = h.sin()
        x = h
        heads = [(x * (i + 1)).exp().sum() for i in range(HEADS)]
    per_prune = []
    for loss in heads[:-1]:
        loss.backward(retain_graph=True)
        walked.clear()
        read.clear()
        gp.prune_after(loss, keep=x)
        per_prune.append((sum(walked), sum(read)))
    trunk, head = 300, 10  # a head: SumBackward0, ExpBackward0, MulBackward0, and x's node
    assert per_prune[0][0] >= trunk and per_prune[0][1] >= trunk
    assert all(w <= head and r <= head for w, r in per_prune[1:]), per_prune
    heads[-1].backward()
    w_plain = w.detach().clone().requires_grad_()
    assert_close(w.grad, torch.autograd.grad(_sum_of_heads(w_plain), w_plain)[0])


HEADS = 5


def _sum_of_heads(w):
    h = w
    for _ in range(300):
        h = h.sin()
    return sum((h * (i + 1)).exp().sum() for i in range(HEADS))


def test_the_walk_left_on_a_node_holds_no_reference_to_that_node():
    """A node's metadata holding its own wrapper is a cycle through C++ that no
    collector sees: the node would never be freed."""
    w = torch.randn(8, requires_grad=True)
    with gp.track():
        x = w.exp().sin()
        y1 = (x * 2).sum()
        y2 = x.cos().sum()
    y1.backward(retain_graph=True)
    gp.prune_after(y1, keep=x)
    assert _trunk._TRUNK in x.grad_fn.metadata
    marker = _Marker()
    x.grad_fn.metadata["test.marker"] = marker
    freed = weakref.ref(marker)
    y2.backward()
    del x, y1, y2, marker
    gc.collect()
    assert freed() is None, "x's node outlived every reference to it"


class _Marker:
    pass


def _sin_head_backpropagated():
    """``x = exp(w)`` and ``y1 = sin(x).sum()``, after ``y1``'s retained backward."""
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = x.sin().sum()
    y1.backward(retain_graph=True)
    return x, y1


def test_no_node_is_released_once_the_released_graphs_are_gone():
    """NOTE [ No node released ] (``_marks.py``): the mark's reasons are held by the nodes
    that carry them, so a prune's reason leaves the set with the last of its nodes."""
    from graphprune import _marks

    gc.collect()
    before = set(_marks._marked)  # earlier tests' graphs that are still alive
    x, y1 = _sin_head_backpropagated()
    gp.explain(y1, keep=x)
    assert set(_marks._marked) == before  # explain marks nothing
    gp.prune_after(y1, keep=x)
    assert len(set(_marks._marked) - before) == 1 and not _marks.none_released()
    del x, y1
    gc.collect()
    assert set(_marks._marked) <= before
    assert _marks.none_released() == (not before)


def test_the_walk_left_on_a_trunk_leaves_the_walks_set_with_its_graph():
    """The walks left on nodes are held weakly (``_marks.weakly_add``): a dead graph's
    walk is not looked at by later releases, and nothing of it stays."""
    gc.collect()
    before = {ref() for ref in _trunk._walks}
    x, y1 = _sin_head_backpropagated()
    gp.prune_after(y1, keep=x)
    (left,) = {ref() for ref in _trunk._walks} - before
    assert x.grad_fn.metadata[_trunk._TRUNK] is left
    left = weakref.ref(left)
    del x, y1
    gc.collect()
    assert left() is None
    assert {ref() for ref in _trunk._walks} <= before


def test_an_entry_of_a_set_of_weak_references_leaves_with_its_object():
    from graphprune import _marks

    class Mark:
        pass

    refs: set = set()
    a, b = Mark(), Mark()
    for obj in (a, a, b):
        _marks.weakly_add(refs, obj)
    del obj
    assert len(refs) == 2
    del a
    assert [ref() for ref in refs] == [b]
    del b
    assert not refs


def test_a_walk_that_stops_at_released_nodes_stops_while_one_lives():
    x, y1 = _sin_head_backpropagated()
    gp.prune_after(y1, keep=x)
    sin = y1.grad_fn.next_functions[0][0]
    skipped = []
    walked = _graph.reach([y1.grad_fn], through_released=False, skipped=skipped)
    assert skipped == [sin] and sin not in walked
    assert x.grad_fn in _graph.reach([y1.grad_fn])  # through it, as a walk from y goes
