"""Memory really comes back: measured by RSS in fresh processes and by handle state."""

import contextlib
import gc
import re
import warnings
import weakref

import pytest
import torch

import graphprune as gp
from graphprune._graph import name, saved, walk

from _subprocess import run_script

MiB = 2**20

RSS_PRELUDE = """
import json, psutil, torch, graphprune as gp
MiB = 2**20
N = 64 * MiB // 4
rss = lambda: psutil.Process().memory_info().rss
"""


def test_prune_gives_back_branch_bytes_and_keeps_trunk():
    out = run_script(
        RSS_PRELUDE
        + """
w = torch.randn(N, requires_grad=True)
with gp.track():
    x = w.exp()            # trunk: ExpBackward0 saves x
    h = x.sin()            # branch: SinBackward0 saves x (shared with the trunk)
    y1 = h.cos().sum()     # branch: CosBackward0 saves h, 64 MiB only the branch holds
del h
y1.backward(retain_graph=True)
before = rss()
report = gp.prune_after(y1, keep=x)
after = rss()
x.sum().backward()       # the trunk still works
print(json.dumps(dict(freed=before - after, reported=report.bytes_freed, kept=report.bytes_kept)))
"""
    )
    assert out["reported"] == 64 * MiB
    assert out["kept"] == 64 * MiB
    assert 60 * MiB <= out["freed"] <= 72 * MiB, out


def test_backward_keep_releases_branch_during_the_pass():
    w = torch.randn(1000, requires_grad=True)
    with gp.track():
        x = w.exp()
        h = x.sin()
        y1 = h.cos().sum()
    del h
    seen = []
    x.register_hook(lambda g: seen.append(gp.explain(y1, keep=x).released_tensors))
    report = gp.backward(y1, keep=x)
    assert report.released_tensors == 2
    assert seen == [0], "branch tensors must be gone before the pass reaches the trunk"


def test_backward_keep_peak_matches_plain_backward():
    out = run_script(
        RSS_PRELUDE
        + """
def step(mode):
    w = torch.randn(N, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = x.sin().cos().sin().cos().sum()   # a branch of 64 MiB saved tensors
    peak = []
    x.register_hook(lambda g: peak.append(rss()))
    if mode == "retain":
        y1.backward(retain_graph=True)
    else:
        gp.backward(y1, keep=x)
    return peak[0]
base = rss()
retain = step("retain") - base
base = rss()
keep = step("keep") - base
print(json.dumps(dict(retain=retain, keep=keep)))
"""
    )
    # At the trunk, retain_graph=True still holds the 3 branch-only activations.
    assert out["retain"] - out["keep"] >= 3 * 60 * MiB, out


def test_no_leak_when_user_drops_tensors():
    w = torch.randn(1000, requires_grad=True)
    gc.disable()
    try:
        with gp.track() as tape:
            x = w.exp()
            y1 = (x.sin() * x).sum()
        y1.backward(retain_graph=True)
        report = gp.prune_after(y1)
        graph = tape.graph()
        explained = gp.explain(y1)
        refs = [weakref.ref(x), weakref.ref(y1)]
        handles = [weakref.ref(h) for node in walk([y1.grad_fn]) for h in saved(node)[0]]
        assert any(r() is not None for r in handles)
        del x, y1
        assert [r() for r in refs] == [None, None]
        assert all(r() is None for r in handles), "a saved tensor outlived its graph"
    finally:
        gc.enable()
    assert graph.number_of_nodes() > 0 and report.call and explained.dry_run


def test_no_rss_leak_when_graph_is_dropped_while_tape_is_held():
    out = run_script(
        RSS_PRELUDE
        + """
w = torch.randn(N, requires_grad=True)
base = rss()
with gp.track() as tape:
    x = w.exp()
    y1 = (x.sin() * x).sum()
report = gp.explain(y1)
graph = tape.graph()
held = rss() - base
del x, y1
print(json.dumps(dict(held=held, after=rss() - base)))
"""
    )
    assert out["held"] >= 120 * MiB
    assert out["after"] <= 8 * MiB, out


class _Sentinel:
    """Dies with the metadata dict of the node it is put in."""


def test_walked_nodes_die_with_their_graph():
    w = torch.randn(3, requires_grad=True)
    sentinels = []
    for _ in range(50):
        with gp.track():
            y = (w.exp() * 2).sum()
        gp.explain(y)  # caches each node's children in its metadata
        for node in walk([y.grad_fn]):
            if name(node) != "AccumulateGrad":
                sentinels.append(_Sentinel())
                node.metadata["test.sentinel"] = sentinels[-1]
                sentinels[-1] = weakref.ref(sentinels[-1])
        y.backward()
        del y, node
    assert len(sentinels) == 150 and all(r() is None for r in sentinels), "a walked node outlived its graph"


def test_records_of_intermediates_that_died_are_dropped_during_the_forward():
    # NOTE [ Records that die young ]: within one long forward, not only at its end,
    # so that they do not outlive Python's young collections
    from graphprune import _outputs

    before = list(_outputs._outputs)
    known = set(map(id, before))
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        h = w
        dead = []
        for i in range(5000):
            h = h.sin()
            if i % 500 == 499:
                dead.append(sum(id(r) not in known and r() is None for r in _outputs._outputs))
    assert max(dead) <= _outputs.TAIL, dead
    assert _outputs.output_of(h) is not None


def test_a_closed_tape_keeps_no_record_of_the_intermediates_that_died():
    # A forward's intermediates die as it goes (the graph holds detached copies); their
    # records (one weak reference each) are dropped as it goes and when the tape closes,
    # not left for every full collection to walk until the list outgrows its limit.
    from graphprune import _outputs

    before = list(_outputs._outputs)  # held: their ids stay theirs
    known = set(map(id, before))
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        h = w
        for _ in range(5000):
            h = h.sin()
    assert [r for r in _outputs._outputs if id(r) not in known and r() is None] == []
    assert len(_outputs._outputs) <= len(before) + 1
    assert _outputs.output_of(h) is not None  # the live output is still known
    gp.prune_after(h.sum())  # and still protects nothing it should not: a plain prune
    del h


# NOTE [ Outputs saved as they are ] in _plan.py: other hooks that pack a tensor as it is
# make a node's saved output hold the node, a cycle only a pass that does not retain the
# graph breaks; the collector cannot, so a weak reference to that output tells a leak.
def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


_OTHER_HOOKS = {"save_on_cpu": torch.autograd.graph.save_on_cpu, "identity hooks": _identity_hooks}


def _step_under_other_hooks(hooks, passes):
    """A trunk activation that ``hooks`` save as it is, two heads on it, the step's
    ``passes``; a weak reference to the activation once the step's tensors are dropped,
    and the weight's gradient."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
    with gp.track():
        with _OTHER_HOOKS[hooks]():
            h = torch.tanh(x @ w)  # TanhBackward0 saves its output: h itself
        probe = weakref.ref(h)
        l1, l2 = h.sin().mean(), (h * h).exp().mean()
    del h
    passes(w, l1, l2)
    del l1, l2
    gc.collect()
    return probe, w.grad


def _plain(w, l1, l2):
    l1.backward(retain_graph=True)
    l2.backward()


def _routed(w, l1, l2):
    with gp.pruning():  # as the user wrote it: the last pass runs as written, and frees the graph
        l1.backward(retain_graph=True)
        l2.backward()


def _backward_then_plain_last(w, l1, l2):
    gp.backward(l1)  # l2 is live: protected, so no cycle warning
    gp.backward(l2, retain_graph=False)


_LAST_PASSES = {
    "gp.backward, retain_graph=False last": _backward_then_plain_last,
    "backward_each cut": lambda w, l1, l2: gp.backward_each([l1, l2]),
    "backward_each passes": lambda w, l1, l2: gp.backward_each([l1, l2], strategy="passes"),
    "pruning()": _routed,
}


@pytest.mark.filterwarnings("error::graphprune.GraphPruneWarning")
@pytest.mark.parametrize("passes", list(_LAST_PASSES))
@pytest.mark.parametrize("hooks", list(_OTHER_HOOKS))
def test_a_last_pass_frees_what_other_hooks_saved_as_it_is(hooks, passes):
    probe, grad = _step_under_other_hooks(hooks, _LAST_PASSES[passes])
    plain_probe, expected = _step_under_other_hooks(hooks, _plain)
    assert plain_probe() is None  # plain PyTorch's last pass breaks the cycle
    assert probe() is None, "the step's last pass left a cycle that holds the activation"
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("hooks", list(_OTHER_HOOKS))
def test_a_retaining_pass_that_keeps_a_cycle_says_so_once_per_line(hooks):
    def passes(w, l1, l2):
        gp.backward(l1)  # l2 is live: protected, so this one keeps the region for it in silence
        gp.backward(l2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):  # two steps, one line
            _, grad = _step_under_other_hooks(hooks, passes)
    assert [(w.category, w.filename) for w in caught] == [(gp.GraphPruneWarning, __file__)]
    assert re.search(r"saved the output of 1 node\(s\) .* as it is .* graphprune.backward\(\.\.\., "
                     r"retain_graph=False\)", str(caught[0].message)), caught[0].message
    _, expected = _step_under_other_hooks(hooks, _plain)
    torch.testing.assert_close(grad, expected)


def test_backward_each_last_pass_frees_a_cycle_a_disjoint_live_loss_does_not_reach():
    v = torch.randn(3, requires_grad=True)
    with gp.track():
        other = (v * 2).sum()  # another graph's loss, live: it protects nothing of this one

        def passes(w, l1, l2):
            gp.backward_each([l1, l2])

        probe, grad = _step_under_other_hooks("identity hooks", passes)
    _, expected = _step_under_other_hooks("identity hooks", _plain)
    assert probe() is None
    torch.testing.assert_close(grad, expected)
    other.backward()
    torch.testing.assert_close(v.grad, torch.full((3,), 2.0))


def _head_step(hooked, passes):
    """A trunk ``h``, a head ``g = tanh(2 h)`` whose output is saved as it is where
    ``hooked`` says (and the trunk's too), ``l1`` from ``g``, ``l2`` from ``h``; a weak
    reference to ``g`` once the step's tensors are dropped, and the weight's gradient."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
    with gp.track():
        with _identity_hooks() if "trunk" in hooked else contextlib.nullcontext():
            h = torch.tanh(x @ w)
        with _identity_hooks() if "head" in hooked else contextlib.nullcontext():
            g = torch.tanh(h * 2)
        probe = weakref.ref(g)
        l1, l2 = g.sin().mean(), (h * h).exp().mean()
    del h, g
    passes(l1, l2)
    del l1, l2
    gc.collect()
    return probe, w.grad


@pytest.mark.parametrize("hooked", ["head", "head and trunk"])  # the cut's node tracked, or not: capture
def test_backward_each_cut_frees_a_cycle_in_an_earlier_head(hooked):
    probe, grad = _head_step(hooked, lambda l1, l2: gp.backward_each([l1, l2]))
    plain_probe, expected = _head_step(hooked, lambda l1, l2: (l1 + l2).backward())
    assert plain_probe() is None
    assert probe() is None, "l1's head pass retained the cycle in its head"
    torch.testing.assert_close(grad, expected)


def test_backward_each_cut_keeps_a_cycle_in_a_head_a_later_pass_needs():
    def passes(l1, l2):
        later = l1 * 3  # in l1's graph: a pass after the call runs its head again
        gp.backward_each([l1, l2], keep=[later])
        later.backward()

    _, grad = _head_step("head", passes)
    _, expected = _head_step("head", lambda l1, l2: (l1 * 4 + l2).backward())
    torch.testing.assert_close(grad, expected)


def test_backward_each_of_stacked_losses_keeps_a_head_a_stack_shares_and_gets_the_gradients():
    _, grad = _head_step("head", lambda l1, l2: gp.backward_each(torch.stack([l1, l2])))
    _, expected = _head_step("head", lambda l1, l2: (l1 + l2).backward())
    torch.testing.assert_close(grad, expected)


def _unbound_heads_step(passes):
    """Two heads unbound from one trunk tensor, all under identity hooks (their exp saves
    its output as it is); weak references to the activations after the step, and the
    weights' gradients."""
    torch.manual_seed(0)
    w, a, b = (torch.randn(6, 6, requires_grad=True) for _ in range(3))
    with gp.track(), _identity_hooks():
        x = (torch.randn(2, 6) @ w).tanh()
        top, bottom = x.unbind(0)
        e1, e2 = (top @ a).exp(), (bottom @ b).exp()
        losses = [e1.sum(), e2.sum()]
    probes = [weakref.ref(t) for t in (x, e1, e2)]
    del x, top, bottom, e1, e2
    passes(losses)
    del losses
    gc.collect()
    return [p() is not None for p in probes], [w.grad, a.grad, b.grad]


def test_backward_each_cut_frees_heads_that_share_a_routing_node_that_saves_nothing():
    alive, grads = _unbound_heads_step(gp.backward_each)  # both heads run UnbindBackward0
    plain_alive, expected = _unbound_heads_step(lambda losses: sum(losses).backward())
    assert alive == plain_alive == [False] * 3
    torch.testing.assert_close(grads, expected)


@pytest.mark.parametrize("per_loss", ["backward_each passes", "grads_each"])
def test_every_pass_frees_a_cycle_in_a_graph_no_other_loss_reaches(per_loss):
    # per-domain batches: each loss's graph its own, a cycle in the first
    def step(passes):
        torch.manual_seed(0)
        w, v = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
        with gp.track(), _identity_hooks():
            x1, x2 = (torch.randn(2, 6) @ w).exp(), (torch.randn(2, 6) @ v).exp()
            losses = [x1.sum(), x2.sum()]
        probes = [weakref.ref(x1), weakref.ref(x2)]
        del x1, x2
        got = passes(w, v, losses)
        del losses
        gc.collect()
        return [p() is not None for p in probes], got

    def rows(w, v, losses):
        return gp.grads_each(losses, [w, v], allow_unused=True)

    def plain_rows(w, v, losses):
        return [torch.autograd.grad(loss, [w, v], allow_unused=True) for loss in losses]

    def passes(w, v, losses):
        gp.backward_each(losses, strategy="passes")
        return [w.grad, v.grad]

    def plain(w, v, losses):
        sum(losses).backward()
        return [w.grad, v.grad]

    ours, theirs = (rows, plain_rows) if per_loss == "grads_each" else (passes, plain)
    alive, got = step(ours)
    _, expected = step(theirs)
    assert alive == [False, False]
    torch.testing.assert_close(got, expected)


def test_backward_each_under_other_hooks_does_not_say_nothing_can_be_released_when_a_pass_freed_it():
    w, a, b = (torch.randn(6, 6, requires_grad=True) for _ in range(3))
    with gp.track(), _identity_hooks():
        z = (torch.randn(2, 6) @ w).tanh()
        losses = torch.stack([(z @ a).exp().sum(), (z @ b).exp().sum()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = gp.backward_each(losses)
    assert sum(r.released_node_count for r in reports) > 0
    assert not [w for w in caught if "nothing can be released" in str(w.message)], caught[0].message


def test_a_graph_all_under_other_hooks_warns_of_its_cycle_not_of_a_forward_outside_track():
    w = torch.randn(6, 6, requires_grad=True)
    with gp.track(), _identity_hooks():
        loss = (torch.randn(2, 6) @ w).exp().sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gp.backward(loss)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "other saved-tensor hooks saved the output" in messages[0], messages


def test_grads_each_last_pass_frees_what_other_hooks_saved_as_it_is():
    got, expected = [], []

    def rows(w, l1, l2):
        got.extend(gp.grads_each([l1, l2], [w]))

    def plain_rows(w, l1, l2):
        expected.extend([torch.autograd.grad(l1, [w], retain_graph=True), torch.autograd.grad(l2, [w])])

    probe, _ = _step_under_other_hooks("save_on_cpu", rows)
    _step_under_other_hooks("save_on_cpu", plain_rows)
    assert probe() is None
    torch.testing.assert_close(got, expected)


def test_a_pass_that_protects_a_later_loss_keeps_what_other_hooks_saved_for_it():
    def passes(w, l1, l2):
        report = gp.backward(l1)  # l2 has not run: the region stays for its pass
        assert any("other saved-tensor hooks" in k.reason for k in report.kept), report
        l2.backward()

    probe, grad = _step_under_other_hooks("save_on_cpu", passes)
    _, expected = _step_under_other_hooks("save_on_cpu", _plain)
    torch.testing.assert_close(grad, expected)
    assert probe() is None


def _trunk_under(hooks, w, x):
    """The trunk activation, saved by ``hooks``: as it is, or by a checkpoint whose
    region a head under identity hooks follows (a cycle in the head only)."""
    if hooks == "checkpoint, identity-hooked head":
        h = torch.utils.checkpoint.checkpoint(lambda x: torch.tanh(x @ w), x, use_reentrant=False)
        with _identity_hooks():
            return h, torch.tanh(h).sin().mean()
    with _OTHER_HOOKS[hooks]():
        h = torch.tanh(x @ w)
    return h, h.sin().mean()


@pytest.mark.parametrize("after", ["inside track()", "outside track()"])
@pytest.mark.parametrize("hooks", [*_OTHER_HOOKS, "checkpoint, identity-hooked head"])
def test_a_later_loss_graphprune_cannot_see_still_runs_through_what_other_hooks_hold(hooks, after):
    # regression: a pass that protects nothing and meets a cycle ran without retain_graph,
    # and freed the trunk under a loss made after it (NOTE [ Outputs saved as they are ])
    torch.manual_seed(0)
    w, x = torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
    with gp.track():
        h, l1 = _trunk_under(hooks, w, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gp.backward(l1)  # the checkpoint's head is all under identity hooks: nothing tracked, too
        assert [w for w in caught if "as it is (identity" in str(w.message)], [str(w.message) for w in caught]
        if after == "inside track()":
            l2 = (h * h).exp().mean()
    if after == "outside track()":
        l2 = (h * h).exp().mean()
    l2.backward()
    torch.manual_seed(0)
    w_ref, x = torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
    h, l1 = _trunk_under(hooks, w_ref, x)
    l1.backward(retain_graph=True)
    (h * h).exp().mean().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_a_pass_that_frees_what_other_hooks_held_reports_it_released_not_kept():
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)
    reports = {}
    for retain in (None, False):
        with gp.track():
            with torch.autograd.graph.save_on_cpu():
                h = torch.tanh(x @ w)
            loss = h.sin().sum()
        del h
        with pytest.warns() if retain is None else contextlib.nullcontext():
            reports[retain] = gp.backward(loss, retain_graph=retain)
    assert reports[False].kept == () and reports[False].bytes_kept == 0, reports[False]  # the pass freed it
    assert {"TanhBackward0", "MmBackward0", "SinBackward0"} <= set(reports[False].released_nodes)
    assert [k.reason for k in reports[None].kept if "other saved-tensor hooks" in k.reason], reports[None]


def test_a_pass_that_frees_a_checkpointed_region_keeps_none_of_its_inputs_bytes_in_the_report():
    w = torch.randn(64, 64, requires_grad=True)
    with gp.track():
        h = (w * 2).tanh()  # the region's input, which graphprune holds for it
        loss = torch.utils.checkpoint.checkpoint(lambda t: (t @ t).sin(), h, use_reentrant=False).sum()
    report = gp.backward(loss, retain_graph=False)
    assert report.kept == () and report.bytes_kept == 0, report
    assert {"SinBackward0", "MmBackward0"} <= set(report.released_nodes), report


def test_a_graph_built_outside_track_stays_for_a_later_pass_when_no_cycle_asks_to_free_it():
    # the trunk and one head built outside track(): graphprune cannot see that head, so it
    # keeps what it did not build, and a pass without retain_graph is only for a cycle
    w = torch.randn(4, requires_grad=True)
    x = w.exp()
    untracked = x.cos().sum()
    with gp.track():
        tracked = x.sin().sum()
    report = gp.backward(tracked)
    assert any("outside graphprune.track()" in k.reason for k in report.kept), report
    untracked.backward()  # the trunk is still there
    torch.testing.assert_close(w.grad, (w.exp().cos() - w.exp().sin()).detach() * w.exp().detach())
