"""Multi-task libraries' loops under graphprune: ``gp.pruning()`` and the examples of issue 8, point 4.

The ``pruning()`` tests compare each routed loop with the same loop in plain PyTorch
(``assert_close``) and check what was freed; the example tests run each script in a
fresh process (each asserts its gradients against plain PyTorch itself) and read the
one line it prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import graphprune as gp
from graphprune._graph import saved, walk

ROOT = pathlib.Path(__file__).resolve().parent.parent
T = 3


def _model(seed=0):
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    heads = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)) for _ in range(T))
    return trunk, heads, torch.randn(16, 8)


def _assigned(trunk, heads, inp):
    """LibMTL's trainer: ``losses = torch.zeros(T); losses[i] = loss_i``."""
    x = trunk(inp)
    losses = torch.zeros(T)
    for i, h in enumerate(heads):
        losses[i] = h(x).square().mean()
    return x, losses


def _pcgrad_loop(trunk, losses):
    """The loop of a PCGrad port, unchanged: each task's shared gradient via ``.grad``."""
    rows = []
    for i in range(T):
        losses[i].backward(retain_graph=True) if i + 1 != T else losses[i].backward()
        rows.append(torch.cat([p.grad.flatten() for p in trunk.parameters()]))
        for p in trunk.parameters():
            p.grad = None
    return rows


def _grads(*modules):
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


def _live_handles(t):
    return [h for n in walk([t.grad_fn]) for h in saved(n)[0] if h.tensor is not None and not h.leaf]


@pytest.mark.parametrize("order", ["pruning outside track", "track outside pruning", "pruning after track"])
def test_pruning_routes_a_library_loop_and_frees_each_head(order):
    trunk, heads, inp = _model()
    want = _pcgrad_loop(trunk, _assigned(trunk, heads, inp)[1])
    want_heads = _grads(heads)
    for m in (trunk, heads):
        m.zero_grad(set_to_none=True)
    if order == "pruning outside track":
        with gp.pruning() as p, gp.track():
            x, losses = _assigned(trunk, heads, inp)
            got = _pcgrad_loop(trunk, losses)
    elif order == "track outside pruning":
        with gp.track(), gp.pruning() as p:
            x, losses = _assigned(trunk, heads, inp)
            got = _pcgrad_loop(trunk, losses)
    else:
        with gp.track():
            x, losses = _assigned(trunk, heads, inp)
        with gp.pruning() as p:
            got = _pcgrad_loop(trunk, losses)
    assert_close(got, want)
    assert_close(_grads(heads), want_heads)
    assert len(p.reports) == T - 1  # the last call has no retain_graph: PyTorch's own
    assert p.passed == [("Tensor.backward", "retain_graph is not set: PyTorch frees the graph itself")]
    for r in p.reports:  # each routed pass freed its own head (Linear, Tanh, Linear, the loss)
        assert r.released_node_count >= 3 and r.bytes_freed > 0, str(r)
        assert r.call == "graphprune.backward"


def test_pruning_autograd_grad_and_backward_with_inputs_and_gradient():
    trunk, heads, inp = _model()
    params = list(trunk.parameters())
    x = trunk(inp)
    sums = [h(x).sum() for h in heads]
    want = [torch.autograd.grad(s, params, retain_graph=True) for s in sums[:2]]
    sums[2].backward(torch.tensor(2.0), retain_graph=True, inputs=params)
    want.append(_grads(trunk))
    trunk.zero_grad(set_to_none=True)
    with gp.track():
        x = trunk(inp)
        sums = [h(x).sum() for h in heads]
    with gp.pruning() as p:
        got = [torch.autograd.grad(s, params, retain_graph=True) for s in sums[:2]]
        torch.autograd.backward(sums[2], torch.tensor(2.0), retain_graph=True, inputs=params)
    got.append(_grads(trunk))
    assert_close(got, want)
    assert [r.call for r in p.reports] == ["graphprune.grad", "graphprune.grad", "graphprune.backward"]
    assert all(r.released_node_count > 0 for r in p.reports), [str(r) for r in p.reports]
    assert not _live_handles(x)  # the last pass freed the trunk: no loss was left to backpropagate
    assert all(p.grad is None for p in heads.parameters())  # inputs= stopped the passes there


def test_pruning_grad_with_a_dict_of_inputs():
    w, v = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    with gp.track():
        y1, y2 = (w * v).exp().sum(), (w * 3).sum()  # y2: a live loss on another graph
    with gp.pruning() as p:
        got = torch.autograd.grad(y1, {"w": w, "v": v}, retain_graph=True)
    assert list(got) == ["w", "v"]
    assert_close(got["w"], torch.full((2,), torch.e))
    assert p.reports[0].released_node_count == 2  # Exp and Mul; y2 is another graph
    assert y2.grad_fn is not None


def test_pruning_with_create_graph_keeps_what_the_gradient_graph_needs():
    """GradNorm's norm of a weighted loss's gradient: create_graph retains, as in PyTorch."""
    torch.manual_seed(0)
    W = torch.randn(4, 4, requires_grad=True)
    wts = torch.ones(2, requires_grad=True)
    inp = torch.randn(8, 4)

    def run():
        h = (inp @ W).tanh()
        losses = [h.sin().mean(), h.cos().mean()]
        total = wts[0] * losses[0] + wts[1] * losses[1]
        norms = [torch.autograd.grad(wts[i] * losses[i], W, create_graph=True)[0].norm() for i in range(2)]
        (gw,) = torch.autograd.grad(sum(norms), wts, retain_graph=True)
        total.backward()
        return gw, W.grad.clone()

    want = run()
    W.grad = None
    with gp.track(), gp.pruning() as p:
        got = run()
    assert_close(got, want)
    assert [r.call for r in p.reports] == ["graphprune.grad"] * 3
    assert p.passed == [("Tensor.backward", "retain_graph is not set: PyTorch frees the graph itself")]


def test_pruning_leaves_graphprune_own_calls_and_batched_passes_to_pytorch():
    w = torch.ones(3, requires_grad=True)
    with gp.track():
        x = w.exp()
        losses = torch.stack([(x * x).sum(), x.sin().sum()])
    with gp.pruning() as p:
        (g,) = torch.autograd.grad(losses, w, torch.eye(2), retain_graph=True, is_grads_batched=True)
        (h,) = torch.vmap(lambda v: torch.autograd.grad(losses, w, v, retain_graph=True))(torch.eye(2))
        report = gp.backward(losses[0], keep=x)  # graphprune's own pass is not routed again
    assert report.released_node_count == 1 and not p.reports
    reasons = [why for _, why in p.passed]
    assert reasons == 2 * ["a batched pass (is_grads_batched or torch.vmap): graphprune cannot check it"] + [
        "graphprune's own pass"]
    xe = torch.full((3,), torch.e)
    assert_close(g, h)
    assert_close(g[1], xe.cos() * xe)


def test_pruning_keeps_the_features_its_grads_stop_at_for_a_later_pass():
    """The hand-made cut: per-task gradients at the features, then one pass from there.
    ``keep=None`` keeps what lies below the features, which no gradient pass runs (as
    ``autograd.grad`` without ``retain_graph`` does), and frees the heads; so does
    ``pruning(keep=feats)``. It used to free the trunk with the last head."""
    trunk, heads, inp = _model()

    def step(keep, with_graphprune=True):
        with gp.track():
            feats = trunk(inp)
            losses = [h(feats).square().mean() for h in heads]
        with gp.pruning(keep=keep(feats)) if with_graphprune else torch.enable_grad():
            cut = [torch.autograd.grad(loss, feats, retain_graph=True)[0] for loss in losses]
            feats.backward(sum(cut))
        if with_graphprune:
            with pytest.raises(gp.ReleasedTensorError):
                losses[-1].backward()
        return _grads(trunk)

    want = step(lambda f: None, with_graphprune=False)
    for keep in (lambda f: f, lambda f: None):
        trunk.zero_grad(set_to_none=True)
        assert_close(step(keep), want)


@pytest.mark.parametrize("which", ["jacobian", "hessian"])
def test_pruning_leaves_torch_s_own_retained_passes_to_pytorch(which):
    # torch.autograd.functional's row-by-row jacobian and hessian make one retained
    # grad per row from the same output: routed, the first freed what the next needed
    W, x0 = torch.randn(4, 4), torch.randn(4)

    def f(x):
        return torch.tanh(x @ W) if which == "jacobian" else torch.tanh(x @ W).sum()

    fn = getattr(torch.autograd.functional, which)
    want = fn(f, x0)
    with gp.track(), gp.pruning() as p:
        got = fn(f, x0)
        loss = f(x0.requires_grad_()).sum()
        loss.backward(retain_graph=True)  # the user's own call is still routed
    assert_close(got, want)
    assert p.passed and {why for _, why in p.passed} == {
        "torch's own code made the call (torch.autograd.functional's jacobian and hessian retain the graph "
        "for the next pass from the same output)"}
    assert len(p.reports) == 1


def test_pruning_second_pass_from_one_loss_is_told_to_open_the_block_with_keep():
    """Gradients by parameter group: two retained passes from one loss. The first,
    routed, freed what the second needs; the error said "Pass keep=<the tensor you
    backpropagate later> to that call", which code under ``pruning()`` cannot do, and
    named neither the loss nor the torch call that freed it."""
    trunk, heads, inp = _model()

    def step(block):
        with gp.track():
            loss = heads[0](trunk(inp)).square().mean()
        with block(loss):
            g_head = torch.autograd.grad(loss, list(heads[0].parameters()), retain_graph=True)
            g_trunk = torch.autograd.grad(loss, list(trunk.parameters()))
        return [*g_head, *g_trunk]

    with pytest.raises(gp.ReleasedTensorError) as raised:
        step(lambda loss: gp.pruning())
    message = str(raised.value)
    assert "released by torch.autograd.grad(tensor of shape ()" in message
    assert "(graphprune.pruning() ran it as graphprune.grad)" in message
    assert "The graph of loss (tensor of shape ()" in message and "(that call's own output)" in message
    assert "Open the graphprune.pruning() block with keep=loss if a later" in message
    assert_close(step(lambda loss: gp.pruning(keep=loss)), step(lambda loss: torch.enable_grad()))


def test_pruning_on_a_graph_built_outside_track_warns_at_the_callers_line():
    w = torch.ones(3, requires_grad=True)
    y = (w.exp() * 2).sum()  # no track(): nothing of it can be freed
    with gp.pruning(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y.backward(retain_graph=True); line = sys._getframe().f_lineno  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in caught] == [(gp.GraphPruneWarning, __file__, line)]
    assert "outside graphprune.track()" in str(caught[0].message)


def test_pruning_records_no_forward():
    w = torch.ones(3, requires_grad=True)
    with gp.pruning():
        x = w.exp()
        y1, y2 = (x * x).sum(), x.sin().sum()
    kinds = {n.name(): saved(n)[1] for n in walk([y1.grad_fn, y2.grad_fn])}
    assert kinds["MulBackward0"] == kinds["ExpBackward0"] == kinds["SinBackward0"] == "untracked"


def test_pruning_acts_in_its_own_thread_only():
    trunk, heads, inp = _model()
    with gp.track():
        x, losses = _assigned(trunk, heads, inp)
    held = len(_live_handles(losses))
    seen = []

    def other():  # plain PyTorch here: retain_graph=True keeps everything
        losses[0].backward(retain_graph=True)
        seen.append(len(_live_handles(losses)))

    with gp.pruning() as p:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        losses[1].backward(retain_graph=True)
    assert seen == [held]
    assert len(p.reports) == 1 and p.reports[0].released_node_count > 0
    assert len(_live_handles(losses)) < held


def test_pruning_in_two_threads_at_once():
    models = [_model(seed=i) for i in range(2)]
    want = [_pcgrad_loop(trunk, _assigned(trunk, heads, inp)[1]) for trunk, heads, inp in models]
    errors, results = [], {}

    def work(i):
        try:
            trunk, heads, inp = models[i]
            with gp.track():
                _, losses = _assigned(trunk, heads, inp)
            with gp.pruning() as p:
                rows = _pcgrad_loop(trunk, losses)
            results[i] = (rows, len(p.reports))
        except Exception as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert_close(results[i][0], want[i])
        assert results[i][1] == T - 1


def test_pruning_errors():
    p = gp.pruning()
    with p, pytest.raises(RuntimeError, match="already active; use a new pruning"):
        p.__enter__()
    with pytest.raises(TypeError, match="keep must be a tensor"):
        gp.pruning(keep=3).__enter__()
    with pytest.raises(ValueError, match="keep does not require grad"):
        gp.pruning(keep=torch.ones(2)).__enter__()
    q = gp.pruning()
    q.__enter__()
    failed = []
    thread = threading.Thread(target=lambda: failed.append(_raises(lambda: q.__exit__(None, None, None))))
    thread.start()
    thread.join()
    q.__exit__(None, None, None)
    assert failed == ["graphprune.pruning: a block must be closed in the thread that opened it"]
    w = torch.ones(2, requires_grad=True)
    with gp.pruning() as r, pytest.raises(RuntimeError, match="does not require grad"):
        torch.ones(2).sum().backward(retain_graph=True)  # PyTorch's own error, unchanged
    assert "no tensor with a grad_fn" in r.passed[0][1]
    assert repr(r) == "<graphprune.pruning: 0 routed, 1 plain call(s)>"
    del w


def _raises(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


# -- the examples ------------------------------------------------------------------------------------------


def _run_example(name: str) -> tuple[dict, str]:
    """Run examples/<name>.py in a fresh process; its ``RESULT`` line, and its output."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GraphPruneWarning" not in proc.stderr, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["name"] == name and f"{name}: gradients equal plain PyTorch" in proc.stdout
    return result, proc.stdout


_results: dict = {}


def _example(name: str) -> tuple[dict, str]:
    if name not in _results:
        _results[name] = _run_example(name)
    return _results[name]


def test_pcgrad_assigned_frees_each_head_during_its_own_pass():
    r, _ = _example("pcgrad_assigned")
    assert len(r["freed_per_pass_mib"]) == T and all(f > 0 for f in r["freed_per_pass_mib"]), r
    plain, pruned = r["held_after_each_pass_mib_plain"], r["held_after_each_pass_mib_graphprune"]
    for i in range(T - 1):  # one head fewer after each pass; plain holds them all until the last
        assert pruned[i] <= plain[i] - (i + 1) * 0.9, r
    assert pruned[-1] == plain[-1] == 0, r


def test_cagrad_under_pruning_routes_the_retained_passes_only():
    r, _ = _example("cagrad")
    assert len(r["freed_per_pass_mib"]) == T - 1 and all(f > 0 for f in r["freed_per_pass_mib"]), r
    assert r["plain_calls"] == 1 + 20  # the last task's pass and the weight solve's backward calls
    plain, pruned = r["held_after_each_pass_mib_plain"], r["held_after_each_pass_mib_graphprune"]
    assert all(a < b for a, b in zip(pruned, plain)), r
    assert pruned[-1] == 0 < plain[-1], r  # plain's last pass leaves the other heads


def test_mgda_weighted_sum_after_pruned_passes_raises_and_grads_each_form_is_lighter():
    r, out = _example("mgda")
    assert "as expected: ReleasedTensorError: graphprune: a backward pass needs a saved tensor of" in out
    assert "released by graphprune.grad(" in out
    assert r["last_pass_freed_mib"] > 0, r
    assert r["peak_mib_graphprune"] <= r["peak_mib_plain"] - (T - 1) * 0.9, r  # the trunk and one head


def test_mgda_naive_form_raises_in_process():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import mgda
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with pytest.raises(gp.ReleasedTensorError, match="released by graphprune.grad"):
        mgda.naive_graphprune_step()


def test_gradnorm_frees_the_graph_at_the_end_of_the_step():
    r, _ = _example("gradnorm")
    freed = r["freed_per_pass_mib"]
    assert freed[:-1] == [0.0] * (T + 1) and freed[-1] > 0, r  # every pass but the last needs it all
    assert r["held_at_end_mib_graphprune"] < 0.1 < r["held_at_end_mib_plain"], r


def test_jacobian_descent_torchjd_under_graphprune_and_grads_each():
    pytest.importorskip("torchjd")
    r, _ = _example("jacobian_descent")
    assert r["torchjd_vmap_routed"] == 0 and r["torchjd_vmap_plain_calls"] == T + 1, r
    assert r["torchjd_chunk1_routed_freed_mib"] == [0.0] * (T - 1), r
    assert r["peak_mib_graphprune"] <= r["peak_mib_torchjd"] - (T - 1) * 0.9, r


def test_libmtl_weighting_classes_unmodified_under_pruning():
    for package in ("LibMTL", "scipy"):  # LibMTL's own __init__ fails to import: see the example
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (setup.cfg's test extra)")
    r, _ = _example("libmtl_weighting")
    freed = r["freed_per_routed_pass_mib"]
    assert sorted(freed) == ["CAGrad", "GradNorm", "MGDA", "PCGrad"]
    for name, passes in freed.items():  # T - 1 retained passes, each freed its head
        assert len(passes) == T - 1 and all(f > 0 for f in passes), (name, passes)


def _numbers(value) -> set[float]:
    if isinstance(value, dict):
        return set().union(*(_numbers(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_numbers(v) for v in value)) if value else set()
    return {float(value)} if isinstance(value, (int, float)) and not isinstance(value, bool) else set()


def test_readme_multi_task_section_matches_fresh_runs():
    section = (ROOT / "README.md").read_text().split("\n## Multi-task libraries\n", 1)[1].split("\n## ", 1)[0]
    assert "gp.pruning()" in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and "examples/" in line]
    names = [line.split("examples/", 1)[1].split(".py", 1)[0] for line in rows]
    assert names == ["pcgrad_assigned", "cagrad", "mgda", "gradnorm", "jacobian_descent", "libmtl_weighting"]
    for name, line in zip(names, rows):
        if name == "libmtl_weighting" and importlib.util.find_spec("LibMTL") is None:
            continue
        quoted = {float(x) for x in re.findall(r"\d+\.\d+", line.rsplit("|", 2)[1])}  # MiB, not pass numbers
        assert quoted and quoted <= _numbers(_example(name)[0]), (name, quoted)


def test_a_pruning_block_around_a_whole_run_holds_only_its_latest_reports():
    # one block around a library's fit(): it held a report (with its node-id sets) per
    # routed call of the run
    w = torch.ones(3, requires_grad=True)
    with gp.pruning(history=4) as p:
        for _ in range(10):
            with gp.track():
                x = w.exp()
                l1, l2 = (x * x).sum(), x.sin().sum()
            l1.backward(retain_graph=True)  # routed: gp.backward
            l2.backward()  # plain: PyTorch frees the graph
    assert (len(p.reports), len(p.passed), p.routed, p.plain) == (4, 4, 10, 10)
    assert repr(p) == "<graphprune.pruning: 10 routed, 10 plain call(s)>"
    with gp.pruning(history=None) as everything:
        for _ in range(3):
            with gp.track():
                y = w.exp().sum()
            y.backward(retain_graph=True)
    assert len(everything.reports) == everything.routed == 3


@pytest.mark.parametrize("history, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError),
                                            ("10", TypeError)])
def test_pruning_refuses_a_history_that_is_no_positive_int(history, error):
    with pytest.raises(error, match="history"):
        gp.pruning(history=history)
