"""gp.backward and gp.grad take what torch.autograd.backward and torch.autograd.grad take."""

import collections
import inspect
import os

import pytest
import torch
from torch.testing import assert_close

import graphprune as gp


def _graph():
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        y = x.sin() * 3
    return w, x, y


def test_parameters_match_torch_by_name_and_order():
    # deprecated ones too (grad_variables, only_inputs): a positional call means what it means to torch
    for ours, theirs in [(gp.backward, torch.autograd.backward), (gp.grad, torch.autograd.grad)]:
        assert list(inspect.signature(ours).parameters) == [*inspect.signature(theirs).parameters, "keep"]
        assert inspect.signature(ours).parameters["keep"].kind is inspect.Parameter.KEYWORD_ONLY


def test_backward_with_grad_tensors_matches_torch():
    g = torch.arange(4.0)
    w, x, y = _graph()
    gp.backward(y, g, keep=x)
    got = w.grad.clone()
    w.grad = None
    torch.autograd.backward(w.exp().sin() * 3, g)
    assert_close(got, w.grad)


def test_retain_graph_true_keeps_everything():
    w, x, y = _graph()
    report = gp.backward(y.sum(), retain_graph=True)
    assert report.released_tensors == 0
    assert report.kept[0].reason == "retain_graph=True keeps the whole graph"
    y.sum().backward()  # the whole graph is still there


def test_retain_graph_false_keeps_nothing():
    w, x, y = _graph()
    report = gp.backward(y.sum(), retain_graph=False)
    assert report.released_nodes == {"SinBackward0": 1, "ExpBackward0": 1}  # x is not kept
    with pytest.raises(gp.ReleasedTensorError):
        x.sum().backward()


def test_keep_and_retain_graph_together_are_refused():
    w, x, y = _graph()
    with pytest.raises(ValueError, match="keep= or retain_graph=, not both"):
        gp.backward(y.sum(), retain_graph=True, keep=x)


def test_grad_materializes_unused_inputs_as_torch_does():
    w, x, y = _graph()
    unused = torch.ones(2, requires_grad=True)
    got = gp.grad(y.sum(), [w, unused], allow_unused=True, materialize_grads=True, keep=x)
    assert_close(got[1], torch.zeros(2))
    assert_close(got[0], 3 * w.detach().exp().cos() * w.detach().exp())


def test_grad_batched_matches_torch():
    w, x, y = _graph()
    eye = torch.eye(4)
    (got,) = gp.grad(y, w, eye, is_grads_batched=True, keep=x)
    (expected,) = torch.autograd.grad(w.exp().sin() * 3, w, eye, is_grads_batched=True)
    assert_close(got, expected)
    assert gp.last_report().released_nodes == {"SinBackward0": 1}  # Mul by 3 saved nothing


def test_last_report_is_the_report_of_grad():
    w, x, y = _graph()
    gp.grad(y.sum(), w, keep=x)
    report = gp.last_report()
    assert report.call == "graphprune.grad" and report.released_tensors >= 1


def test_retain_graph_false_is_pytorchs_pass_keeping_what_inputs_stops():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        f = w.exp()  # the trunk
        y = (f * f).sum()
    (g,) = gp.grad(y, f, retain_graph=False)  # runs the head only, as torch.autograd.grad would
    assert gp.last_report().released_nodes == {"MulBackward0": 1}
    f.backward(g)  # the trunk was not run, so it is kept
    torch.testing.assert_close(w.grad, 2 * w.detach().exp() ** 2)


def test_retain_graph_false_frees_nodes_built_outside_track_as_pytorch_does():
    w = torch.ones(3, requires_grad=True)
    a = (w * 2).exp()  # untracked: PyTorch holds its saved tensors
    with gp.track():
        y = (a * a).sin().sum()
    gp.backward(y, retain_graph=False)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        a.sum().backward()  # ExpBackward0, built outside track(): PyTorch freed it


def test_a_batched_pass_into_a_released_node_says_it_cannot_check_for_zeros():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = torch.stack([(x * x).sum(), x.sin().sum(), x.cos().sum()])
    gp.backward(losses[0])
    with pytest.raises(gp.ReleasedTensorError, match=r"The pass is batched"):
        torch.autograd.grad(losses[1:], w, torch.eye(2), is_grads_batched=True, retain_graph=True)
    (rows,) = gp.grad(losses[1:], w, torch.eye(2), is_grads_batched=True)  # routing knows: zeros
    e = x.detach()
    torch.testing.assert_close(rows, torch.stack([e.cos() * e, -e.sin() * e]))


def test_positional_arguments_mean_what_they_mean_to_torch():
    # gp.grad had no only_inputs: a positional allow_unused landed in is_grads_batched
    w, x, y = _graph()
    unused = torch.ones(2, requires_grad=True)
    got = gp.grad(y.sum(), [w, unused], None, None, False, True, True)
    assert got[1] is None
    assert_close(got[0], 3 * w.detach().exp().cos() * w.detach().exp())
    w, x, y = _graph()
    gp.backward(y.sum(), None, None, False, None, [w])  # grad_variables=None, inputs=[w]
    assert_close(w.grad, 3 * w.detach().exp().cos() * w.detach().exp())


@pytest.mark.parametrize("call", ["grad", "backward"])
def test_gradient_edges_as_outputs_and_as_keep_work_as_tensors_do(call):
    # a GradientEdge is a tuple: it was split into (node, number) and refused
    from torch.autograd.graph import get_gradient_edge

    def build():
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        with gp.track():
            x = w.exp()
            y1 = (x * x).sin().sum()
            y2 = x.sqrt().sum()
        return w, x, y1, y2

    w, x, y1, y2 = build()
    (e1,) = torch.autograd.grad(y1, w, retain_graph=True)
    (e2,) = torch.autograd.grad(y2, w)
    w, x, y1, y2 = build()
    one = torch.tensor(1.0)
    if call == "grad":
        (g1,) = gp.grad(get_gradient_edge(y1), w, one, keep=get_gradient_edge(x))
    else:
        gp.backward(get_gradient_edge(y1), one, keep=get_gradient_edge(x))
        g1 = w.grad
    assert_close(g1, e1)
    assert gp.last_report().released_nodes == {"SinBackward0": 1, "MulBackward0": 1}
    with pytest.raises(gp.ReleasedTensorError):
        y1.backward()
    assert_close(torch.autograd.grad(y2, w)[0], e2)  # the edge into x kept the trunk


def test_backward_from_leaves_or_from_nothing_runs_torchs_pass():
    # a leaf has no graph to prune: torch's pass writes its .grad; an empty list is a no-op
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    report = gp.backward(w, torch.ones(2))
    assert_close(w.grad, torch.ones(2))
    assert report.released_tensors == 0 and report.bytes_freed == 0
    (g,) = gp.grad(w, w, torch.ones(2))
    assert_close(g, torch.ones(2))
    assert gp.backward([]).released_nodes == {}
    x, y = _graph()[1:]
    gp.backward([y.sum(), w], [None, torch.ones(2)], keep=x)  # a loss and a leaf together
    assert_close(w.grad, 2 * torch.ones(2))
    assert gp.last_report().released_nodes == {"SinBackward0": 1}


def test_retain_graph_false_with_create_graph_frees_the_graph_as_torch_does():
    # create_graph=True kept what the gradients' graphs reach, ignoring retain_graph=False
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = (x * x).sin().sum()
        y2 = x.sqrt().sum()
    (g,) = gp.grad(y1, w, retain_graph=False, create_graph=True)
    e = w.detach().exp()
    assert_close(g.detach(), (e * e).cos() * 2 * e * e)
    assert g.grad_fn is not None
    assert gp.last_report().released_nodes == {"SinBackward0": 1, "MulBackward0": 1, "ExpBackward0": 1}
    with pytest.raises(gp.ReleasedTensorError):
        y2.backward()  # PyTorch's pass freed the trunk too


@pytest.mark.parametrize("call", ["backward", "grad"])
def test_a_generator_of_outputs_is_read_once(call):
    # graphprune read the generator to find the graph, then torch found it empty
    w, x, y = _graph()
    w2 = torch.ones(4, requires_grad=True)
    with gp.track():
        z = (w2 * 2).cos()
    outputs = (t.sum() for t in (y, z))
    if call == "backward":
        gp.backward(outputs, keep=x)
        got = (w.grad, w2.grad)
    else:
        got = gp.grad(outputs, [w, w2], keep=x)
    e = torch.ones(4)
    assert_close(got, (3 * w.detach().exp().cos() * w.detach().exp(), -2 * (2 * e).sin()))
    assert gp.last_report().released_nodes == {"SinBackward0": 1, "CosBackward0": 1}  # both graphs


@pytest.mark.parametrize("make", [lambda d: d.values(), lambda d: collections.deque(d.values())],
                         ids=["dict_values", "deque"])
@pytest.mark.parametrize("call", ["backward", "grad", "prune_after"])
def test_any_iterable_of_outputs_is_taken_as_torch_takes_it(call, make):
    # only lists, tuples and generators were read: torch's tuple(tensors) takes any iterable
    w, x, y = _graph()
    outputs = {"a": y.sum(), "b": (x * 3).sum()}
    if call == "backward":
        gp.backward(make(outputs), keep=x)
        got = w.grad
    elif call == "grad":
        (got,) = gp.grad(make(outputs), w, keep=x)
    else:
        torch.autograd.backward(list(outputs.values()), retain_graph=True)
        gp.prune_after(make(outputs), keep=x)
        got = w.grad
    e = w.detach().exp()
    assert_close(got, 3 * e.cos() * e + 3 * e)
    assert gp.last_report().released_nodes == {"SinBackward0": 1}


@pytest.mark.parametrize("call", ["backward", "grad", "prune_after"])
def test_a_dict_of_outputs_is_refused_by_name(call):
    w, x, y = _graph()
    outputs = {"a": y.sum()}
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor or a GradientEdge, got dict"):
        if call == "grad":
            gp.grad(outputs, w)
        else:
            getattr(gp, call)(outputs)


def test_the_deprecated_arguments_warn_at_your_line_as_torch_warns_at_its_callers():
    """torch's FutureWarning for ``grad_variables`` / ``only_inputs`` (stacklevel=2) was
    filed at graphprune's pass, the caller of ``torch.autograd.backward``."""
    w = torch.ones(2, requires_grad=True)
    with gp.track():
        x = w.exp()
    for call, match in [(lambda: gp.backward((x * x).sum(), grad_variables=torch.tensor(1.0), keep=x),
                         "`grad_variables` is deprecated"),
                        (lambda: gp.grad((x * x).sum(), w, only_inputs=False, keep=x), "only_inputs arg")]:
        with pytest.warns(FutureWarning, match=match) as caught:
            call()
        assert [os.path.basename(c.filename) for c in caught if c.category is FutureWarning] == [
            os.path.basename(__file__)]
    both = pytest.raises(RuntimeError, match="arguments both passed to `backward\\(\\)`")
    with both, pytest.warns(FutureWarning):
        gp.backward((x * x).sum(), torch.tensor(1.0), grad_variables=torch.tensor(1.0))
