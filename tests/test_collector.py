"""NOTE [ The collector and the walk ]: prunes run no cyclic collection, and leave the
collector as they found it."""

import gc
import sys
import threading
import warnings
import weakref

import pytest
import torch

import graphprune as gp
from graphprune import _collector, _graph, _plan


@pytest.fixture
def restore_gc():
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


def _chain(n=300):
    w = torch.randn(8, requires_grad=True)
    with gp.track():
        h = w
        for _ in range(n):
            h = h.sin()
        x = h
        for _ in range(n):
            h = h.cos()
        y = h.sum()
    return x, y


_WALKING = {_graph.reach.__code__, _plan.Plan._measure.__code__}


def test_walks_run_no_collection(restore_gc):
    x, y = _chain()
    y.backward(retain_graph=True)
    during_walk = []

    def watch(phase, info):
        if phase == "start":
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code in _WALKING:
                    during_walk.append(info["generation"])
                    break
                frame = frame.f_back

    gc.set_threshold(1)  # a young collection at every allocation the collector sees
    gc.callbacks.append(watch)
    try:
        seen = []
        gc.callbacks.append(lambda phase, info: seen.append(phase))
        gp.explain(y, keep=x)
        gp.prune_after(y, keep=x)
        gc.callbacks.pop()
    finally:
        gc.callbacks.remove(watch)
    assert seen, "the threshold of 1 ran no collection at all: the test sees nothing"
    assert during_walk == []
    assert gc.isenabled()


def test_collector_left_as_found(restore_gc):
    x, y = _chain(20)
    y.backward(retain_graph=True)
    gc.disable()
    gp.explain(y, keep=x)
    assert not gc.isenabled()  # the user's choice stands
    gc.enable()
    gp.prune_after(y, keep=x)
    assert gc.isenabled()


def test_collector_nested_and_concurrent_pauses_resume_once(restore_gc):
    inner_off = threading.Event()
    release = threading.Event()

    def other():
        with _collector.paused():
            inner_off.set()
            release.wait(5)

    with _collector.paused():
        thread = threading.Thread(target=other)
        thread.start()
        assert inner_off.wait(5)
    assert not gc.isenabled()  # the other thread's walk still runs
    release.set()
    thread.join()
    assert gc.isenabled()


def test_collector_resumes_when_a_walk_raises(restore_gc):
    x, y = _chain(20)
    with pytest.raises(TypeError, match="keep must be a tensor"):
        gp.prune_after(y, keep="x")  # raised inside the plan, after the walk from y
    assert gc.isenabled()
    with pytest.raises(ValueError, match="no grad_fn"):
        gp.prune_after(torch.ones(2, requires_grad=True))
    assert gc.isenabled()


def test_the_plan_is_dropped_before_the_collector_resumes(restore_gc):
    # the young collection the walk made due looks at what outlives the call, not at
    # the plan's lists and dicts of nodes and handles
    x, y = _chain(50)
    y.backward(retain_graph=True)
    plans = []
    made = _plan.Plan.__init__

    def keep_a_weak_reference(self, *args, **kwargs):
        made(self, *args, **kwargs)
        plans.append(weakref.ref(self))

    alive_at_resume = []
    unpause = _collector._unpause

    def watch_resume():
        alive_at_resume.append(sum(ref() is not None for ref in plans))
        unpause()

    _plan.Plan.__init__, _collector._unpause = keep_a_weak_reference, watch_resume
    try:
        gp.explain(y, keep=x)
        gp.prune_after(y, keep=x)
    finally:
        _plan.Plan.__init__, _collector._unpause = made, unpause
    assert len(plans) == 2
    assert alive_at_resume[-1] == 0  # the outermost pause, the last to end


def test_a_warning_is_shown_with_the_collector_on(restore_gc):
    w = torch.randn(8, requires_grad=True)
    y = w.sin().sum()  # built outside track(): prune_after warns that it frees nothing
    y.backward(retain_graph=True)
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning
        warnings.showwarning = lambda *args, **kwargs: shown.append(gc.isenabled())
        try:
            gp.prune_after(y)
        finally:
            warnings.showwarning = original
    assert shown == [True]
