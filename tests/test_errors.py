"""Clear errors: bad input, released tensors, in-place modification under hooks."""

import dataclasses
import gc
import sys
import warnings
import weakref

import pytest
import torch

import graphprune as gp


@pytest.fixture
def branch():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y = (x * x).sum()
    return w, x, y


@pytest.mark.parametrize("call", [gp.prune_after, gp.explain, gp.backward])
@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3.0, TypeError, r"must be a torch.Tensor or a GradientEdge, got float"),
        ([torch.ones(2, requires_grad=True).exp(), "y"], TypeError, r"\[1\] must be a torch.Tensor"),
        (torch.ones(3), ValueError, r"has no grad_fn"),
    ],
)
def test_bad_output_argument_is_named(call, bad, error, match):
    with pytest.raises(error, match=match):
        call(bad)


@pytest.mark.parametrize("call", [gp.prune_after, gp.explain])
@pytest.mark.parametrize(
    "bad, error, match",
    [(torch.ones(3, requires_grad=True), ValueError, r"leaf"), ([], ValueError, r"is empty"),
     (torch.autograd.graph.get_gradient_edge(torch.ones(3, requires_grad=True)), ValueError,
      r"y is the gradient edge into a leaf's AccumulateGrad; there is no graph behind it")],
)
def test_prune_of_a_leaf_or_of_nothing_is_refused(call, bad, error, match):
    # no pass ran: there is nothing to prune (gp.backward runs torch's pass on them)
    with pytest.raises(error, match=match):
        call(bad)


@pytest.mark.parametrize(
    "keep, error, match",
    [
        ("x", TypeError, r"keep must be a tensor, a GradientEdge, a grad_fn node or a list or tuple of them, "
                         r"got str"),
        ([1], TypeError, r"keep\[0\] must be"),
        # it said "or a sequence of them, got list"
        ([[1]], TypeError, r"keep\[0\] must be a tensor, a GradientEdge or a grad_fn node \(keep= takes one "
                           r"list of them\), got list"),
        (torch.ones(3), ValueError, r"keep does not require grad"),
        # a generator or dict.values() of tensors: the error said what keep= takes, not how
        ((t for t in ()), TypeError, r"or a list or tuple of them, got generator; pass keep=list\(\.\.\.\)$"),
        ({}.values(), TypeError, r"got dict_values; pass keep=list\(\.\.\.\)$"),
        # a dict of losses: keep=list(d), as the hint said, is its keys
        ({"a": 1}, TypeError, r"got dict; pass its tensors: keep=list\(d\.values\(\)\)$"),
        ([{"a": 1}], TypeError, r"keep\[0\] must be .*, got dict \(its \.values\(\)\?\)$"),
    ],
)
def test_bad_keep_argument_is_named(branch, keep, error, match):
    _, _, y = branch
    with pytest.raises(error, match=match):
        gp.prune_after(y, keep=keep)


def test_keep_accepts_grad_fn_node_and_leaf(branch):
    w, x, y = branch
    report = gp.explain(y, keep=[x.grad_fn, w])
    assert report.released_nodes == {"MulBackward0": 1}
    assert report.dry_run


def test_released_error_names_node_call_and_fix(branch):
    _, x, y = branch
    y.backward(retain_graph=True)
    gp.prune_after(y, keep=x)
    with pytest.raises(gp.ReleasedTensorError) as info:
        y.backward()
    message = str(info.value)
    assert "MulBackward0" in message
    assert "graphprune.prune_after(tensor of shape (), torch.float32, created at test_errors.py" in message
    assert "keep=" in message
    assert isinstance(info.value, RuntimeError)


def test_the_released_error_names_the_pruned_output_after_it_died():
    """A prune writes what it was given into its messages when one needs them (NOTE
    [ What a prune pays first ]): from what it read of ``y`` then, not from ``y``."""
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        h = x * x
        y = h.sum(); line = sys._getframe().f_lineno  # noqa: E702
        z = h.mean()
    y.backward(retain_graph=True)
    gp.prune_after(y, keep=x)
    y = weakref.ref(y)
    gc.collect()
    assert y() is None
    with pytest.raises(gp.ReleasedTensorError) as info:
        z.backward()
    expected = f"graphprune.prune_after(tensor of shape (), torch.float32, created at test_errors.py:{line})"
    assert expected in str(info.value)


def test_prune_after_is_idempotent(branch):
    _, x, y = branch
    y.backward(retain_graph=True)
    first = gp.prune_after(y, keep=x)
    second = gp.prune_after(y, keep=x)
    assert first.released_tensors == 2
    assert second.released_tensors == 0
    assert second.released_nodes == {}


def test_inplace_modification_of_saved_tensor_raises_like_pytorch():
    w = torch.randn(3, requires_grad=True)
    s = w.sigmoid()
    s.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()
    with gp.track():
        s = w.sigmoid()
        s.mul_(2)
    with pytest.raises(gp.InplaceModifiedError, match=r"modified by an inplace operation.*SigmoidBackward0"):
        s.sum().backward()


def test_a_parameter_an_optimizer_step_updated_between_passes_is_named_as_such():
    # the hint said "Clone the tensor before modifying it in place", which no step can do
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gp.track():
        x = net(torch.ones(2, 3))  # the second layer saves its weight (its input needs grad)
        l1, l2 = x.sum(), x.pow(2).sum()
    l1.backward(retain_graph=True)
    opt.step()  # between the heads' passes: the weight the graph saved is now another
    with pytest.raises(gp.InplaceModifiedError, match=r"optimizer.step\(\) between two backward passes") as e:
        l2.backward()
    assert "Clone the tensor before" not in str(e.value)
    plain = net(torch.ones(2, 3)).sum()  # plain PyTorch raises there too
    plain.backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.backward()


def test_inplace_on_unsaved_tensor_is_fine():
    w = torch.randn(3, requires_grad=True)
    with gp.track():
        s = w * 2  # MulBackward0 by a constant saves nothing about its output
        s.add_(1)
        y = (s * s).sum()
    y.backward()
    torch.testing.assert_close(w.grad, 4 * (2 * w.detach() + 1))


def test_nodes_built_outside_track_are_kept_and_reported():
    w = torch.randn(3, requires_grad=True)
    x = w.exp()  # untracked: PyTorch holds its saved tensor
    with gp.track():
        y = (x.sin()).sum()
    report = gp.prune_after(y)
    assert report.released_nodes == {"SinBackward0": 1}
    assert any("outside graphprune.track()" in k.reason for k in report.kept)
    loss = x.sum()
    loss.backward()  # the untracked graph still works
    torch.testing.assert_close(w.grad, w.detach().exp())


def test_prune_of_untracked_graph_releases_nothing():
    w = torch.randn(3, requires_grad=True)
    y = (w.exp() * 2).sum()
    with pytest.warns(gp.GraphPruneWarning, match="nothing can be released"):
        report = gp.prune_after(y)
    assert report.released_tensors == 0
    y.backward()
    torch.testing.assert_close(w.grad, 2 * w.detach().exp())


def test_report_str_is_readable(branch):
    _, x, y = branch
    text = str(gp.explain(y, keep=x))
    assert text.startswith("graphprune.explain would release 2 saved tensor(s) of 1 node(s)")
    assert "MulBackward0" in text
    assert "kept" in text


def test_inplace_op_saving_its_input_clone_is_released():
    """Guards the bug where ``clamp_min_`` saved a clone under CloneBackward0's number."""
    w = torch.randn(100, dtype=torch.float64, requires_grad=True)
    with gp.track():
        y1 = (w * 1.0).clamp_min_(0).sum()
    y1.backward(retain_graph=True)
    report = gp.prune_after(y1)
    assert report.released_nodes == {"ClampMinBackward0": 1}
    with pytest.raises(gp.ReleasedTensorError, match="ClampMinBackward0"):
        y1.backward()


def test_bytes_kept_leaves_out_parameters():
    lin = torch.nn.Linear(256, 256)  # LinearBackward saves its weight: 256 KiB
    inp = torch.randn(4, 256)
    with gp.track():
        x = lin(inp)  # saves the input (a leaf) and the weight (a parameter)
        y1 = x.exp().sum()
    report = gp.explain(y1, keep=x)
    assert report.bytes_kept == 0
    assert report.bytes_freed == 4 * 256 * 4  # exp's saved result, the branch's own


def test_grad_names_its_bad_arguments(branch):
    w, x, y = branch
    bad = r"graphprune.grad: outputs must be a torch.Tensor or a GradientEdge, got float"
    with pytest.raises(TypeError, match=bad):
        gp.grad(3.0, w)
    with pytest.raises(ValueError, match=r"graphprune.grad: outputs\[0\] has no grad_fn"):
        gp.grad([torch.ones(2)], w)
    with pytest.raises(TypeError, match=r"graphprune.grad: keep must be a tensor"):
        gp.grad(y, w, keep="x")
    with pytest.raises(TypeError, match=r"graphprune.backward: keep\[1\] must be"):
        gp.backward(y, keep=[x, 2])


@pytest.mark.parametrize("call, match", [
    (lambda y, w, p: gp.track(timeline=3), r"graphprune.track: timeline must be a graphprune.Timeline, got"),
    (lambda y, w, p: gp.render(y, path=None), r"graphprune.render: path must be a file name .* got NoneType"),
    (lambda y, w, p: gp.render(y, report=3, path=p), r"render: report must be a PruneReport .*int"),
    (lambda y, w, p: gp.plot_timeline([3], p), r"graphprune.plot_timeline: runs\[0\] must be a graphprune"),
    (lambda y, w, p: gp.plot_timeline([], p), r"graphprune.plot_timeline: runs is empty"),
    (lambda y, w, p: gp.grads_each([y], w, accumulate=None),
     r"graphprune.grads_each: accumulate must be a leaf tensor or a list of them .* got NoneType"),
    (lambda y, w, p: gp.grads_each([y], w, accumulate=[torch.ones(2)]),
     r"accumulate\[0\] must be a leaf tensor that requires grad \(a parameter\), got a Tensor that does not"),
    (lambda y, w, p: gp.grad(y, None), r"graphprune.grad: inputs must be a tensor, a GradientEdge or a"),
    (lambda y, w, p: gp.grad(y, 1.0), r"graphprune.grad: inputs must be .* got float"),
    (lambda y, w, p: gp.grads_each([y], None), r"graphprune.grads_each: inputs must be .* got NoneType"),
    (lambda y, w, p: gp.backward(y, retain_graph="yes"), r"graphprune.backward: retain_graph must be a bool"),
    (lambda y, w, p: gp.Tape(timeline=1), r"graphprune.track: timeline must be a graphprune.Timeline, got"),
    (lambda y, w, p: gp.render(y, path=p, title=5), r"graphprune.render: title must be a str, got int"),
    (lambda y, w, p: gp.plot_timeline(None, p), r"plot_timeline: runs must be a graphprune.Timeline .*None"),
    (lambda y, w, p: gp.plot_timeline({"a": gp.Timeline()}, p), r"got dict; pass its timelines"),
    (lambda y, w, p: gp.plot_timeline(gp.Timeline(), None), r"plot_timeline: path must be a file name"),
])
def test_bad_arguments_of_the_other_calls_are_named(branch, tmp_path, call, match):
    # they raised AttributeError, IndexError or an unnamed TypeError from deep inside
    w, _, y = branch
    with pytest.raises((TypeError, ValueError), match=match):
        call(y, w, str(tmp_path / "out.svg"))


@pytest.mark.parametrize("how", ["backward", "prune_after"])
def test_a_head_built_after_the_last_of_two_heads_is_told_keep_x_not_the_last_loss(how):
    # the hint said keep=loss: x, finished by the first head's call, was no candidate of the second's
    w = torch.randn(4, 4, requires_grad=True)
    with gp.track():
        x = (torch.randn(3, 4) @ w).tanh()
        losses = [x.exp().sum(), x.cos().sum()]
    for loss in losses:
        if how == "backward":
            gp.backward(loss)
        else:
            loss.backward(retain_graph=True)
            gp.prune_after(loss)
    with gp.track():
        late = x.sin().sum()
    with pytest.raises(gp.ReleasedTensorError, match=r"The graph of x \(tensor of shape \(3, 4\).*keep=x to"):
        late.backward()


def test_the_hint_says_a_vector_of_losses_a_pass_ran_from_one_entry_of_counts_as_run_through():
    # per_task = mse(reduction="none").mean(0) as a column: the pass from per_task[0] runs through
    # its node, which does not route; the hint said only "the pass it followed had run through it"
    w = torch.randn(4, 3, requires_grad=True)
    with gp.track():
        per_task = ((torch.randn(5, 4) @ w).tanh() - 1).pow(2).mean(0)[:, None] * 1.0
    gp.backward(per_task[0])
    with pytest.raises(gp.ReleasedTensorError, match=r"The graph of per_task \(tensor of shape \(3, 1\).*"
                       r"run through it, all of it: only torch.stack, torch.cat, losses\[i\] = l_i and the "
                       r"entries of a 1-d tensor .* Pass keep=per_task to that call"):
        per_task[1].backward()


def test_the_entries_of_a_vector_of_losses_held_live_protect_the_later_passes():
    """NOTE [ Supports at every node a router feeds ]: per_task = mse(reduction="none").mean(0),
    a pass per entry. The pass from per_task[0] ran through entry 0 only (the node of
    per_task does not route): the others keep the graph till the last entry's pass."""
    torch.manual_seed(0)
    w, inp = torch.randn(4, 3, requires_grad=True), torch.randn(5, 4)

    def per_entry(use_gp):
        with gp.track():
            per_task = ((inp @ w).tanh() - 1).pow(2).mean(0)
        grads, reports = [], []
        for i in range(3):
            w.grad = None
            reports.append(gp.backward(per_task[i]) if use_gp else per_task[i].backward(retain_graph=True))
            grads.append(w.grad.clone())
        return grads, reports

    got, reports = per_entry(True)
    for a, b in zip(got, per_entry(False)[0]):
        torch.testing.assert_close(a, b)
    assert [r.released_tensors > 0 for r in reports] == [False, False, True]


def test_a_pass_from_a_slice_of_held_logits_runs_through_all_of_them():
    """A causal LM's shift (``logits[:, :-1]``) leaves the last position, which no later
    pass starts from: the held logits do not keep the graph (only a 1-d tensor's
    entries are losses)."""
    w = torch.randn(4, 6, requires_grad=True)
    with gp.track():
        logits = (torch.randn(2, 3, 4) @ w).tanh()  # held, as a model output object holds them
        loss = logits[:, :-1].pow(2).mean()
    report = gp.backward(loss)
    assert report.released_nodes["TanhBackward0"] == 1  # the logits' node: their graph is freed


def test_the_hint_for_a_feature_says_nothing_of_entries():
    w = torch.randn(4, 4, requires_grad=True)
    with gp.track():
        x = (torch.randn(3, 4) @ w).tanh()
        loss = x.exp().sum()
    gp.backward(loss)
    with gp.track():
        late = x.sin().sum()
    with pytest.raises(gp.ReleasedTensorError) as e:
        late.backward()
    assert "The graph of x (tensor of shape (3, 4)" in str(e.value) and "all of it" not in str(e.value)


def test_the_hint_names_a_tensor_in_a_model_outputs_tuple():
    # out.hidden_states[0] was "a tensor that no variable of the nearest frames names"
    @dataclasses.dataclass
    class Output:
        loss: torch.Tensor
        hidden_states: tuple

    w = torch.randn(4, 4, requires_grad=True)
    with gp.track():
        h = (torch.randn(3, 4) @ w).tanh()
        out = Output(h.exp().sum(), (h,))
    del h
    gp.backward(out.loss)
    with pytest.raises(gp.ReleasedTensorError, match=r"Pass keep=out\.hidden_states\[0\] to that call"):
        (out.hidden_states[0] * 2).sum().backward()


def test_a_loop_that_rebinds_the_state_it_should_keep_is_told_what_keep_takes():
    # every tensor that could have been named was rebound since: the fallback advised
    # keep=<the tensor you backpropagate later>, the next step's loss, which did not exist yet
    w = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(gp.ReleasedTensorError, match=r"keep= what a later pass runs through .* a later "
                       r"loss, or the tensor a later step builds on \(h, in a loop's h = cell\(x, h\)\)"):
        with gp.track():
            h = torch.tanh(torch.ones(2, 3) @ w)
            for _ in range(3):
                loss = h.pow(2).mean()
                h = torch.tanh(h @ w)  # the next step built on h before loss's pass
                gp.backward(loss)  # keep=h forgotten


@pytest.mark.parametrize("flag", [0, 2, torch.tensor(False), torch.tensor(1)])
def test_retain_graph_is_read_as_torch_reads_it(flag):
    """``retain_graph`` was tested by identity: ``retain_graph=0`` kept the graph that
    PyTorch's own pass frees."""
    def kept(backward):
        w = torch.ones(2, requires_grad=True)
        y = (w * w).sum()
        backward(y, retain_graph=flag)
        try:
            y.backward()
        except RuntimeError:
            return False
        return True

    assert kept(gp.backward) == kept(torch.autograd.backward) == bool(flag)


def test_closing_a_tape_that_is_not_open_says_so():
    tape = gp.Tape()
    with pytest.raises(RuntimeError, match=r"this tape is not open \(never entered\)"):
        tape.__exit__(None, None, None)
    with tape:
        pass
    with pytest.raises(RuntimeError, match=r"this tape is not open \(closed already\)"):
        tape.__exit__(None, None, None)


def test_a_prune_before_its_outputs_pass_is_told_to_run_the_pass_first():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        y1 = (x * x).sum()
        y2 = x.sin().sum()
    gp.prune_after(y1)  # before y1.backward()
    with pytest.raises(gp.ReleasedTensorError, match=r"If that call came before y1's backward pass, run the "
                       r"pass first .*; if a later pass starts from it again, pass keep=y1 to that call"):
        y1.backward()
    y2.backward()


def _heads_with_losses_made_after_the_block():
    w = torch.ones(3, requires_grad=True)
    hs = [torch.full((3,), float(i + 1), requires_grad=True) for i in range(3)]
    with gp.track():
        z = w.exp()
        outs = [(z * h).sin() for h in hs]
    return outs, [o.sum() for o in outs]  # the losses: after the block


def test_a_loss_made_after_the_block_warns_that_the_losses_beside_it_protect_nothing():
    """NOTE [ Outputs made after the block ]: no tape saw the losses made, so keep=None
    protects none of them, and the first pass freed the trunk in silence; the error
    the next pass met named a head's output, not the cause."""
    outs, losses = _heads_with_losses_made_after_the_block()
    with pytest.warns(gp.GraphPruneWarning, match=r"graphprune.backward: tensor of shape \(\), torch.float32 "
                      r"was not made under graphprune.track\(\) .* released the graph of outs\[1\] "):
        gp.backward(losses[0])
    with pytest.raises(gp.ReleasedTensorError, match=r"That call's output was made after the track\(\)"):
        losses[1].backward()


def test_a_single_loss_made_after_the_block_frees_its_graph_without_a_warning():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        logits = w.exp().sin()  # held, for a metric
    loss = logits.sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = gp.backward(loss)
    assert report.released_nodes == {"SinBackward0": 1, "ExpBackward0": 1}


def test_a_warning_made_an_error_leaves_its_call_as_last_report():
    """The pass ran and the branch is released when the warning is shown: under an
    ``error`` filter, ``last_report()`` was the call before's."""
    outs, losses = _heads_with_losses_made_after_the_block()
    before = gp.explain(losses[0], keep=outs[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", gp.GraphPruneWarning)
        with pytest.raises(gp.GraphPruneWarning):
            gp.backward(losses[0])
    assert gp.last_report() is not before and gp.last_report().call == "graphprune.backward"


def test_the_hint_for_an_entry_of_a_list_of_losses_names_the_list_too():
    """MGDA under pruning(): a pass per loss, then one through their weighted sum; the
    hint named one loss at a time (keep=losses[2], then keep=losses[1])."""
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = [(x * x).sum(), x.sin().sum()]
    [gp.grad(loss, w) for loss in losses]  # no loop variable that names the last one
    hint = r"Pass keep=losses\[\d\] to that call \(or keep=losses, all of them, where a later pass"
    with pytest.raises(gp.ReleasedTensorError, match=hint):
        (0.5 * losses[0] + 0.5 * losses[1]).backward()
