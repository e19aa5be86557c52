"""gp.Timeline: the bytes it records agree with the reports; tracking without the
options makes nothing new per op."""

from __future__ import annotations

import gc
import re
import xml.etree.ElementTree as ET

import torch
from torch import nn
from torch.nn.modules import module as nn_module

import graphprune as gp
from graphprune import _outputs, _saved

F32 = 4


def test_frees_match_the_reports():
    w = torch.ones(256, requires_grad=True)
    tl = gp.Timeline()
    with gp.track(timeline=tl):
        held = [w.exp()]  # x, in a list: see the note at ``held.clear()``
        y1 = held[0].sin().exp().sum()  # the inner exp saves its output: the branch's own tensor
        y2 = held[0].cos().sum()
    assert tl.bytes == tl.peak == 2 * 256 * F32
    before = tl.bytes
    r1 = gp.backward(y1)  # y2 keeps x's graph
    assert r1.bytes_freed == 256 * F32 and before - tl.bytes == r1.bytes_freed
    assert tl.bytes == r1.bytes_kept == 256 * F32
    assert any(e.kind == "free" and e.in_backward for e in tl.events)  # freed during the pass
    # now only the graph holds x. (Not ``del x``: on Python 3.11 a gp call that looked up
    # names in this frame's f_locals leaves a snapshot of the locals that holds x.)
    held.clear()
    r2 = gp.backward(y2)
    assert r2.bytes_freed == 256 * F32 and tl.bytes == 0
    assert [e.bytes for e in tl.events if e.kind == "pack"] == [1024, 1024, 2048, 2048]


def test_plain_pytorch_frees_are_seen():
    w = torch.ones(64, requires_grad=True)
    tl = gp.Timeline()
    with gp.track(timeline=tl):
        y = w.exp().sin().sum()
    assert tl.bytes == 64 * F32  # exp's output, which sin saves too
    y.backward()  # no retain_graph: PyTorch drops the handles
    assert tl.bytes == 0 and tl.events[-1].kind == "free"
    with gp.track(timeline=tl):
        y = w.exp().sin().sum()
    assert tl.bytes == 64 * F32
    del y  # the graph dies
    assert tl.bytes == 0 and tl.peak == 64 * F32


def test_parameters_are_not_counted():
    lin = nn.Linear(4, 3)
    inp = torch.randn(2, 4)
    tl = gp.Timeline()
    with gp.track(timeline=tl):
        out = lin(inp).relu().sum()
    assert tl.bytes == inp.nbytes + 2 * 3 * F32  # the input and relu's output, not weight.t()
    out.backward()
    assert tl.bytes == 0


def test_marks_and_plot(tmp_path):
    runs = []
    for label, pruned in (("retain_graph=True", False), ("gp.backward", True)):
        w = torch.ones(1024, requires_grad=True)
        tl = gp.Timeline(label)
        with gp.track(timeline=tl):
            x = w.exp()
            losses = [x.sin().sum(), x.cos().sum()]
        tl.mark("forward")
        for i, loss in enumerate(losses):
            gp.backward(loss) if pruned else loss.backward(retain_graph=True)
            tl.mark(f"after head {i}")
        runs.append(tl)
        del x, losses, loss
    assert [e.bytes for e in runs[0].events if e.kind == "mark"] == [4096] * 3  # x, saved by exp, sin, cos
    assert [e.bytes for e in runs[1].events if e.kind == "mark"] == [4096, 4096, 0]
    path = tmp_path / "memory.svg"
    gp.plot_timeline(runs, str(path), title="two strategies")
    texts = ["".join(t.itertext()) for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")]
    for text in ("forward", "after head 0", "after head 1", "two strategies",
                 "retain_graph=True (peak 0.0 MiB)", "gp.backward (peak 0.0 MiB)"):
        assert text in texts, text
    svg = path.read_text()
    assert len(re.findall(r'<g id="line2d_\d+">', svg)) >= 2


def _new_objects_per_op(tape_kwargs: dict, in_module: bool) -> dict:
    """New gc-tracked objects per op of a forward of sin ops, by type name, from the
    difference between forwards of 200 and 400 ops (fixed costs cancel)."""
    counts = []
    for n in (200, 400):
        w = torch.ones(4, requires_grad=True)
        step = nn.Identity()
        gc.collect()
        gc.disable()
        try:
            _outputs._compact()
            before = {id(o) for o in gc.get_objects()}
            with gp.track(**tape_kwargs):
                h = w
                for _ in range(n):
                    h = step(h).sin() if in_module else h.sin()
            _outputs._compact()  # the records of dead intermediates go, whether the close dropped them or not
            new = [type(o).__name__ for o in gc.get_objects() if id(o) not in before]
        finally:
            gc.enable()
        counts.append(new)
        del h
    out = {}
    for name in set(counts[0]) | set(counts[1]):
        per_op = (counts[1].count(name) - counts[0].count(name)) / 200
        if abs(per_op) > 0.05:
            out[name] = round(per_op, 1)
    return out


def test_no_new_object_per_op_without_the_options():
    plain = _new_objects_per_op({}, in_module=False)
    assert plain == _new_objects_per_op(dict(timeline=None, modules=False), in_module=False)
    assert plain == _new_objects_per_op(dict(modules=True), in_module=False)  # no module call: nothing
    assert not {"Timeline", "ModuleRecorder", "Event", "function", "cell", "list"} & set(plain)


def test_module_names_cost_one_list_per_module_call():
    plain = _new_objects_per_op({}, in_module=True)
    named = _new_objects_per_op(dict(modules=True), in_module=True)
    assert named == {**plain, "list": plain.get("list", 0) + 1.0}  # [start, end, name]


def test_default_track_installs_the_plain_hooks():
    pre, post = len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)
    with gp.track():
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top[0].__code__ is _saved.pack_hook(0).__code__  # graphprune's own pack, no timeline
        assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == (pre, post)
    with gp.track(modules=True):
        assert len(nn_module._global_forward_pre_hooks) == pre + 1
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == (pre, post)
