"""backward_each and grads_each: per-loss passes equal plain PyTorch's, heads freed
as their passes end, the trunk after the last."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import graphprune as gp
from graphprune._graph import saved, walk

from conftest import Square

T = 3


def _model(seed=0):
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    heads = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)) for _ in range(T))
    return trunk, heads, torch.randn(32, 8)


def _grads(*modules):
    return [p.grad.clone() if p.grad is not None else None for m in modules for p in m.parameters()]


def _plain_backward(build):
    trunk, heads, inp = _model()
    losses = build(trunk, heads, inp)
    for i in range(T):
        losses[i].backward(retain_graph=True)
    return _grads(trunk, heads)


def _gathered(how):
    def build(trunk, heads, inp):
        x = trunk(inp)
        ls = [h(x).square().mean() for h in heads]
        if how == "list":
            return ls
        if how == "stack":
            return torch.stack(ls)
        out = torch.zeros(T)
        for i, loss in enumerate(ls):
            out[i] = loss
        return out
    return build


def _each_equals_plain(build, **kw) -> list:
    """backward_each on ``build``'s losses, its .grad against plain retained passes; its reports."""
    expected = _plain_backward(build)
    trunk, heads, inp = _model()
    with gp.track():
        losses = build(trunk, heads, inp)
    reports = gp.backward_each(losses, **kw)
    for got, want in zip(_grads(trunk, heads), expected):
        torch.testing.assert_close(got, want)
    return reports


def _live_handles(t):
    return [h for n in walk([t.grad_fn]) for h in saved(n)[0] if h.tensor is not None and not h.leaf]


@pytest.mark.parametrize("strategy", ["cut", "passes"])
@pytest.mark.parametrize("how", ["list", "stack", "assign"])
def test_backward_each_equals_plain_backward_calls(how, strategy):
    reports = _each_equals_plain(_gathered(how), strategy=strategy)
    assert len(reports) == (T + 1 if strategy == "cut" else T)
    assert all(r.released_node_count >= 3 for r in reports[:T]), [str(r) for r in reports]
    if strategy == "cut":
        assert reports[-1].strategy.startswith("cut: 3 head pass(es), then the trunk once")
    else:
        assert reports[-1].strategy == "passes: 3 whole pass(es), the trunk freed by the last"
        assert reports[-1].released_node_count > reports[0].released_node_count  # the trunk too


def test_backward_each_frees_each_head_during_its_own_pass():
    trunk, heads, inp = _model()
    with gp.track():
        x = trunk(inp)
        losses = [h(x).square().mean() for h in heads]
    held = [len(_live_handles(loss)) for loss in losses]
    freed = []

    def spy(grad_outputs):  # runs in the next head's pass: what is left of the previous heads
        freed.append([len(_live_handles(loss)) for loss in losses])

    losses[1].grad_fn.register_prehook(spy)
    gp.backward_each(losses)
    (during_second,) = freed
    assert during_second[0] < held[0] and during_second[2] == held[2]
    assert all(len(_live_handles(loss)) == 0 for loss in losses)  # the trunk went after the last


def test_backward_each_runs_the_trunk_once():
    trunk, heads, inp = _model()
    with gp.track():
        x = trunk(inp)
        losses = [h(x).square().mean() for h in heads]
    runs = []
    below = x.grad_fn.next_functions[0][0]  # the cut is at x's node; its backward computes nothing per head
    below.register_prehook(lambda g: runs.append(1))
    gp.backward_each(losses)
    assert len(runs) == 1


def test_backward_each_cut_keeps_only_its_own_pass_s_gradient_at_the_cut():
    # a hook in head 0 ran aux.backward() through the trunk during head 0's pass to the
    # cut: the cut's prehook kept aux's gradient as head 0's, so W.grad was
    # 0 * l0's + l1's + 2 * aux's, silently
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    v0, v1 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    inp = torch.randn(3, 4)

    def run(each):
        for p in (w, v0, v1, scale):
            p.grad = None
        with gp.track():
            s = scale.exp()  # built before the trunk: its node runs after the cut's
            x = (inp @ w).tanh()
            losses = [((x @ v0) * s).sin().sum(), (x @ v1).cos().sum()]
            aux = (x * 3).sum()
        done = []

        def hook(g):
            if not done:
                done.append(True)
                aux.backward(retain_graph=True)
            return g

        s.register_hook(hook)
        each(losses)
        assert done
        return [p.grad.clone() for p in (w, v0, v1, scale)]

    expected = run(lambda losses: [loss.backward(retain_graph=True) for loss in losses])
    for got, want in zip(run(lambda losses: gp.backward_each(losses, strategy="cut")), expected):
        assert_close(got, want)
    assert gp.last_report().strategy.startswith("cut:")


def test_backward_each_heads_tapping_three_depths_need_no_single_cut():
    def build(trunk, heads, inp):
        a = trunk[1](trunk[0](inp))
        b = trunk[3](trunk[2](a))
        c = b * a  # a skip connection into the last depth
        return [heads[0](a).square().mean(), heads[1](b).square().mean(), heads[2](c).square().mean()]

    assert "then the trunk once" in _each_equals_plain(build)[-1].strategy


def test_backward_each_with_a_parameter_shared_by_a_head_and_the_trunk():
    def build(trunk, heads, inp):
        x = trunk(inp)
        tied = trunk[2].weight  # used by the trunk and, again, by every head
        return [(h(x) + (x @ tied).sum(1, keepdim=True)).square().mean() for h in heads]

    _each_equals_plain(build)


def test_backward_each_with_the_same_loss_twice():
    trunk, heads, inp = _model()
    with torch.enable_grad():
        x = trunk(inp)
        loss = heads[0](x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(trunk, heads)
    trunk, heads, inp = _model()
    with gp.track():
        loss = heads[0](trunk(inp)).square().mean()
    gp.backward_each([loss, loss])
    for got, want in zip(_grads(trunk, heads), expected):
        torch.testing.assert_close(got, want)


def test_backward_each_builds_callable_heads_one_at_a_time():
    expected = _plain_backward(_gathered("list"))
    trunk, heads, inp = _model()
    with gp.track():
        x = trunk(inp)
    alive = []

    trunk_handles = set(_live_handles(x))

    def head(i):
        def build():
            alive.append(sum(bool(set(_live_handles(t)) - trunk_handles) for t in built))
            built.append(heads[i](x).square().mean())
            return built[-1]
        return build

    built = []
    reports = gp.backward_each([head(i) for i in range(T)])
    assert alive == [0, 0, 0]  # each head built after the previous one was freed
    assert reports[-1].strategy.startswith("cut: 3 head pass(es)")
    assert not _live_handles(x)
    for got, want in zip(_grads(trunk, heads), expected):
        torch.testing.assert_close(got, want)


def test_backward_each_keep_protects_a_tensor_for_a_later_pass():
    trunk, heads, inp = _model()
    with gp.track():
        x = trunk(inp)
        losses = [h(x).square().mean() for h in heads[:2]]
    gp.backward_each(losses, keep=x)
    x.sum().backward()  # the trunk is still there
    with pytest.raises(gp.ReleasedTensorError):
        losses[0].backward()


@pytest.mark.parametrize("how", ["list", "stack", "lazy"])
def test_grads_each_equals_autograd_grad_per_loss(how):
    trunk, heads, inp = _model()
    params = list(trunk.parameters())
    x = trunk(inp)
    want = [torch.autograd.grad(h(x).square().mean(), params, retain_graph=True) for h in heads]
    with gp.track():
        x = trunk(inp)
        if how == "lazy":
            losses = [lambda h=h: h(x).square().mean() for h in heads]
        else:
            losses = [h(x).square().mean() for h in heads]
            losses = torch.stack(losses) if how == "stack" else losses
    rows = gp.grads_each(losses, params)
    assert len(rows) == T
    for got, expected in zip(rows, want):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert not _live_handles(x)  # the last pass freed the trunk
    assert gp.last_report().released_node_count > 0


def test_grads_each_allow_unused_and_materialize_grads():
    w, v = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    with gp.track():
        losses = [(w * 2).sum(), (v * 3).sum()]
    rows = gp.grads_each(losses, [w, v], allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(rows[0][1], torch.zeros(2))
    torch.testing.assert_close(rows[1][1], torch.full((2,), 3.0))


@pytest.mark.parametrize("losses, error, match", [
    (3.0, TypeError, "must be a list of losses"),
    (torch.ones(2, 2, requires_grad=True) * 2, ValueError, "1-d tensor"),
    ([torch.ones(2, requires_grad=True) * 2], ValueError, r"losses\[0\] must be a scalar loss"),
    ([torch.ones(())], ValueError, r"losses\[0\] has no grad_fn \(it does not require grad: made under"),
    ([lambda: None], TypeError, r"losses\[0\]\(\) must be a torch.Tensor, got NoneType"),
    ({"a": 1}, TypeError, r"must be a list of losses.* got dict \(its \.values\(\)\?\)"),
])
def test_per_loss_helpers_name_their_bad_arguments(losses, error, match):
    with pytest.raises(error, match=match):
        gp.backward_each(losses)



@pytest.mark.parametrize("how", ["values", "generator"])
@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
def test_per_loss_helpers_take_any_iterable_of_losses(how, lazy):
    # only lists and tuples were taken: dict.values() and a generator were refused
    def run(each):
        w = torch.ones(3, requires_grad=True)
        with gp.track():
            x = w.exp()
            made = {i: (lambda i=i: (x * i).sin().sum()) for i in (1, 2)}
            if not lazy:
                made = {i: f() for i, f in made.items()}
        losses = made.values() if how == "values" else (f for f in made.values())
        if each:
            return gp.grads_each(losses, [w])
        return [torch.autograd.grad(f() if lazy else f, w, retain_graph=True) for f in made.values()]

    assert_close(run(True), run(False))

@pytest.mark.parametrize("helper", ["cut", "passes", "grads"])
@pytest.mark.parametrize("losses", [[], "generator", "tensor"])
def test_per_loss_helpers_given_no_losses_run_nothing_as_the_loop_does(helper, losses):
    # every task's mask empty in a batch: {} of losses was refused, where the loop runs nothing
    w = torch.ones(3, requires_grad=True)
    losses = iter([]) if losses == "generator" else torch.zeros(0) if losses == "tensor" else losses
    got = gp.grads_each(losses, [w]) if helper == "grads" else gp.backward_each(losses, strategy=helper)
    assert got == [] and w.grad is None


@pytest.mark.parametrize("helper", ["cut", "passes", "grads"])
@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
def test_a_leaf_placeholder_loss_runs_as_in_the_plain_loop(helper, where, lazy):
    # a task without labels in the batch, its loss torch.zeros((), requires_grad=True): the
    # per-loss helpers refused it, though the plain loop and gp.backward take it
    def run(each):
        w = torch.tensor([0.1, 0.2, 0.3], requires_grad=True)
        placeholder = torch.zeros((), requires_grad=True)
        with gp.track() if each else contextlib.nullcontext():
            x = w.exp()
            made = [lambda: (x * 2).sin().sum(), lambda: x.cos().sum()]
            made.insert(where, lambda: placeholder)
            if not (each and lazy):
                made = [f() for f in made]
        if helper == "grads":
            if each:
                rows = gp.grads_each(made, [w, placeholder], allow_unused=True)
            else:
                rows = [torch.autograd.grad(loss, [w, placeholder], retain_graph=True, allow_unused=True)
                        for loss in made]
        else:
            rows = None
            if each:
                reports = gp.backward_each(made, strategy=helper)
                assert reports[where].strategy.startswith("a leaf loss")
                assert reports[where].released_node_count == 0
            else:
                for loss in made:
                    loss.backward(retain_graph=True)
        if each:  # the trunk freed after the last pass, as without the placeholder
            assert all(h.tensor is None for h in saved(x.grad_fn)[0])
        return rows, w.grad, placeholder.grad

    assert_close(run(True), run(False))


@pytest.mark.parametrize("how", ["one_loss", "disjoint", "disjoint_lazy"])
def test_backward_each_s_last_report_names_the_strategy_where_no_trunk_is_shared(how):
    # one loss, or per-domain batches whose graphs share no node: every report's strategy was None
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    batches = [torch.randn(2, 4) for _ in range(2 if how != "one_loss" else 1)]

    def build(b):
        return (b @ w).sin().pow(2).mean()

    with gp.track():
        lazy = how == "disjoint_lazy"
        losses = [lambda b=b: build(b) for b in batches] if lazy else [build(b) for b in batches]
        reports = gp.backward_each(losses)
    expected = w.grad.clone()
    w.grad = None
    for b in batches:
        build(b).backward()
    assert_close(expected, w.grad)
    assert [r.strategy for r in reports[:-1]] == [None] * (len(reports) - 1)
    assert reports[-1].strategy == f"cut: {len(batches)} head pass(es), no trunk pass to run once"
    assert gp.last_report().strategy == reports[-1].strategy


def test_backward_each_names_a_bad_strategy():
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match='strategy must be "cut" or "passes", got \'fast\''):
        gp.backward_each([(w * 2).sum()], strategy="fast")


def test_per_loss_helpers_refuse_tensors_mixed_with_callables():
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="mixes tensors and callables"):
        gp.grads_each([(w * 2).sum(), lambda: w.sum()], w)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 4),
    gather=st.sampled_from(["list", "stack", "assign", "lazy"]),
    taps=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    skips=st.lists(st.booleans(), min_size=4, max_size=4),
    tie=st.booleans(),
    helper=st.sampled_from(["backward_each", "grads_each", "passes"]),
)
def test_random_multi_task_graphs_match_plain(T, gather, taps, skips, tie, helper):
    """Heads tapping the trunk at random depths, with skip connections into the trunk
    and a parameter shared with the trunk, gathered in any way: backward_each's
    ``.grad`` and grads_each's rows equal plain PyTorch's."""
    torch.manual_seed(T)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    heads = [torch.randn(8, 8, requires_grad=True) for _ in range(T)]
    inp = torch.randn(4, 8)
    params = [*ws, *heads]

    def loss_of(i, depths):
        h = depths[taps[i]] @ heads[i]
        if skips[i]:
            h = h * depths[0]  # a skip into the trunk's first depth
        if tie:
            h = h @ ws[1]  # a trunk parameter, used again by the head
        return h.cos().mean()

    def forward():
        depths = [(inp @ ws[0]).tanh()]
        for w in ws[1:]:
            depths.append((depths[-1] @ w).sin())
        return depths

    def plain():
        depths = forward()
        losses = [loss_of(i, depths) for i in range(T)]
        if helper == "grads_each":
            return [torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                    for loss in losses]
        for loss in losses:
            loss.backward(retain_graph=True)
        return [p.grad for p in params]

    def with_graphprune():
        with gp.track():
            depths = forward()
            if gather == "lazy":
                losses = [lambda i=i: loss_of(i, depths) for i in range(T)]
            else:
                ls = [loss_of(i, depths) for i in range(T)]
                losses = ls if gather == "list" else _gathered_values(ls, gather)
        if helper == "grads_each":
            return gp.grads_each(losses, params, allow_unused=True)
        gp.backward_each(losses, strategy="passes" if helper == "passes" else "cut")
        return [p.grad for p in params]

    want = plain()
    for p in params:
        p.grad = None
    assert_close(_zeros_for_none(with_graphprune(), params), _zeros_for_none(want, params))


def _zeros_for_none(grads, params):
    """Gathered losses reach every head: PyTorch gives the other heads zeros, not None."""
    if grads and isinstance(grads[0], tuple):
        return [_zeros_for_none(list(row), params) for row in grads]
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _gathered_values(ls, how):
    if how == "stack":
        return torch.stack(ls)
    out = torch.zeros(len(ls))
    for i, loss in enumerate(ls):
        out[i] = loss
    return out


@pytest.mark.parametrize("helper", ["grads_each", "passes"])
def test_lazy_heads_tapping_deeper_than_the_last_free_the_whole_trunk(helper):
    torch.manual_seed(0)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    with gp.track():
        depths = [(torch.randn(4, 8) @ ws[0]).tanh()]
        for w in ws[1:]:
            depths.append((depths[-1] @ w).tanh())
    heads = [lambda d=d: d.square().mean() for d in reversed(depths)]  # deepest first, the last taps depth 0
    if helper == "grads_each":
        gp.grads_each(heads, ws, allow_unused=True)
    else:
        gp.backward_each(heads, strategy="passes")
    assert all(not _live_handles(d) for d in depths)  # depths 1, 2 too: the last pass never ran them


def test_grads_each_accumulates_the_heads_and_returns_the_shared_rows():
    trunk, heads, inp = _model()
    shared, own = list(trunk.parameters()), list(heads.parameters())
    x = trunk(inp)
    plain = [torch.autograd.grad(h(x).square().mean(), shared + list(h.parameters()), retain_graph=True)
             for h in heads]
    with gp.track():
        x = trunk(inp)
    rows = gp.grads_each([lambda h=h: h(x).square().mean() for h in heads], shared, accumulate=own)
    for row, want in zip(rows, plain):
        assert len(row) == len(shared)
        for g, e in zip(row, want):
            torch.testing.assert_close(g, e)
    for i, h in enumerate(heads):
        for p, e in zip(h.parameters(), plain[i][len(shared):]):
            torch.testing.assert_close(p.grad, e)
    assert all(p.grad is None for p in shared)  # returned, not accumulated


def test_grads_each_accumulate_takes_leaves_only():
    w = torch.ones(2, requires_grad=True)
    with gp.track():
        losses = [(w * 2).sum()]
    with pytest.raises(TypeError, match=r"accumulate\[0\] must be a leaf tensor that requires grad"):
        gp.grads_each(losses, w, accumulate=[w * 2])


def test_grads_each_refuses_a_tensor_both_returned_and_accumulated():
    # it came back as a zero row, or as "appears to not have been used in the graph"
    w, h = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = [(x * h).sin().sum(), x.cos().sum()]
    with pytest.raises(ValueError, match=r"accumulate\[0\] is in inputs too"):
        gp.grads_each(losses, [w, h], accumulate=[h])
    assert h.grad is None


def test_grads_each_takes_a_dict_of_inputs_with_accumulate():
    # the dict's keys were passed to torch as inputs
    w, h = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    x = w.exp()
    plain = [(x * h).sin().sum(), x.cos().sum()]
    want = [torch.autograd.grad(loss, [w, h], retain_graph=True, allow_unused=True) for loss in plain]
    with gp.track():
        x = w.exp()
        losses = [(x * h).sin().sum(), x.cos().sum()]
    rows = gp.grads_each(losses, {"trunk": w}, accumulate=[h], allow_unused=True)
    assert [list(row) for row in rows] == [["trunk"], ["trunk"]]
    torch.testing.assert_close([row["trunk"] for row in rows], [g for g, _ in want])
    torch.testing.assert_close(h.grad, want[0][1])


@pytest.mark.parametrize("accumulate", [False, True])
def test_grads_each_takes_one_gradient_edge_as_inputs(accumulate):
    # with accumulate=, the edge (a named tuple) was split into its node and its output_nr
    w, h = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    x = w.exp()
    plain = [(x * h).sin().sum(), x.cos().sum()]
    want = [torch.autograd.grad(loss, [x, h], retain_graph=True, allow_unused=True) for loss in plain]
    with gp.track():
        x = w.exp()
        losses = [(x * h).sin().sum(), x.cos().sum()]
    edge = torch.autograd.graph.get_gradient_edge(x)
    rows = gp.grads_each(losses, edge, accumulate=[h] if accumulate else (), allow_unused=True)
    torch.testing.assert_close([row[0] for row in rows], [g for g, _ in want])
    if accumulate:
        torch.testing.assert_close(h.grad, want[0][1])
    with gp.track():
        y = w.exp()
        unused = [(y * h).sum(), (y * h).sum()]
    with pytest.raises(RuntimeError, match="materialize_grads cannot be used when the given input"):
        gp.grads_each(unused, [h, edge], accumulate=[w] if accumulate else (), materialize_grads=True)


def test_grads_each_refuses_a_leaf_in_inputs_by_its_edge_and_in_accumulate():
    # the edge's id is no leaf's: the row held the placeholder's zeros, the gradient went to .grad
    w, a = torch.ones(2, requires_grad=True), torch.tensor([1.0, 2.0], requires_grad=True)
    with gp.track():
        x = w * 3
        losses = [(x * a).sum(), (x * a).sin().sum()]
    edge = torch.autograd.graph.get_gradient_edge(a)
    with pytest.raises(ValueError, match=r"accumulate\[0\] is in inputs too"):
        gp.grads_each(losses, [w, edge], accumulate=[a])
    assert a.grad is None


@pytest.mark.parametrize("accumulate", [False, True])
def test_grads_each_checks_allow_unused_and_materialize_grads_as_torch_does(accumulate):
    # with accumulate= the rows were made by hand: allow_unused=False with materialize_grads
    # was taken, and the unused input's error had no index
    def losses():
        w, a, c = (torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(3))
        with gp.track():
            x = w * 3
            ls = [(x * a).sum(), (x * a).sin().sum()]
        return ls, [w, c], {"accumulate": [a]} if accumulate else {}

    ls, inputs, extra = losses()
    with pytest.raises(ValueError, match="Expected allow_unused to be True or not passed when materia"):
        gp.grads_each(ls, inputs, allow_unused=False, materialize_grads=True, **extra)
    ls, inputs, extra = losses()
    with pytest.raises(RuntimeError) as raised:
        gp.grads_each(ls, inputs, **extra)
    if accumulate:  # graphprune's own check, in torch's words
        assert "The differentiated Tensor at index 1 appears to not have been used" in str(raised.value)
    else:  # torch's check, as it words it
        ls, inputs, _ = losses()
        with pytest.raises(RuntimeError) as plain:
            torch.autograd.grad(ls[0], inputs, retain_graph=True)
        assert str(raised.value) == f"graphprune.grads_each: losses[0]: {plain.value}"


@pytest.mark.parametrize("accumulate", [False, True])
def test_grads_each_names_the_loss_whose_pass_found_an_input_unused(accumulate):
    # torch's error named the input only, and not that the passes before it released their heads
    w, v, a = (torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(3))
    with gp.track():
        x = (w * 2).sin()
        losses = [(x.exp() * v * a).sum(), (x * x * a).sum()]
    message = (r"graphprune.grads_each: losses\[1\]: The differentiated Tensor at index 1 appears to not "
               r"have been used in the graph\. .* The passes of losses\[:1\] ran, each releasing its head\.")
    with pytest.raises(RuntimeError, match=message):
        gp.grads_each(losses, [w, v], accumulate=[a] if accumulate else ())

@pytest.mark.parametrize("how", ["grads", "passes"])
def test_the_trunk_the_last_whole_pass_released_is_named_for_keep_not_blamed_on_a_callable(how):
    # the last pass releases the trunk, built before the call: the error said a head's callable built it
    w, a = torch.ones(3, requires_grad=True), torch.full((3,), 0.5, requires_grad=True)
    with gp.track():
        x = w.exp()
    heads = [lambda: (x * a).sin().sum(), lambda: (x * a).cos().sum()]
    if how == "grads":
        gp.grads_each(heads, [w])
    else:
        gp.backward_each(heads, strategy="passes")
    with gp.track():
        later = (x * 2).tanh().sum()
    with pytest.raises(gp.ReleasedTensorError, match=r"Pass keep=x to that call") as raised:
        later.backward()
    assert "callable built it" not in str(raised.value)


@pytest.mark.parametrize("how", ["cut", "passes", "grads"])
def test_a_feature_one_head_callable_memoises_for_the_next_is_named_with_what_to_do(how):
    # the error said "Pass keep=cache['f']", which cannot be passed: f did not exist yet
    w, h = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    with gp.track():
        x = w.exp()
    cache = {}

    def feature():
        if "f" not in cache:
            cache["f"] = (x * h).sin()
        return cache["f"]

    builders = [lambda: feature().sum(), lambda: feature().cos().sum()]
    message = r"The graph of cache\['f'\] .* an earlier head's callable built it.* Build what several"
    with pytest.raises(gp.ReleasedTensorError, match=message):
        if how == "grads":
            gp.grads_each(builders, [w, h])
        else:
            gp.backward_each(builders, strategy=how)
    cache.clear()
    w.grad = h.grad = None
    with gp.track():
        f = (x * h).sin()  # built before the call, with the trunk: it works
    gp.backward_each([lambda: f.sum(), lambda: f.cos().sum()])
    f = (w.exp() * h).sin()
    expected = torch.autograd.grad(f.sum() + f.cos().sum(), [w, h])
    torch.testing.assert_close((w.grad, h.grad), expected)


@pytest.mark.parametrize("hook", ["retain_grad", "clip"])
def test_a_lazy_head_with_a_hook_at_its_cut_runs_its_whole_pass(hook):
    """x1 sits at the second head's cut, below the first's: only the first head's lower
    part was looked at, so the cut stayed, and x1.grad got the second loss's gradient
    twice (its pass to the cut, then the trunk's) where the plain loop gives it once."""
    def run(use_gp):
        torch.manual_seed(0)
        w1, w2 = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
        h = [torch.randn(6, requires_grad=True) for _ in range(2)]
        with gp.track():
            x1 = torch.tanh(torch.randn(3, 6) @ w1)
            x2 = torch.tanh(x1 @ w2)
        if hook == "retain_grad":
            x1.retain_grad()
        else:
            x1.register_hook(lambda g: g.clamp(-0.05, 0.05))
        heads = [lambda: (x2 * h[0]).sin().sum(), lambda: (x1 * h[1]).pow(2).sum()]
        if use_gp:
            gp.backward_each(heads)
            assert "whole pass" in gp.last_report().strategy  # clip: x1 is in the trunk the first head sees
        else:
            for f in heads:
                f().backward(retain_graph=True)
        return [w1.grad, w2.grad, *[t.grad for t in h]] + ([x1.grad] if hook == "retain_grad" else [])

    torch.testing.assert_close(run(True), run(False))


@pytest.mark.parametrize("where", ["at the cut", "below it", "retain_grad", "a trunk leaf"])
def test_a_hook_a_later_head_callable_registers_does_not_see_the_earlier_heads_gradients(where):
    """The second callable registers a hook on the trunk: the plain loop runs it on the
    second loss's gradient only, where the trunk's one pass ran it on both heads' sum."""
    def run(use_gp):
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        a, b = torch.tensor([0.5, 0.3], requires_grad=True), torch.tensor([0.2, 0.7], requires_grad=True)
        seen = []
        with gp.track():
            z = w * w
            x = z.sin()

        def second():
            if where == "retain_grad":
                x.retain_grad()
            elif where == "a trunk leaf":
                w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
            else:
                (x if where == "at the cut" else z).register_hook(lambda g: g * 10)
            return (x * b).cos().sum()

        heads = [lambda: (x * a).sin().sum(), second]
        if use_gp:
            reports = gp.backward_each(heads)
            assert "the trunk ran 1 time(s) more" in reports[-1].strategy
            assert reports[-1].released_nodes == {"SinBackward0": 1, "MulBackward0": 1}  # the trunk, last
        else:
            for f in heads:
                f().backward(retain_graph=True)
        return [w.grad, a.grad, b.grad, *seen] + ([x.grad] if where == "retain_grad" else [])

    torch.testing.assert_close(run(True), run(False))


class _DeviceInBackward(torch.autograd.Function):
    """The trunk: its backward makes a tensor under a device context of its own."""

    devices: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        with torch.device("meta"):
            _DeviceInBackward.devices.append(torch.empty(1).device.type)
        return g * 2


def test_the_trunks_early_pass_runs_in_the_callers_torch_function_state():
    # a later head's callable registers a hook: the trunk runs first from the gradients at
    # the cut, from inside the recorder; with a mode below it (torch.device around the
    # step) it ran with torch-function dispatch off, and the trunk's own device context
    # was ignored
    def run(use_gp):
        _DeviceInBackward.devices = []
        w = torch.ones(3, requires_grad=True)
        with torch.device("cpu"):
            with gp.track():
                x = _DeviceInBackward.apply(w)

            def second():
                h = x * 3
                h.register_hook(lambda g: g)
                return h.sum()

            heads = [lambda: (x * 1).sum(), second]
            if use_gp:
                assert "the trunk ran 1 time(s) more" in gp.backward_each(heads)[-1].strategy
            else:
                for f in heads:
                    f().backward(retain_graph=True)
        return w.grad, list(_DeviceInBackward.devices)

    plain, tracked = run(False), run(True)
    assert tracked[1] == plain[1] == ["meta", "meta"]
    torch.testing.assert_close(tracked[0], plain[0])


def test_a_later_head_callable_that_registers_no_hook_runs_the_trunk_once():
    w = torch.ones(2, requires_grad=True)
    with gp.track():
        x = w.exp()
    heads = [lambda: (x * 2).sin().sum(), lambda: (x * 3).sin().sum()]
    assert gp.backward_each(heads)[-1].strategy == "cut: 2 head pass(es), then the trunk once from 1 edge(s)"



@pytest.mark.parametrize("outer", [False, True], ids=["alone", "inside_track"])
def test_graphprunes_own_leaf_hooks_are_not_a_later_heads_hook(outer):
    """Inside the user's track(), the hooks graphprune registers on a head's leaves (to
    accumulate them as they arrive) counted as a later head's callable registering a
    hook: the trunk ran once per head, the strategy text blamed a callable."""
    def run(strategy):
        torch.manual_seed(0)
        w = torch.randn(3, 3, requires_grad=True)
        a = [torch.randn(3, requires_grad=True) for _ in range(3)]
        with gp.track():
            z = (torch.randn(2, 3) @ w).tanh()
            x = Square.apply(z)  # a custom Function at the cut: its heads' passes capture there
        trunk_runs = []
        z.grad_fn.register_prehook(lambda g: trunk_runs.append(1))
        heads = [lambda i=i: (x * a[i]).sin().sum() for i in range(3)]
        with gp.track() if outer else contextlib.nullcontext():
            report = gp.backward_each(heads, strategy=strategy)[-1]
        return [w.grad, *(t.grad for t in a)], len(trunk_runs), report.strategy

    want, want_runs, _ = run("passes")
    got, runs, strategy = run("cut")
    assert_close(got, want)
    assert (want_runs, runs) == (3, 1)
    assert strategy == "cut: 3 head pass(es), then the trunk once from 1 edge(s)"

def _hooked_heads(how, hook, retain):
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    heads = [torch.randn(4, 1, requires_grad=True) for _ in range(2)]
    calls = []
    with gp.track():
        x = (torch.randn(3, 4) @ w).tanh()
        if retain:
            x.retain_grad()
        else:
            x.register_hook(lambda g: (calls.append(1), hook(g))[1])
        losses = [(x @ h).pow(2).sum() * 3 for h in heads]
    if how == "plain":
        for loss in losses:
            loss.backward(retain_graph=True)
        report = None
    else:
        report = gp.backward_each(losses, strategy=how)[-1]
    return w.grad, x.grad if retain else None, len(calls), report


@pytest.mark.parametrize("strategy", ["cut", "passes"])
@pytest.mark.parametrize("hook", [lambda g: -g, lambda g: g.clamp(-0.5, 0.5), None],
                         ids=["reversal", "clip", "retain_grad"])
def test_hooks_on_the_trunk_tensor_run_once_per_loss_as_in_the_plain_loop(strategy, hook):
    """NOTE [ Hooks at the cut ]: the cut ran them in each head's pass and again on the
    trunk's summed gradient (a reversal undone, a tensor's retained grad doubled)."""
    want_w, want_x, want_calls, _ = _hooked_heads("plain", hook, hook is None)
    got_w, got_x, calls, report = _hooked_heads(strategy, hook, hook is None)
    assert_close(got_w, want_w)
    if hook is None:
        assert_close(got_x, want_x)
    assert calls == want_calls
    assert report.strategy.startswith("passes")
    assert ("a hook below the cut" in report.strategy) == (strategy == "cut")


class _Reversed(nn.Module):
    """A gradient reversal layer as domain-adaptation code writes it: a hook on a
    local tensor, which is gone by the time the losses backpropagate."""

    def forward(self, x):
        y = x * 1
        y.register_hook(lambda g: -g)
        return y


def _trunk_with_hooks(where, hook, lazy):
    """``(.grad of the trunk's weight, calls of the hook, the last report)`` of a plain
    loop (``lazy=None``) or ``backward_each`` over two heads on a trunk with a hook
    ``where``: "param" (a parameter's, registered before track()), "deep" (a trunk
    tensor's below the cut, under track(), the tensor deleted), "accumulated" (a
    parameter's post-accumulate-grad hook), "module" (a reversal layer at the cut)."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    heads = [torch.randn(4, 1, requires_grad=True) for _ in range(2)]
    calls = []

    def counted(g):
        calls.append(1)
        return hook(g)

    if where == "param":
        w.register_hook(counted)
    elif where == "accumulated":
        w.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    with gp.track():
        z = torch.randn(3, 4) @ w
        if where == "deep":
            z.register_hook(counted)
        x = z.tanh()
        if where == "module":
            x = _Reversed()(x)
        del z
        if lazy:
            losses = [lambda h=h: (x @ h).pow(2).sum() * 3 for h in heads]
        else:
            losses = [(x @ h).pow(2).sum() * 3 for h in heads]
    if lazy is None:
        for loss in losses:
            loss.backward(retain_graph=True)
        return w.grad, len(calls), None
    report = gp.backward_each(losses)[-1]
    return w.grad, len(calls), report


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
@pytest.mark.parametrize("where", ["param", "deep", "accumulated", "module"])
def test_hooks_below_the_cut_run_once_per_loss_as_in_the_plain_loop(where, lazy):
    """NOTE [ Hooks at the cut ]: a hook below the cut ran once on the heads' summed
    gradient (a clipping hook clipped the sum; a parameter's post-accumulate hook ran
    once), and a hook at the cut on a tensor no longer alive ran twice (a reversal
    undone): backward_each's .grad differed from the plain loop's."""
    clip = (lambda g: g.clamp(-0.5, 0.5)) if where != "module" else (lambda g: g)
    want_w, want_calls, _ = _trunk_with_hooks(where, clip, None)
    got_w, calls, report = _trunk_with_hooks(where, clip, lazy)
    assert_close(got_w, want_w)
    assert calls == want_calls
    assert report.strategy.startswith("passes") and "a hook below the cut" in report.strategy


def test_backward_each_keeps_the_cut_where_hooks_are_on_the_heads_only():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    heads = [torch.randn(4, 1, requires_grad=True) for _ in range(2)]
    for h in heads:
        h.register_hook(lambda g: g.clamp(-0.5, 0.5))  # upper part only: each head's own pass
    with gp.track():
        x = (torch.randn(3, 4) @ w).tanh()
        losses = [(x @ h).pow(2).sum() * 3 for h in heads]
    report = gp.backward_each(losses)[-1]
    assert report.strategy.startswith("cut")


def _two_heads(build_trunk, head_fn=None, lazy=False, strategy="cut", plain=False):
    """``(.grad of every parameter, the last report)`` of two linear heads on
    ``build_trunk(inp)``, by a plain loop or ``backward_each``."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    heads = [nn.Linear(4, 1) for _ in range(2)]
    inp = torch.randn(3, 4, requires_grad=True)
    run_head = head_fn or (lambda h, x: h(x).pow(2).sum())
    with gp.track():
        x = build_trunk(trunk, inp)
        if lazy:
            losses = [lambda h=h: run_head(h, x) for h in heads]
        else:
            losses = [run_head(h, x) for h in heads]
    report = None
    if plain:
        for loss in losses:
            (loss() if lazy else loss).backward(retain_graph=True)
    else:
        report = gp.backward_each(losses, strategy=strategy)[-1]
    return [p.grad for m in (trunk, *heads) for p in m.parameters()] + [inp.grad], report


def _clipped_backward(trunk, inp):
    trunk[1].register_full_backward_hook(lambda m, gi, go: (gi[0].clamp(-0.05, 0.05),))
    return trunk(inp)


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
def test_a_modules_backward_hook_in_the_trunk_runs_once_per_loss(lazy):
    """A full backward hook that clips, on the trunk's last module: the cut ran it once,
    on the heads' summed gradient (NOTE [ Hooks at the cut ])."""
    want, _ = _two_heads(_clipped_backward, lazy=lazy, plain=True)
    got, report = _two_heads(_clipped_backward, lazy=lazy)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert report.strategy.startswith("passes")


class _Halved(torch.autograd.Function):
    """A custom Function at the trunk's output: its backward counts its calls."""

    calls: list = []

    @staticmethod
    def forward(ctx, a):
        return a * 1

    @staticmethod
    def backward(ctx, g):
        _Halved.calls.append(g.norm().item())
        return g * 0.5


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
def test_a_custom_function_at_the_cut_runs_once_on_the_sum_not_in_each_heads_pass(lazy):
    """NOTE [ Where a head's pass stops ]: backward(inputs=cut) ran the cut's nodes in
    every head's pass (a custom Function's backward T + 1 times)."""
    def build(trunk, inp):
        return _Halved.apply(trunk(inp))

    _Halved.calls = []
    want, _ = _two_heads(build, lazy=lazy, plain=True)
    assert len(_Halved.calls) == 2
    _Halved.calls = []
    got, report = _two_heads(build, lazy=lazy)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert len(_Halved.calls) == 1  # on the heads' summed gradient: linear, so the same
    assert report.strategy.startswith("cut")


def _checkpointed_trunk(trunk, inp):
    return torch.utils.checkpoint.checkpoint(trunk, inp, use_reentrant=True)


def _checkpointed_head(h, x):
    return torch.utils.checkpoint.checkpoint(lambda t: h(t).pow(2).sum(), x, use_reentrant=True)


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "callables"])
@pytest.mark.parametrize("where", ["trunk", "head"])
def test_backward_each_through_a_reentrant_checkpoint_equals_the_plain_loop(where, lazy):
    """A reentrant checkpoint refuses a pass that stops early: at the trunk's output, the
    heads' passes ran its node (RuntimeError: incompatible with .grad()); in a head, its
    pass to the cut does (NOTE [ A reentrant checkpoint in a head ])."""
    build = _checkpointed_trunk if where == "trunk" else (lambda trunk, inp: trunk(inp))
    head = _checkpointed_head if where == "head" else None
    want, _ = _two_heads(build, head, lazy=lazy, plain=True)
    got, report = _two_heads(build, head, lazy=lazy)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert report.strategy.startswith("cut")
    assert ("reentrant checkpoint" in report.strategy) == (where == "head")


def test_grads_each_accumulates_a_head_parameter_through_its_hook_once():
    """grads_each(accumulate=) took the heads' gradients with their hooks applied, then
    accumulated them through AccumulateGrad, which ran the hooks again (.grad doubled)."""
    def run(plain):
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        heads = [torch.randn(4, 1, requires_grad=True) for _ in range(2)]
        calls = []
        for h in heads:
            h.register_hook(lambda g: (calls.append(1), g * 2)[1])
        with gp.track():
            x = (torch.randn(3, 4) @ w).tanh()
            losses = [(x @ h).pow(2).sum() for h in heads]
        if plain:
            rows = []
            for loss in losses:
                rows.append(torch.autograd.grad(loss, [w], retain_graph=True))
                loss.backward(inputs=heads, retain_graph=True)
        else:
            rows = gp.grads_each(losses, [w], accumulate=heads)
        return rows, [h.grad for h in heads], len(calls), [h._backward_hooks for h in heads]

    want_rows, want_grads, want_calls, _ = run(True)
    rows, grads, calls, hooks = run(False)
    assert_close(rows, want_rows)
    assert_close(grads, want_grads)
    assert calls == want_calls == 2
    assert all(len(d) == 1 for d in hooks)  # held back during the accumulation, then restored


@pytest.mark.parametrize("checkpointed", ["both", "the deeper"])
def test_heads_that_run_whole_passes_leave_nothing_of_the_trunk(checkpointed):
    """A head with a reentrant checkpoint runs its whole pass, the trunk kept: the trunk
    goes after the last pass, the part only such a head taps (deeper) too."""
    def run(plain):
        torch.manual_seed(0)
        trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        heads = [nn.Linear(4, 1) for _ in range(2)]
        with gp.track():
            deep = trunk[:2](torch.randn(3, 4))
            x = trunk[2](deep)
            first = _checkpointed_head(heads[0], deep)  # taps the trunk below x
            second = _checkpointed_head(heads[1], x) if checkpointed == "both" else heads[1](x).pow(2).sum()
        if plain:
            for loss in (first, second):
                loss.backward(retain_graph=True)
            return [p.grad for m in (trunk, *heads) for p in m.parameters()], None, deep
        reports = gp.backward_each([first, second])
        return [p.grad for m in (trunk, *heads) for p in m.parameters()], reports, deep

    want, _, _ = run(True)
    got, reports, deep = run(False)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert "reentrant checkpoint" in reports[-1].strategy
    assert not _live_handles(deep)


def _mgda_ub(rows):
    """MGDA-UB's step after the gradients at the shared representation z: one
    backward from z with their weighted sum."""
    weights = torch.softmax(torch.stack([r.norm() for r in rows]), 0)
    return sum(w * r for w, r in zip(weights, rows))


@pytest.mark.parametrize("inputs", ["tensor", "edge"])
def test_grads_each_at_an_intermediate_keeps_the_graph_below_it_for_its_backward(inputs):
    # MGDA-UB: the rows at z, then z.backward(g); the last pass released the trunk
    # below z, which no pass ran and PyTorch's own retain_graph=False pass keeps
    trunk, heads, inp = _model()
    z = trunk(inp)
    plain = [torch.autograd.grad(h(z).square().mean(), [z, *h.parameters()]) for h in heads]
    z.backward(_mgda_ub([g[0] for g in plain]))
    want = _grads(trunk)
    trunk, heads, inp = _model()
    with gp.track():
        z = trunk(inp)
        losses = [h(z).square().mean() for h in heads]
    at = z if inputs == "tensor" else torch.autograd.graph.get_gradient_edge(z)
    rows = gp.grads_each(losses, [at], accumulate=list(heads.parameters()))
    assert gp.last_report().bytes_freed > 0  # the last head still goes
    for row, g in zip(rows, plain):
        assert_close(row[0], g[0])
    z.backward(_mgda_ub([r[0] for r in rows]))
    assert_close(_grads(trunk), want)
    for h, g in zip(heads, plain):
        assert_close([p.grad for p in h.parameters()], list(g[1:]))
    with pytest.raises(gp.ReleasedTensorError):
        losses[0].backward()  # the heads were released


def test_grads_each_at_an_intermediate_with_keep_releases_what_keep_does_not_name():
    trunk, heads, inp = _model()
    with gp.track():
        z = trunk(inp)
        losses = [h(z).square().mean() for h in heads]
    gp.grads_each(losses, [z], keep=[])
    with pytest.raises(gp.ReleasedTensorError):
        z.backward(torch.ones_like(z))


@pytest.mark.parametrize("change", ["a weight under no_grad", "the accumulated .grad"])
def test_passes_runs_the_trunk_after_each_callable_as_the_loop_does(change):
    # README: with callables, "cut" runs the trunk after the last of them; a callable that
    # changes trunk state in place needs strategy="passes", which gives the loop's .grad
    def step(plain):
        torch.manual_seed(0)
        inp = torch.randn(3, 4)
        wa, wb = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        wh0, wh1 = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        wa.grad = torch.zeros(4, 4)

        def touch():
            with torch.no_grad():
                (wb if change == "a weight under no_grad" else wa.grad).mul_(0.5)

        with contextlib.nullcontext() if plain else gp.track():
            x1 = (inp @ wa).tanh()
            x2 = (x1 @ wb).tanh()

            def head0():
                return (x2 * wh0).sum()

            def head1():
                touch()
                return (x1 * wh1).sin().sum()

            if plain:
                head0().backward(retain_graph=True)
                head1().backward(retain_graph=True)
            else:
                gp.backward_each([head0, head1], strategy="passes")
        return wa.grad, wh0.grad, wh1.grad

    for got, want in zip(step(plain=False), step(plain=True)):
        assert_close(got, want)


@pytest.mark.parametrize("call", ["backward_each", "grads_each"])
def test_heads_as_callables_on_a_trunk_another_thread_built(call):
    # autograd numbers nodes per thread: the trunk was taken for the first head's part, and
    # that head's pass released it (reproduced in review, every time)
    import threading

    torch.manual_seed(0)
    w0, h0 = torch.randn(4), [torch.randn(4) for _ in range(3)]
    w, heads = w0.clone().requires_grad_(), [h.clone().requires_grad_() for h in h0]
    for _ in range(200):  # this thread's node numbers run far above a new thread's
        (w * 2).sum()
    with gp.track():
        x = w.exp().sin()
    callables = [lambda h=h: (x * h).cos().sum() for h in heads]
    out = {}

    def work():
        try:
            if call == "backward_each":
                gp.backward_each(callables)
                out["got"] = [w.grad, *(h.grad for h in heads)]
            else:
                out["got"] = [row[0] for row in gp.grads_each(callables, [w])]
        except Exception as e:  # read below, in the test's thread
            out["error"] = e

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    wr, hr = w0.clone().requires_grad_(), [h.clone().requires_grad_() for h in h0]
    xr = wr.exp().sin()
    losses = [(xr * h).cos().sum() for h in hr]
    if call == "backward_each":
        sum(losses).backward()
        want = [wr.grad, *(h.grad for h in hr)]
    else:
        want = [torch.autograd.grad(loss, wr, retain_graph=True)[0] for loss in losses]
    for got, expected in zip(out["got"], want, strict=True):
        assert_close(got, expected)
