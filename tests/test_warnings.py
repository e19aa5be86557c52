"""GraphPruneWarning: a call that cannot free what it is for says so, once per call
site, at the user's line, in a category users can filter."""

import importlib.util
import os
import warnings

import pytest
import torch
from torch import nn

import graphprune as gp


def _heads_with_metrics_held():
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(32, 128), nn.GELU())
    heads = [nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10)) for _ in range(2)]
    inp, tgt = torch.randn(256, 32), torch.randint(0, 10, (256,))
    with gp.track():
        f = trunk(inp)
        logits = [h(f) for h in heads]
        probs = [x.softmax(-1) for x in logits]  # kept for a metric, still with its graph
        confidence = [p.max(-1).values.mean() for p in probs]  # a scalar logged, never backpropagated
        losses = [nn.functional.cross_entropy(x, tgt) for x in logits]
    return probs, confidence, losses


def _record(fn, action="default"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        fn()
    return [w for w in caught if issubclass(w.category, gp.GraphPruneWarning)]


def test_little_freed_because_of_a_held_sum_of_losses_warns_naming_it():
    probs, confidence, losses = _heads_with_metrics_held()
    del confidence
    with gp.track():
        total = losses[0] + losses[1]  # held for logging, never backpropagated
    caught = _record(lambda: gp.backward(losses[0]))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "total (tensor of shape ()" in message
    assert "computed from the losses" in message
    assert "detach them" in message and "keep=[later losses]" in message
    assert caught[0].filename == __file__
    del total
    assert _record(lambda: gp.backward(losses[1])) == []  # nothing held: the head and the trunk go



@pytest.mark.parametrize("strategy", ["cut", "passes"])
def test_a_held_metric_of_the_feature_is_no_sum_of_the_losses(strategy):
    # the cut's trunk pass starts at the feature: a scalar held of it (aux, which saves
    # nothing of its own) looked "computed from the losses", and backward_each warned of
    # a held sum under strategy="cut" only
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    heads = [torch.randn(4, 4, requires_grad=True) for _ in range(2)]
    with gp.track():
        x = (torch.randn(3, 4) @ w).tanh()
        losses = [(x @ heads[0]).sin().sum(), (x @ heads[1]).cos().sum()]
        aux = (x * 3).sum()  # logged, never backpropagated: a pending loss, which keeps x's graph
    assert _record(lambda: gp.backward_each(losses, strategy=strategy)) == []
    assert "aux" in gp.last_report().kept[0].reason and aux.requires_grad


def test_no_held_sum_warning_where_a_create_graph_pass_keeps_what_stays():
    # MAML's inner loop: a fast weight (one element, held) built from one task's
    # create_graph=True gradient, then gp.grad(create_graph=True) on the next task's
    # loss, whose graph its own outputs keep. The warning blamed live sums and named
    # none ("no backward pass has run through: ."): what stays was the create_graph
    # rule's, which dropping the fast weight would not free
    torch.manual_seed(0)
    w, b = torch.randn(3, requires_grad=True), torch.randn(1, requires_grad=True)
    x0, x1 = torch.randn(4, 3), torch.randn(4, 3)
    with gp.track():
        l0 = ((x0 @ w) + b).pow(2).mean()
        _, gb = torch.autograd.grad(l0, [w, b], create_graph=True)
        fast_b = b - 0.1 * gb
        l1 = ((x1 @ w) + b).pow(2).mean()
        got = _record(lambda: gp.grad(l1, [w, b], create_graph=True))
    assert got == []
    report = gp.last_report()
    assert report.bytes_freed == 0 and "create_graph=True" in report.kept[0].reason
    assert fast_b.requires_grad

def test_a_routed_call_s_warning_names_the_call_as_written_and_the_block_s_keep():
    # under pruning() the warning said "graphprune.backward freed ..." and "keep=[later
    # losses]", for a losses[0].backward(retain_graph=True) that can take no keep=
    probs, confidence, losses = _heads_with_metrics_held()
    del confidence
    with gp.track():
        total = losses[0] + losses[1]

    with warnings.catch_warnings(record=True) as caught, gp.pruning():
        warnings.simplefilter("default")
        losses[0].backward(retain_graph=True)
    assert len(caught) == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert message.startswith("Tensor.backward (graphprune.pruning() ran it as graphprune.backward) freed ")
    assert "total (tensor of shape ()" in message and "graphprune.pruning(keep=[later losses])" in message
    assert total.requires_grad


def _outside_track():
    w = torch.ones(3, requires_grad=True)
    return w.exp().sum()


def test_warning_is_filed_once_per_call_site():
    def twice():
        for _ in range(2):
            gp.backward(_outside_track())

    assert len(_record(twice)) == 1


def test_warning_can_be_filtered_by_category():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=gp.GraphPruneWarning)
        gp.backward(_outside_track())
    assert not caught


def test_held_probabilities_and_later_losses_warn_nothing_and_free_the_head():
    probs, confidence, losses = _heads_with_metrics_held()
    del confidence  # a scalar held with its graph is taken for a later loss: NOTE [ What keep=None protects ]
    reports = []
    assert _record(lambda: reports.extend(gp.backward(loss) for loss in losses)) == []
    assert reports[0].released_node_count >= 4  # the head, though probs[0] (no loss) is held
    assert reports[1].bytes_kept == 0  # the last pass took the trunk too
    assert probs[0].shape == (256, 10)


def test_a_later_loss_of_a_tiny_head_warns_nothing():
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
    heads = [nn.Linear(1024, 1) for _ in range(2)]
    with gp.track():
        f = trunk(torch.randn(128, 64))
        losses = [h(f).square().mean() for h in heads]
    report = _record(lambda: gp.backward(losses[0]))
    assert report == []  # freed well under 10%, but for a loss with parameters of its own


def test_graph_built_outside_track_warns_nothing_can_be_released():
    y = _outside_track()
    caught = _record(lambda: gp.backward(y))
    assert len(caught) == 1
    assert "nothing can be released" in str(caught[0].message)
    assert "outside graphprune.track()" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert issubclass(gp.GraphPruneWarning, UserWarning)


def _untracked_heads(lazy: bool):
    w = torch.ones(3, requires_grad=True)
    x = w.exp()  # the trunk, outside track()
    if lazy:
        return w, [lambda: x.sin().sum(), lambda: x.cos().sum()]
    return w, [(x * x).sin().sum(), x.cos().sum()]


def _per_loss(strategy, losses, w):
    """``(warnings, call name)`` of a per-loss helper's call: ``strategy`` is one of
    backward_each's, or "grads" for grads_each."""
    if strategy == "grads":
        return _record(lambda: gp.grads_each(losses, w)), "graphprune.grads_each"
    return _record(lambda: gp.backward_each(losses, strategy=strategy)), "graphprune.backward_each"


@pytest.mark.parametrize("strategy", ["cut", "passes", "grads"])
def test_per_loss_helpers_on_an_untracked_graph_warn_once_per_call(strategy):
    w, losses = _untracked_heads(lazy=False)
    caught, call = _per_loss(strategy, losses, w)
    assert len(caught) == 1  # one per call, not one per pass
    assert str(caught[0].message).startswith(f"{call}: nothing can be released")
    assert caught[0].filename == __file__


def test_lazy_heads_on_an_untracked_trunk_warn_that_the_trunk_stays():
    w, builders = _untracked_heads(lazy=True)
    caught = _record(lambda: gp.backward_each(builders))  # the heads are built under track()
    assert len(caught) == 1
    assert "nothing can be released: the graph of the gradient into ExpBackward0" in str(caught[0].message)
    torch.testing.assert_close(w.grad, (w.exp().cos() - w.exp().sin()) * w.exp())


def test_per_loss_helpers_on_a_tracked_graph_warn_nothing():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = [(x * x).sin().sum(), x.cos().sum()]
    assert _record(lambda: gp.backward_each(losses)) == []


@pytest.mark.parametrize("strategy", ["cut", "passes", "grads"])
def test_per_loss_helpers_warn_once_of_a_held_sum_and_name_it(strategy):
    # gp.backward warned; backward_each and grads_each freed nothing and said nothing
    w = torch.randn(64, 64, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = [(x @ x).tanh().sum(), (x @ x.T).sin().sum()]
        total = losses[0] + losses[1]  # held for logging, never backpropagated
    # called here, not through _per_loss: the warning names total from the caller's frame
    call = "graphprune.grads_each" if strategy == "grads" else "graphprune.backward_each"
    if strategy == "grads":
        caught = _record(lambda: gp.grads_each(losses, w))
    else:
        caught = _record(lambda: gp.backward_each(losses, strategy=strategy))
    assert len(caught) == 1, [str(w.message) for w in caught]  # one per call, not one per pass
    message = str(caught[0].message)
    assert message.startswith(f"{call} freed") and "total (tensor of shape ()" in message, message
    assert caught[0].filename == __file__
    del total


def test_keep_made_only_of_leaves_warns_it_protects_nothing():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        y = w.exp().sum()
    caught = _record(lambda: gp.prune_after(y, keep=[w]))
    assert len(caught) == 1
    assert "keep= names only leaf tensors" in str(caught[0].message)


def test_a_pruning_block_whose_keep_is_leaves_warns_once_as_it_is_entered():
    """Each call the block routed warned again, as "graphprune.backward: keep=...", a
    call the code never wrote; the block's entry had warned already."""
    w = torch.ones(3, requires_grad=True)

    def block():
        with gp.pruning(keep=w):
            for _ in range(2):  # two steps, each routed
                with gp.track():
                    loss = w.exp().sum()
                loss.backward(retain_graph=True)

    caught = _record(block, "always")
    assert [str(c.message).split(":")[0] for c in caught] == ["graphprune.pruning"]


@pytest.mark.parametrize("as_", ["edge", "node"])
def test_keep_of_a_leaf_s_edge_or_accumulator_warns_it_protects_nothing(as_):
    # keep=w warned; its GradientEdge and AccumulateGrad, which protect as little, did not
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        y = w.exp().sum()
    edge = torch.autograd.graph.get_gradient_edge(w)
    keep = edge if as_ == "edge" else edge.node
    reports = []
    caught = _record(lambda: reports.append(gp.explain(y, keep=keep)))
    assert len(caught) == 1 and "keep= names only leaf tensors" in str(caught[0].message)
    named = "the gradient edge into AccumulateGrad" if as_ == "edge" else "node AccumulateGrad"
    assert [k.reason for k in reports[0].kept] == [f"keep: {named}"]  # named as a user reads it


@pytest.mark.parametrize("how", ["other_graph", "released_graph", "earlier_batch"])
def test_keep_that_reaches_nothing_of_the_graph_warns_it_protects_nothing(how):
    # a leaf warned; a tensor of another graph (a typo) released the trunk silently, and
    # another forward's through the same parameter (an earlier batch's x) still does
    w, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y = x.sin().sum()
        other = {"other_graph": lambda: v.exp(), "released_graph": lambda: x.cos(),
                 "earlier_batch": lambda: (w * 2).exp()}[how]()
    if how == "released_graph":
        other.sum().backward(retain_graph=True)
        gp.prune_after(other.sum(), keep=[])  # other's graph, x's with it, released
        with gp.track():
            y = (w * 2).sin().sum()
    caught = _record(lambda: gp.backward(y, keep=other))
    assert len(caught) == 1
    assert "keep= reaches no node of the graph of" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_keep_that_reaches_nothing_warns_once_per_call_site_whatever_the_batch_shape():
    # the message names y's shape: each new batch size (an epoch's last batch) warned again
    w, v = torch.ones(3, 5, requires_grad=True), torch.ones(5, requires_grad=True)

    def steps():
        for n in [8, 8, 5, 7, 5]:
            with gp.track():
                stale = v.exp()  # another graph's tensor: keep= of it protects nothing here
                y = (torch.ones(n, 3) @ w).sin()
            gp.backward(y, torch.ones_like(y), keep=stale)

    caught = _record(steps)
    assert len(caught) == 1 and "keep= reaches no node of the graph of" in str(caught[0].message)
    assert "shape (8, 5)" in str(caught[0].message)  # the first call's text, in full


def test_keep_that_meets_the_graph_does_not_warn():
    w, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y = (x * v.exp()).sin().sum()
        other = v.exp()
    assert _record(lambda: gp.explain(y, keep=[x])) == []
    assert _record(lambda: gp.explain(y, keep=[other, x])) == []

def test_graph_built_under_no_grad_is_an_error_that_says_so():
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        y = w.exp().sum()
    message = r"y has no grad_fn \(it does not require grad: made under torch.no_grad"
    with pytest.raises(ValueError, match=message):
        gp.prune_after(y)


def _held_sum_steps(batches, action):
    """Steps whose batch sizes differ, a sum of the losses held for logging: the warning's
    bytes change from step to step."""
    torch.manual_seed(0)
    w = torch.randn(32, 64, requires_grad=True)
    heads = [torch.randn(64, 16, requires_grad=True) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for n in batches:
            with gp.track():
                x = (torch.randn(n, 32) @ w).relu()
                l0 = (x @ heads[0]).pow(2).mean()
                l1 = (x @ heads[1]).sin().mean()
                total = l0 + l1  # noqa: F841 (held for logging)
            gp.backward(l0)
            gp.backward(l1)
            del total
    return [w for w in caught if issubclass(w.category, gp.GraphPruneWarning)]


def test_a_warning_whose_numbers_change_is_still_filed_once_per_call_site():
    caught = _held_sum_steps([64, 48, 32], "default")
    assert len(caught) == 2  # the two gp.backward lines, once each
    assert len({w.lineno for w in caught}) == 2
    assert all("20.0 KiB" in str(w.message) for w in caught)  # the first step's numbers, in full


def test_a_warning_whose_numbers_change_is_shown_every_time_under_always():
    caught = _held_sum_steps([64, 48, 32], "always")
    assert len(caught) == 6
    assert len({str(w.message) for w in caught}) == 3  # a step's two lines say the same


def test_a_warning_from_code_exec_d_past_the_module_s_last_line_is_still_shown(tmp_path):
    """Code exec'd with a module's globals, whose loader gives that module's source: a
    line past its end made warn_explicit raise IndexError (a script's ``__main__``, a
    runner's module), where plain warnings.warn from the same line warns."""
    path = tmp_path / "runner.py"
    path.write_text("def run(source, names):\n"
                    "    exec(compile(source, '<string>', 'exec'), globals(), names)\n")
    spec = importlib.util.spec_from_file_location("graphprune_test_runner", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        y = (w.exp() * w).sum()
    source = "\n" * 30 + "gp.explain(y, keep=w)\n"  # keep= of leaves only: it warns
    caught = _record(lambda: runner.run(source, {"gp": gp, "y": y, "w": w}))
    assert len(caught) == 1
    assert (caught[0].filename, caught[0].lineno) == ("<string>", 31)


def test_a_warning_made_an_error_by_a_filter_is_raised_once_as_itself():
    with warnings.catch_warnings():
        warnings.simplefilter("error", gp.GraphPruneWarning)
        with pytest.raises(gp.GraphPruneWarning):
            gp.backward(_outside_track())


def test_a_file_beside_the_package_whose_name_starts_like_it_is_yours():
    # ".../graphprune_demo.py" began with the package's folder name: its frames were
    # skipped as graphprune's, the warning filed inside graphprune, the tensors
    # described as created at <unknown>
    path = os.path.dirname(gp.__file__) + "_demo.py"
    source = ("with gp.track():\n    x = w.exp()\n    y = (x * w).sum()\n"
              "gp.explain(y, keep=w)\nmessage = str(gp.explain(y, keep=x))\n")
    names = {"gp": gp, "w": torch.ones(3, requires_grad=True)}
    caught = _record(lambda: exec(compile(source, path, "exec"), names))
    assert [(w.filename, w.lineno) for w in caught] == [(path, 4)]
    assert "created at graphprune_demo.py:2" in names["message"]


@pytest.mark.parametrize("strategy", ["cut", "passes", "grads"])
def test_per_loss_helpers_look_for_a_held_sum_once_per_call(strategy, monkeypatch):
    # with another loss pending (aux, backpropagated after), every pass walked every
    # pending loss's graph: T^2 walks per call
    calls = []
    look = gp._plan.Plan._held_by_sums

    def counted(self, later=()):
        calls.append(1)
        return look(self, later)

    monkeypatch.setattr(gp._plan.Plan, "_held_by_sums", counted)
    w = torch.randn(64, 64, requires_grad=True)
    with gp.track():
        x = (w @ w).exp().sum(0)  # the trunk holds most of the graph: each head frees under 10%
        losses = [(x * i).sin().sum() for i in range(1, 5)]
        aux = x.cos().sum()  # a later loss of its own
    caught, _ = _per_loss(strategy, losses, w)
    assert caught == [] and len(calls) <= 1
    gp.backward(aux)
