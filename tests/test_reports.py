"""What a report says: node ids to colour a graph by, every byte the trunk holds, one
tensor named once."""

import weakref

import pytest
import torch

import graphprune as gp
from graphprune._graph import saved, walk


def test_report_node_ids_are_the_graph_snapshot_ids():
    w = torch.randn(64, 64, requires_grad=True)
    with gp.track() as tape:
        x = (w * 2).relu()
        y1 = x.exp().sum()
        y2 = x.sin().sum()
    report = gp.explain(y1)
    graph = tape.graph()
    branch = {id(n) for n in walk([y1.grad_fn]) if saved(n)[0]} - {id(n) for n in walk([y2.grad_fn])}
    assert report.released_ids == branch
    assert {graph.nodes[i]["op"] for i in report.released_ids} == {"ExpBackward0"}
    (kept,) = report.kept
    assert "y2" in kept.reason
    assert kept.node_ids <= set(graph.nodes)
    assert {graph.nodes[i]["op"] for i in kept.node_ids} >= {"ReluBackward0", "MulBackward0"}
    assert kept.node_ids.isdisjoint(report.released_ids)


def test_retain_graph_report_keeps_every_node_id():
    w = torch.randn(8, requires_grad=True)
    with gp.track():
        y = (w * 2).exp().sum()
    report = gp.backward(y, retain_graph=True)
    assert report.released_ids == frozenset()
    assert {"ExpBackward0", "MulBackward0"} <= {n.name() for n in walk([y.grad_fn]) if id(n) in
                                                report.kept[0].node_ids}


def test_bytes_kept_counts_a_saved_tensor_that_needs_no_grad():
    lstm = torch.nn.LSTM(16, 64, batch_first=True)
    inp = torch.randn(4, 20, 16)
    with gp.track():
        out, (h, c) = lstm(inp)
        loss = out.square().mean()
    kept = gp.explain(loss, keep=[h, c]).bytes_kept
    workspaces = [hd for n in walk([h.grad_fn]) for hd in saved(n)[0]
                  if hd.leaf and not hd.tensor.requires_grad and hd.tensor is not inp]
    assert workspaces, "the LSTM node saves workspaces that need no grad"
    assert kept >= sum(hd.tensor.nbytes for hd in workspaces)


def test_bytes_kept_counts_dropout_noise_but_not_the_input_the_user_holds():
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    inp = torch.randn(256, 256)
    with gp.track():
        x = torch.nn.functional.dropout(inp @ w, 0.5)  # mm saves inp (held here) and w
        y1 = x.exp().sum()
        y2 = x.sum()
    report = gp.explain(y1)
    assert report.bytes_kept == 256 * 256 * 4  # the dropout's noise: only the graph holds it
    del inp
    assert gp.explain(y1).bytes_kept == 2 * 256 * 256 * 4  # now the graph alone holds the input
    y2.backward()


def test_bytes_kept_counts_a_mask_the_trunk_and_the_pruned_branch_both_saved():
    """The branch's handle on the mask is released by the same call: after it, the
    trunk alone holds the mask, so it is the trunk's memory."""
    w = torch.randn(64, requires_grad=True)
    with gp.track():
        mask = (torch.arange(64) % 2).float()
        x = w.exp() * mask  # the trunk saves exp's result and the mask
        y1 = (x * mask).sum()  # the branch saves the mask too
        y2 = x.sin().sum()
    del mask
    y1.backward(retain_graph=True)
    assert gp.prune_after(y1).bytes_kept == 2 * 64 * 4
    y2.backward()


def test_bytes_freed_counts_a_storage_whose_python_object_exists():
    """A storage's Python object (made by an earlier prune's look at a view of it, or by
    the user's ``untyped_storage()``) is one more use of it, and no reason it stays."""
    for made_by in ("an earlier prune", "the user"):
        w = torch.randn(8, 8, requires_grad=True)
        inp = torch.randn(8, 8)
        with gp.track():
            h = inp @ w
            a = h.sin()  # saves h whole
            b = h[0:4].cos()  # saves a view of h
            l1, l2 = b.sum(), a.sum()
        if made_by == "the user":
            h.untyped_storage()
        del h, a, b
        l1.backward(retain_graph=True)
        assert gp.prune_after(l1).bytes_freed == 0  # SinBackward0 still holds h's storage
        l2.backward(retain_graph=True)
        storage = weakref.ref(l2.grad_fn.next_functions[0][0]._raw_saved_self.data.tensor.untyped_storage())
        report = gp.prune_after(l2)
        assert storage() is None, made_by
        assert report.bytes_freed == 8 * 8 * 4, made_by


def test_bytes_freed_leaves_out_a_storage_whose_python_object_the_program_holds():
    # s = h.untyped_storage() keeps h's memory after the prune: it was counted as freed
    # (the storage's object, which PyTorch keeps for the storage's life, counted no use)
    for saved_view in (False, True):
        w = torch.randn(8, 8, requires_grad=True)
        with gp.track():
            x = (torch.randn(8, 8) @ w).relu()
            h = x @ w
            y1 = (h[0:4] if saved_view else h).exp().sum()  # ExpBackward0 saves its result
        s = y1.grad_fn.next_functions[0][0]._raw_saved_result.data.tensor.untyped_storage()
        del h
        y1.backward(retain_graph=True)
        assert gp.explain(y1, keep=x).bytes_freed == 0, saved_view
        assert gp.prune_after(y1, keep=x).bytes_freed == 0, saved_view
        assert s.nbytes() > 0


def test_bytes_kept_leaves_out_the_parameters_a_linear_layer_saves_as_views():
    # nn.Linear saves weight.t(), a view of a parameter that is no leaf: bytes_kept
    # counted each weight of the trunk as the graph's memory
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU())
    head = torch.nn.Linear(64, 64)
    inp = torch.randn(32, 64)  # the program holds it: not the graph's memory either
    with gp.track():
        hidden = trunk[1](trunk[0](inp))
        x = trunk[3](trunk[2](hidden))
        y1 = head(x).tanh().sum()
    y1.backward(retain_graph=True)
    activations = hidden.nbytes + x.nbytes  # what the trunk's ReLUs and second layer saved
    assert gp.explain(y1, keep=x).bytes_kept == activations
    assert gp.prune_after(y1, keep=x).bytes_kept == activations


def test_bytes_freed_of_a_pass_stopped_at_inputs_counts_only_the_nodes_it_ran():
    w = torch.randn(64, requires_grad=True)
    with gp.track():
        a = w.exp()
        x = a.sin() * 1.0  # ExpBackward0 and SinBackward0 save a; the pass stops above them
        c = x.cos()
        y = (c * c).sum()  # MulBackward0 saves c: freed
    del a, c
    below = x.grad_fn.next_functions[0][0]
    report = gp.backward(y, retain_graph=False, inputs=[x])
    assert not below._raw_saved_self.data.released
    assert report.bytes_freed == 64 * 4


def test_a_view_of_a_finished_tensor_is_finished():
    w = torch.randn(128, 128, requires_grad=True)
    with gp.track():
        x = (w * 2).relu()
        logits = (x @ w).tanh()
        flat = logits.view(-1)  # held for logging, like logits itself
        y1 = logits.exp().mean()
        y2 = x.sum()
    report = gp.backward(y1)
    assert report.released_node_count == 3  # Exp, Tanh, Mm: flat does not keep the head
    assert not any("flat" in r.reason for r in report.kept)
    y2.backward()
    assert flat.shape == (128 * 128,)


def test_a_view_and_its_base_are_named_once():
    w = torch.randn(128, 128, requires_grad=True)
    with gp.track():
        x = (w * 2).relu()
        aux = (x @ w).square().mean()
        aux_1d = aux.view(1)  # the same loss, shaped for gathering
        y1 = x.exp().sum()
    report = gp.explain(y1)
    reasons = " | ".join(r.reason for r in report.kept)
    assert "aux (" in reasons and "aux_1d" not in reasons, reasons
    assert aux_1d.shape == (1,)


def test_a_checkpointed_regions_inputs_are_counted_not_silently_held():
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(256, 256, requires_grad=True)
    with gp.track():
        x = (w * 2).relu()
        h = x.exp()  # the region's input: only the region keeps it
        y1 = checkpoint(lambda a: (a @ w).tanh().sum(), h, use_reentrant=False)
        y2 = x.sum()
    del h
    report = gp.backward(y1)
    (region,) = [r for r in report.kept if "checkpoint" in r.reason]
    assert "graphprune holds the checkpointed regions' inputs" in region.reason
    assert region.saved_bytes == 256 * 256 * 4
    assert report.bytes_kept >= region.saved_bytes
    y2.backward()


def test_a_checkpointed_regions_inputs_are_counted_with_a_timeline_too():
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(64, 64, requires_grad=True)
    with gp.track(timeline=gp.Timeline("run")):
        x = (w * 2).relu()
        h = x.exp()
        y1 = checkpoint(lambda a: (a @ w).tanh().sum(), h, use_reentrant=False)
        y2 = x.sum()
    del h
    (region,) = [r for r in gp.explain(y1).kept if "checkpoint" in r.reason]
    assert region.saved_bytes == 64 * 64 * 4
    y2.backward()


def test_a_prune_leaves_a_locals_dict_the_program_holds():
    """Reading a frame's locals for a pending loss's name emptied the frame's one
    locals dict (Python < 3.13), which ``cfg = locals()`` holds: the program's config."""
    def train(lr=0.1, steps=3):
        cfg = locals()
        w = torch.randn(3, requires_grad=True)
        with gp.track():
            x = w.exp()
            l1, l2 = x.sin().sum(), x.cos().sum()
        report = gp.backward(l1)
        return cfg, report, l2

    cfg, report, _ = train()
    assert cfg["lr"] == 0.1 and cfg["steps"] == 3
    assert any(r.reason.startswith("l2 (") for r in report.kept)  # named, as before


def test_names_are_not_looked_for_in_long_containers():
    # every prune that kept a pending loss looked through every list, dict and object
    # in three frames' locals: 150 ms for three passes beside a 2M-entry metrics log
    from graphprune._outputs import _SCAN_AT_MOST, name_in_frames

    short = [torch.zeros(()), torch.ones(())]
    log = [torch.zeros(()) for _ in range(_SCAN_AT_MOST)] + [torch.ones(())]
    named, unnamed = name_in_frames(short[1]), name_in_frames(log[-1])  # not in an assert: pytest's
    assert (named, unnamed) == ("short[1]", None)  # rewriting binds what it evaluates to locals


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_a_tensor_a_module_stack_made_is_filed_at_the_users_line():
    # the creation site is the user's line however deep the module stack below it:
    # a tensor (Linear in a Sequential), a Parameter's attribute read on the way, and
    # one of a tuple (MultiheadAttention's output, through F.multi_head_attention_forward)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with gp.track():
        h = mlp(x); h_line = _line()  # noqa: E702
        a, _ = attention(h, h, h); a_line = _line()  # noqa: E702
        assert mlp[0].weight.dtype is torch.float32
        y = a.sum()
    y.backward(retain_graph=True)
    for kept, line in ((h, h_line), (a, a_line)):
        (reason,) = gp.explain(y, keep=kept).kept
        assert reason.reason.endswith(f"created at test_reports.py:{line}"), reason.reason


def test_a_pending_loss_is_named_as_not_backpropagated_through_graphprune():
    # a plain retained pass is not seen: the report said "not backpropagated yet" of a loss
    # that pass had run through
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        l1, l2 = x.sin().sum(), x.cos().sum()
    l2.backward(retain_graph=True)  # plain PyTorch, outside graphprune
    reasons = [k.reason for k in gp.backward(l1).kept]
    assert len(reasons) == 1 and reasons[0].startswith("l2 (tensor of shape ()")
    assert reasons[0].endswith(", not backpropagated through graphprune yet")


def test_a_custom_functions_output_is_described_where_a_tracked_call_first_used_it():
    # apply is no torch call: the recorder notes the output at its first use, and the
    # report said it was "created at" that line
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return (a ** 3).sum()

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 3 * a * a * g

    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        l1 = x.sin().sum()
        l2 = Cube.apply(x)
        assert torch.isfinite(l2); used = _line()  # noqa: E702
    l1.backward(retain_graph=True)
    (reason,) = gp.prune_after(l1).kept
    assert reason.reason.endswith(
        f"l2 (tensor of shape (), torch.float32, first used at test_reports.py:{used}), "
        "not backpropagated through graphprune yet"), reason.reason


def test_one_function_in_two_files_is_described_at_each_ones_file(tmp_path, monkeypatch):
    # two code objects of one text compare equal: the cache of "file.py:line" took the
    # second file's tensor as made in the first
    for name in ("report_head_a", "report_head_b"):
        (tmp_path / f"{name}.py").write_text("def loss(x):\n    return (x * x).sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import report_head_a as head_a
    import report_head_b as head_b

    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
        la, lb = head_a.loss(x), head_b.loss(x)
    assert head_a.loss.__code__ == head_b.loss.__code__
    assert gp.explain(la, keep=lb).kept[0].reason.endswith("created at report_head_b.py:2")
    assert gp.explain(lb, keep=la).kept[0].reason.endswith("created at report_head_a.py:2")


@pytest.mark.parametrize("head", ["sin", "mul3"])
def test_bytes_kept_is_the_same_whichever_form_keep_takes(head):
    # an input only the graph holds is the graph's memory: a local name that held it while
    # the measure counted references made it "held elsewhere" on some paths (found in review)
    w = torch.randn(64, 128, requires_grad=True)
    with gp.track():
        x = (torch.randn(8, 64) @ w).exp()  # mm saves its input (2048 B, only the graph's) and w
        l1 = x.sin().sum() if head == "sin" else (x * 3).sum()
        l2 = x.cos().sum()
    kept = {form: gp.explain(l1, keep=k).bytes_kept
            for form, k in {"None": None, "l2": l2, "x.grad_fn": x.grad_fn, "x": x}.items()}
    assert kept == dict.fromkeys(kept, 8 * 64 * 4 + 8 * 128 * 4), kept
