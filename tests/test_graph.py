"""``tape.graph()``: the networkx model users see, and what holding it costs."""

import networkx as nx
import pytest
import torch

import graphprune as gp


def _two_heads():
    w = torch.ones(4, requires_grad=True)
    with gp.track() as tape:
        x = w.exp()
        y1 = x.sin().sum()
        y2 = (x * x).sum()
    return tape, w, x, y1, y2


def _by_op(graph):
    out = {}
    for _, d in graph.nodes(data=True):
        out.setdefault(d["op"], []).append(d)
    return out


def test_graph_nodes_edges_and_attributes():
    tape, _, _, y1, y2 = _two_heads()
    g = tape.graph()
    assert isinstance(g, nx.DiGraph)
    assert nx.is_directed_acyclic_graph(g)
    ops = _by_op(g)
    assert set(ops) == {"ExpBackward0", "SinBackward0", "MulBackward0", "SumBackward0", "AccumulateGrad"}
    assert ops["MulBackward0"][0]["saved_tensors"] == 2
    assert ops["MulBackward0"][0]["saved_bytes"] == 16  # x, twice, counted once
    assert {d["state"] for d in g.nodes.values()} == {"trunk"}
    sources = [n for n in g if g.in_degree(n) == 0]
    assert sorted(g.nodes[n]["op"] for n in sources) == ["SumBackward0", "SumBackward0"]
    exp = next(n for n, d in g.nodes(data=True) if d["op"] == "ExpBackward0")
    assert [g.nodes[n]["op"] for n in g.successors(exp)] == ["AccumulateGrad"]


def test_graph_states_after_prune():
    tape, _, x, y1, y2 = _two_heads()
    y1.backward(retain_graph=True)
    gp.prune_after(y1, keep=[x, y2])
    ops = _by_op(tape.graph())
    assert ops["SinBackward0"][0]["state"] == "released"
    assert ops["SinBackward0"][0]["saved_tensors"] == 0
    assert ops["MulBackward0"][0]["state"] == "trunk"
    assert [d["state"] for d in ops["SumBackward0"]] == ["branch", "trunk"]  # y1 is finished
    logged = y2 * 2  # built outside track(): not a protector
    del x, y2
    states = {d["op"]: d["state"] for d in tape.graph().nodes.values()}
    assert "MulBackward0" not in states  # only a tensor built outside track() reaches it now
    assert states["SinBackward0"] == "released"
    assert logged.requires_grad


def test_graph_marks_untracked_and_foreign_nodes():
    w = torch.ones(4, requires_grad=True)
    outside = w.exp()
    with gp.track() as tape:
        with torch.autograd.graph.save_on_cpu():
            h = outside.sin()
        y = (h * h).sum()
    states = {d["op"]: d["state"] for d in tape.graph().nodes.values()}
    assert states["SinBackward0"] == "untracked"
    assert states["MulBackward0"] == "trunk"
    assert states["ExpBackward0"] == "untracked"  # built before the tape opened: PyTorch holds its result
    assert y.requires_grad


@pytest.mark.parametrize("between", ["", "AddBackward0", "UnsqueezeBackward0"])
def test_graph_shows_the_untracked_graph_below_the_tapes(between):
    # a node built before track() that the tape's tensors reach was missing, edge and all,
    # where explain and render showed it as built outside track(); and below a node that
    # saves nothing (an add, a view) even once that was mended
    w = torch.ones(8, requires_grad=True)
    pre = {"": lambda: w.exp(), "AddBackward0": lambda: w.exp() + 1,
           "UnsqueezeBackward0": lambda: w.exp().unsqueeze(0)}[between]()
    with gp.track() as tape:
        y = (pre * 2).sin().sum()
    g = tape.graph()
    ops = {d["op"]: n for n, d in g.nodes(data=True)}
    path = ["MulBackward0", *([between] if between else []), "ExpBackward0", "AccumulateGrad"]
    assert all(g.nodes[ops[op]]["state"] == "untracked" for op in path[1:-1])
    assert all(g.has_edge(ops[a], ops[b]) for a, b in zip(path, path[1:]))
    assert y.requires_grad


def test_holding_graph_and_report_holds_no_tensor():
    tape, w, x, y1, y2 = _two_heads()
    g = tape.graph()
    report = gp.explain(y1)
    for _, d in g.nodes(data=True):
        assert all(isinstance(v, (int, str)) for v in d.values())
    assert all(isinstance(k.reason, str) for k in report.kept)
    assert repr(tape).startswith("<graphprune.Tape")
