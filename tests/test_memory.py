"""Memory really comes back: measured by RSS in fresh processes and by handle state."""

import gc
import weakref

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
