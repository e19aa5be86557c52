"""gp.render: the picture says what the prune does (colours from the report), read back
from the .dot and .svg files it writes."""

from __future__ import annotations

import collections
import re
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import graphprune as gp
from graphprune._render import KEEP_COLOURS, STATES

RELEASE, KEEP0 = STATES["release"][0], KEEP_COLOURS[0]
_ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[\w.]+)')


def parse_dot(path) -> tuple[dict, list, dict]:
    """``(nodes, edges, legend)``: graph nodes and legend entries as ``{id: attrs}``."""
    nodes, edges, legend = {}, [], {}
    with open(path) as f:
        text = f.read()
    for line in text.splitlines():
        edge = re.fullmatch(r"\s*(\w+) -> (\w+);", line)
        node = re.fullmatch(r"\s*(\w+) \[(.*)\];", line)
        if edge:
            edges.append(edge.groups())
        elif node and node.group(1) not in ("graph", "node"):
            attrs = {k: v.strip('"').replace("\\n", "\n") for k, v in _ATTR.findall(node.group(2))}
            (legend if attrs.get("class") == "legend" else nodes)[node.group(1)] = attrs
    return nodes, edges, legend


def _seed():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x = w + 10
        x1 = x * x
        y1 = (x1 * x1).sum()
    return w, x, y1


def test_dot_of_the_seed_example(tmp_path):
    w, x, y1 = _seed()
    path = tmp_path / "seed.dot"
    report = gp.render(y1, keep=x, path=str(path))
    nodes, edges, legend = parse_dot(path)
    assert len(nodes) == 5 and len(edges) == 4  # Sum, Mul, Mul, Add, AccumulateGrad
    by_class = {}
    for a in nodes.values():
        by_class.setdefault(a["class"], []).append(a)
    assert len(by_class["release"]) == 3 and report.released_node_count == 2  # Sum saves nothing
    assert len(by_class["keep0"]) == 2 and report.kept[0].nodes == 2
    assert {a["fillcolor"] for a in by_class["release"]} == {RELEASE}
    assert {a["fillcolor"] for a in by_class["keep0"]} == {KEEP0}
    labels = [a["label"] for a in nodes.values()]
    assert "[y]\nSumBackward0" in labels and "[keep]\nAddBackward0" in labels
    assert sum(label == "MulBackward0\n12 B" for label in labels) == 2  # x, x1: 3 floats each
    assert "AccumulateGrad\n(3,)" in labels
    assert any(a["penwidth"] == "3" for a in nodes.values() if "[y]" in a["label"])
    assert "would be released by this prune" in [a["label"] for a in legend.values()]
    kept = [a["label"] for a in legend.values() if a["label"].startswith("kept")]
    assert kept == [f"kept (0 B): {report.kept[0].reason}"] and "created at test_render.py" in kept[0]
    assert report.kept[0].saved_bytes == 0  # w + 10 saves nothing
    assert "legend_y" in legend and "legend_keep" in legend


def test_colours_are_the_reports(tmp_path, multitask, images):
    from graphprune._render import model

    inp, target = images
    with gp.track():
        feat = multitask.trunk(inp)
        l1 = torch.nn.functional.cross_entropy(multitask.head1(feat), target)
        l2 = multitask.head2(feat).mean()
    report = gp.explain(l1)
    g = model(l1, None, report)
    for nid in report.released_ids:
        assert g.nodes[nid]["state"] == "release"
    for i, reason in enumerate(report.kept):
        assert reason.node_ids and all(g.nodes[n]["state"] == "keep" and g.nodes[n]["reason"] == i
                                       for n in reason.node_ids)
    path = tmp_path / "mt.dot"
    gp.render(l1, path=str(path), collapse=False)
    nodes, edges, _ = parse_dot(path)
    assert len(nodes) == g.number_of_nodes() and len(edges) == g.number_of_edges()
    assert sum(a["class"] == "keep0" for a in nodes.values()) == report.kept[0].nodes
    del l2


def test_states_released_untracked_offroute_foreign(tmp_path):
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = x.sin().sum()
        losses = torch.stack([x.tanh().sum(), x.sigmoid().sum()])
        c = checkpoint(lambda t: t.cos().cos(), x, use_reentrant=False).sum()
    z = x.log().sum()  # built outside track(): PyTorch holds what log saved
    gp.prune_after(y1, keep=x)
    with gp.track():
        y3 = y1 * 2 + losses[0] + c + z
    path = tmp_path / "states.dot"
    gp.render(y3, keep=x, path=str(path), collapse=False)
    nodes, _, legend = parse_dot(path)
    classes = {a["class"] for a in nodes.values()}
    assert classes == {"release", "released", "untracked", "offroute", "foreign", "keep0"}
    ops = {a["label"].splitlines()[0]: a["class"] for a in nodes.values()}
    assert ops["SinBackward0"] == "released" and ops["LogBackward0"] == "untracked"
    assert ops["SigmoidBackward0"] == "offroute" and ops["TanhBackward0"] == "release"
    drawn = {STATES[s][0] for s in STATES if s not in ("masks", "outside")}  # none saved only masks;
    # the report is y3's own: no node lies outside its call
    assert {a["fillcolor"] for a in legend.values()} == {*drawn, KEEP0, "white"}
    kept = [a for a in legend.values() if a["label"].startswith("kept")]
    assert len(kept) == 1  # untracked and foreign nodes have colours of their own


def test_svg_has_labels_legend_and_colours(tmp_path):
    w, x, y1 = _seed()
    path = tmp_path / "seed.svg"
    report = gp.render(y1, keep=x, path=str(path))
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    texts = ["".join(t.itertext()) for t in root.iter(ns + "text")]
    for text in ("SumBackward0", "MulBackward0", "AddBackward0", "AccumulateGrad", "12 B", "[y]", "[keep]",
                 "legend", "would be released by this prune", f"kept (0 B): {report.kept[0].reason}",
                 str(report).splitlines()[0]):
        assert text in texts, text
    boxes = [g for g in root.iter(ns + "g") if g.get("id", "").startswith("box")]
    assert len(boxes) == 5
    fills = [re.search(r"fill: (#\w+)", p.get("style")).group(1) for g in boxes for p in g.iter(ns + "path")]
    assert sorted(fills) == sorted([RELEASE] * 3 + [KEEP0] * 2)
    assert all(g.get("id").endswith(("-release", "-keep0")) for g in boxes)


@pytest.mark.parametrize("suffix", [".png", ".pdf"])
def test_png_and_pdf(tmp_path, suffix):
    _, x, y1 = _seed()
    path = tmp_path / f"seed{suffix}"
    gp.render(y1, keep=x, path=str(path))
    head = path.read_bytes()[:8]
    assert head.startswith(b"\x89PNG" if suffix == ".png" else b"%PDF")


def test_bad_suffix(tmp_path):
    _, x, y1 = _seed()
    with pytest.raises(ValueError, match="suffix"):
        gp.render(y1, path=str(tmp_path / "graph.jpg"))


def test_bad_suffix_fails_before_the_walk_and_names_dot(tmp_path):
    # the error listed .svg, .png, .pdf only, after the graph's dry run
    _, x, y1 = _seed()
    with pytest.raises(ValueError, match=r"render: cannot draw .*graph\.jpg.*\.svg, \.png, \.pdf, \.dot"):
        gp.render(y1, path=str(tmp_path / "graph.jpg"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("by_module", [0, -1, 1.5, True, "trunk"])
def test_by_module_that_is_no_count_of_name_parts_is_refused(tmp_path, by_module):
    _, x, y1 = _seed()
    with pytest.raises(ValueError, match="by_module must be a number of name parts, 1 or more"):
        gp.render(y1, path=str(tmp_path / "g.dot"), by_module=by_module)


def test_by_module_on_a_graph_without_module_names_warns_it_merges_nothing(tmp_path):
    # by_module=1 on a graph tracked without modules= drew every node, silently
    _, x, y1 = _seed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        gp.render(y1, path=str(tmp_path / "g.dot"), by_module=1)
    assert [(w.category, w.filename) for w in caught] == [(gp.GraphPruneWarning, __file__)]
    assert "build the graph under graphprune.track(modules=model)" in str(caught[0].message)


def test_long_chain_collapses_into_one_box(tmp_path):
    h = torch.ones(16, requires_grad=True)
    with gp.track():
        z = h
        for _ in range(3000):
            z = z.sin()
        y = z.sum()
    path = tmp_path / "chain.dot"
    report = gp.render(y, path=str(path))
    nodes, edges, _ = parse_dot(path)
    assert report.released_node_count == 3000
    assert len(nodes) == 2 and edges == [("n0", "n1")]
    chain = next(a["label"] for a in nodes.values() if "[y]" not in a["label"])
    assert chain.startswith("3001 nodes: SinBackward0 x3000\nAccumulateGrad\n")
    assert chain.endswith("187.5 KiB")  # 3000 saved inputs of 64 bytes, and h
    nodes_full = parse_dot(gp.render(y, path=str(path), collapse=False) and path)[0]
    assert len(nodes_full) == 3002


def test_module_names_and_grouping(tmp_path, multitask, images):
    inp, target = images
    with gp.track(modules=multitask):
        feat = multitask.trunk(inp)
        l1 = torch.nn.functional.cross_entropy(multitask.head1(feat), target)
        l2 = multitask.head2(feat).mean()
    path = tmp_path / "mt.dot"
    gp.render(l1, path=str(path), collapse=False)
    labels = [a["label"] for a in parse_dot(path)[0].values()]
    assert any(label.startswith("ConvolutionBackward0") and label.endswith("in trunk.0") for label in labels)
    assert "AccumulateGrad\nhead1.1.weight" in labels
    gp.render(l1, path=str(path), by_module=1)
    grouped = parse_dot(path)[0].values()
    trunk = [a for a in grouped if a["label"].endswith("in trunk")]
    assert len(trunk) == 1 and trunk[0]["class"] == "keep0"
    assert trunk[0]["label"].startswith("4 nodes: ")
    assert any(a["label"].endswith("in head1") and a["class"] == "release" for a in grouped)
    del l2


def test_module_names_without_a_root(tmp_path, multitask, images):
    inp, _ = images
    with gp.track(modules=True):
        feat = multitask.trunk(inp)
        l1 = multitask.head1(feat).sum()
    path = tmp_path / "mt.dot"
    gp.render(l1, path=str(path), collapse=False)
    labels = "\n".join(a["label"] for a in parse_dot(path)[0].values())
    assert "in Sequential.2" in labels and "in Sequential#2.1" in labels


def test_render_a_calls_report(tmp_path):
    w, x, y1 = _seed()
    y1.backward(retain_graph=True)
    report = gp.prune_after(y1, keep=x)
    path = tmp_path / "after.dot"
    assert gp.render(y1, path=str(path), report=report) is report
    nodes, _, legend = parse_dot(path)
    assert sum(a["class"] == "release" for a in nodes.values()) == 3
    assert "released by this call" in [a["label"] for a in legend.values()]


def test_a_report_drawn_on_a_wider_graph_leaves_the_other_heads_outside_its_call(tmp_path):
    # the other head, its saved tensors held, was drawn "released by this call" (the
    # CLI drew each per-loss pass on all the losses so)
    w = torch.randn(64, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = x.sin().tanh().sum()
        y2 = x.cos().sum()
    report = gp.backward(y1)
    path = tmp_path / "wider.dot"
    gp.render([y1, y2], report=report, path=str(path), collapse=False)
    nodes, _, legend = parse_dot(path)
    classes = {a["label"].replace("[y[0]]\n", "").replace("[y[1]]\n", "").splitlines()[0] + (
        "@y2" if "[y[1]]" in a["label"] else ""): a["class"] for a in nodes.values()}
    assert classes["SinBackward0"] == classes["TanhBackward0"] == classes["SumBackward0"] == "release"
    assert classes["CosBackward0"] == classes["SumBackward0@y2"] == "outside"
    assert classes["ExpBackward0"] == "keep0"  # kept for y2
    assert STATES["outside"][1] in [a["label"] for a in legend.values()]


@pytest.mark.parametrize("how", ["edge", "values", "generator"])
def test_render_draws_the_outputs_explain_takes(tmp_path, how):
    # a GradientEdge, dict.values() or a generator drew an empty graph (.svg: a crash)
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with gp.track():
        x = w + 10
        y1 = (x * x).sum()
        y2 = x.cos().sum()
    outputs = {"a": y1, "b": y2}
    y = {"edge": lambda: torch.autograd.graph.get_gradient_edge(y1), "values": outputs.values,
         "generator": lambda: (t for t in outputs.values())}[how]()
    path = tmp_path / "graph.dot"
    report = gp.render(y, keep=x, path=str(path))
    nodes, _, _ = parse_dot(path)
    drawn = sum(a["class"] == "release" for a in nodes.values())
    assert report.released_node_count == (1 if how == "edge" else 2)
    assert drawn == report.released_node_count + (1 if how == "edge" else 2)  # SumBackward0s save nothing
    gp.render(y if how == "edge" else list(outputs.values()), keep=x, path=str(tmp_path / "graph.svg"))


def test_a_node_that_saved_only_a_mask_is_drawn_kept(tmp_path):
    # drawn "released by this call", though every prune keeps boolean masks
    w = torch.randn(6, requires_grad=True)
    with gp.track():
        x = w.exp()
        y = torch.where(x > 1.5, x, torch.zeros(())).sum()
    path = tmp_path / "graph.dot"
    gp.render(y, keep=x, path=str(path))
    nodes, _, legend = parse_dot(path)
    states = {a["label"].split("\n")[0]: a["class"] for a in nodes.values()}
    assert states["WhereBackward0"] == "masks"
    assert any("boolean masks" in a["label"] for a in legend.values())
    y.backward(retain_graph=True)
    gp.prune_after(y, keep=x)
    node = y.grad_fn.next_functions[0][0]
    assert node._raw_saved_condition.data.tensor is not None  # kept, as drawn


def test_a_report_of_one_stacked_loss_drawn_on_the_stack_leaves_the_other_heads_outside(tmp_path):
    """Heads the call left alone, their tensors held, were drawn "released by this call":
    the call's part was walked along every edge from its output (``ls[0]``), which below
    the stack is every head; drawn on ``ls``, whose graph has not ``ls[0]``'s node in it,
    it was not walked at all."""
    w = torch.randn(64, requires_grad=True)
    with gp.track():
        x = w.exp()
        ls = torch.stack([x.sin().tanh().sum(), x.cos().tanh().sum()])
        entries = [ls[0], ls[1]]
    report = gp.backward(entries[0])
    path = tmp_path / "stack.dot"
    gp.render(ls, report=report, path=str(path), collapse=False)
    nodes, _, _ = parse_dot(path)
    boxes = sorted((a["label"], a["class"]) for a in nodes.values())
    assert ("CosBackward0\n256 B", "outside") in boxes and ("TanhBackward0\n256 B", "outside") in boxes
    assert [label for label, state in boxes if state == "release" and label.endswith(" B")] == []
    assert report.released_nodes == {"SinBackward0": 1, "TanhBackward0": 1}
    gp.render(entries, report=report, path=str(path), collapse=False)  # the call's output drawn
    nodes, _, _ = parse_dot(path)
    states = collections.Counter((a["label"].split("\n")[-1], a["class"]) for a in nodes.values())
    assert states[("SumBackward0", "release")] == states[("SumBackward0", "outside")] == 1  # head 0's, 1's
