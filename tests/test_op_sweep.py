"""Op sweep: ``prune_after`` on the output of every differentiable op in ``op_db``.

For each OpInfo in ``torch.testing._internal.common_methods_invocations.op_db``
that supports autograd, the first samples (CPU, float64 where supported) feed one
op output ``out`` into two heads that save tensors of their own::

    head1(out) = (out.sin() * w1).sum()      # SinBackward0 saves out, Mul saves w1
    head2(out) = (out.cos() * out).sum()

(a complex output is fed to the heads through ``view_as_real``). The sweep proves,
per op and sample:

* **Mapping** (DESIGN.md fact 13): after the tracked forward, every node of the
  graph finds its handles through ``_raw_saved_*``, and every tensor its ``_saved_*``
  attributes unpack is one of its own handles, one for one (save wrapped Python
  scalars, which PyTorch saves without hooks). Every handle the forward packed is
  found on a node of the graph.
* **Gradients**: after ``y1.backward(retain_graph=True)``, ``prune_after(y1)`` and
  ``y2.backward()``, every leaf gradient equals that of the same program in plain
  PyTorch, and tracking raises no warning plain PyTorch does not. Even samples build
  head2 after the prune, outside ``track()``, so the prune names ``keep=out`` (the
  seed's ``retain_graph=x``); odd ones build it in the same ``track()`` before the
  prune, which then keeps its default: y2, not backpropagated yet, keeps ``out``.
* **Release**: the prune released head1's saved tensors, and a second
  ``y1.backward()`` raises :class:`graphprune.ReleasedTensorError` naming the
  released node.

Samples that plain PyTorch cannot run, or whose output is not a differentiable
real floating tensor, are skipped with their reason. A summary of ops and samples
is printed at the end of the module.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import warnings
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree

import graphprune
from graphprune._graph import live_handles
from graphprune._graph import name as node_name
from graphprune._saved import SavedHandle

pytest.importorskip("expecttest")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

SAMPLES_PER_OP = 2
DTYPE_PREFERENCE = (torch.float64, torch.float32, torch.complex128)
RELEASED_HEAD_NODE = "MulBackward0"  # head1's first node with a saved tensor, seen from y1

# Ops that fail because of a graphprune bug: op id -> reason naming the bug.
KNOWN_BUGS: dict[str, str] = {}  # op id -> reason, for ops expected to fail

SWEEP_OPS = [op for op in op_db if op.supports_autograd]


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# -- summary -------------------------------------------------------------------------

OUTCOMES: dict[str, tuple[str, str, int]] = {}  # op id -> (status, reason, samples passed)
SAMPLES_SKIPPED: collections.Counter[str] = collections.Counter()  # reason -> samples


def record_outcome(op, status: str, reason: str = "", samples_passed: int = 0) -> None:
    OUTCOMES[op_id(op)] = (status, reason, samples_passed)


def summary_lines() -> list[str]:
    by_status = collections.Counter(status for status, _, _ in OUTCOMES.values())
    skipped_by_reason = collections.defaultdict(list)
    for name, (status, reason, _) in sorted(OUTCOMES.items()):
        if status == "skipped":
            skipped_by_reason[reason].append(name)
    lines = [
        f"ops attempted: {len(OUTCOMES)}",
        f"ops passed: {by_status['passed']}",
        f"samples passed: {sum(n for _, _, n in OUTCOMES.values())}",
        f"ops skipped: {by_status['skipped']}",
        *(
            f"  {len(names):3d} x {reason}: {', '.join(names)}"
            for reason, names in sorted(skipped_by_reason.items(), key=lambda item: -len(item[1]))
        ),
        f"samples skipped: {sum(SAMPLES_SKIPPED.values())}",
        *(f"  {n:3d} x {reason}" for reason, n in SAMPLES_SKIPPED.most_common()),
        f"ops xfailed: {by_status['xfailed']}",
        f"ops failed: {by_status['failed']}",
    ]
    return lines


@pytest.fixture(scope="module", autouse=True)
def sweep_summary(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None or not OUTCOMES:
        return
    with capture.global_and_fixture_disabled():
        reporter.write("\n")
        reporter.write_sep("-", "graphprune op sweep")
        for line in summary_lines():
            reporter.write_line(line)


# -- the program under test ----------------------------------------------------------


class SkipSample(Exception):
    """The sample cannot take part in the sweep; the message says why."""


def head1(out: torch.Tensor) -> torch.Tensor:
    weights = torch.rand(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return (out.sin() * weights).sum()


def head2(out: torch.Tensor) -> torch.Tensor:
    return (out.cos() * out).sum()


def choose_dtype(op) -> torch.dtype | None:
    usable = op.supported_dtypes("cpu") & op.supported_backward_dtypes("cpu")
    return next((dtype for dtype in DTYPE_PREFERENCE if dtype in usable), None)


def first_samples(op, dtype) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sample generator's own (sparse beta, ...): not under test
        samples = op.sample_inputs("cpu", dtype, requires_grad=True)
        return list(itertools.islice(samples, SAMPLES_PER_OP))


def fresh_leaves(sample):
    """``(args, kwargs, leaves)``: the sample's tensors cloned into new leaves."""

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.requires_grad)

    cloned = pytree.tree_map_only(torch.Tensor, clone, (sample.input, sample.args, sample.kwargs))
    first, args, kwargs = cloned
    leaves = [t for t in pytree.tree_leaves(cloned) if isinstance(t, torch.Tensor) and t.requires_grad]
    return (first, *args), kwargs, leaves


def run_op(op, sample, args, kwargs) -> torch.Tensor:
    """The op's first differentiable output, as a real floating tensor.

    A complex output is seen through ``view_as_real``; the random number generator
    is seeded, so random ops (dropout, ...) draw the same in every run.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        result = sample.output_process_fn_grad(op(*args, **kwargs))
    outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs:
        raise SkipSample("no output requires grad")
    out = outputs[0]
    if out.grad_fn is None:
        raise SkipSample("output is a leaf (the op returned its input)")
    if out.layout != torch.strided:
        raise SkipSample(f"output layout is {out.layout}")
    if out.is_complex():
        out = torch.view_as_real(out.resolve_conj())
    if not out.is_floating_point():
        raise SkipSample(f"output dtype is {out.dtype}")
    return out


def grads_of(leaves) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in leaves]


@contextlib.contextmanager
def recorded_warnings():
    """Record the warnings raised inside, which pytest here would turn into errors."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def warning_keys(caught) -> set[tuple[type, str]]:
    return {(w.category, str(w.message)) for w in caught}


def reference_run(op, sample):
    """Plain PyTorch: ``(grads after head1, grads after both heads, warnings)``."""
    with recorded_warnings() as caught:
        args, kwargs, leaves = fresh_leaves(sample)
        try:
            out = run_op(op, sample, args, kwargs)
            head1(out).backward(retain_graph=True)
            after_head1 = grads_of(leaves)
            head2(out).backward()
        except SkipSample:
            raise
        except Exception as e:
            first_line = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
            raise SkipSample(f"plain PyTorch raises {type(e).__name__}: {first_line}") from e
    return after_head1, grads_of(leaves), warning_keys(caught)


# -- the mapping of saved tensors to nodes (DESIGN.md fact 4) ----------------------------


def graph_nodes(root):
    """Every node below ``root``, each once, walked with a stack."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def unpacked_saved_tensors(node) -> list[torch.Tensor]:
    """The tensors ``node`` saved, unpacked (through graphprune's unpack hook).

    Generated nodes expose them as ``_saved_*`` attributes, custom ``Function``
    nodes as ``saved_tensors``.
    """
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        values = [node.saved_tensors]
    else:
        values = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def may_be_wrapped_number(t: torch.Tensor) -> bool:
    """Whether ``t`` may be a Python scalar wrapped into a tensor (``x * 0.5``).

    PyTorch saves wrapped numbers without calling saved-tensor hooks
    (``saved_variable.cpp``), so no handle of graphprune holds them.
    """
    scalar_dtypes = (torch.float64, torch.int64, torch.complex128, torch.bool)
    return t.dim() == 0 and not t.requires_grad and t.dtype in scalar_dtypes


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.layout, a.shape, a.dtype) != (b.layout, b.shape, b.dtype):
        return False
    return a.layout != torch.strided or a.data_ptr() == b.data_ptr()  # sparse: no data pointer


@contextlib.contextmanager
def packs_into(packed: list):
    """Inside ``track()``: every handle graphprune's pack hook returns goes to ``packed``."""
    own = torch._C._autograd._top_saved_tensors_default_hooks(False)[0]

    def pack(t):
        handle = own(t)
        packed.append(weakref.ref(handle))
        return handle

    pack.__graphprune__ = True  # graphprune still sees its own hooks innermost
    with torch.autograd.graph.saved_tensors_hooks(pack, SavedHandle.unpack):
        yield


def assert_saved_tensors_map_to_nodes(root: torch.Tensor, packed: list) -> None:
    """Each node below ``root`` found exactly the handles of the tensors it saved, and
    every handle packed in the forward that is still alive (held by a live node) was
    found on a node of the graph."""
    found = set()
    for node in graph_nodes(root.grad_fn):
        handles = live_handles(node)
        found.update(id(h) for h in handles)
        if node_name(node) == "CopySlices":  # the hidden node's handles: nothing to unpack
            continue
        unmatched = list(handles)
        for t in unpacked_saved_tensors(node):
            match = next((h for h in unmatched if same_tensor(h.tensor, t)), None)
            if match is None:
                assert may_be_wrapped_number(t), f"a saved tensor of {node.name()} is not among its handles"
                continue
            unmatched.remove(match)
        assert not unmatched, f"{node.name()} claimed {len(unmatched)} handle(s) it does not save"
    lost = [h for h in (r() for r in packed) if h is not None and id(h) not in found]
    assert not lost, f"{len(lost)} handle(s) packed in the forward belong to no node of the graph"


# -- the sweep -------------------------------------------------------------------------


def assert_zero_pass_through_released_head(y1: torch.Tensor) -> None:
    """Only empty (so all-zero) gradients reach the released head: it runs as a zero
    pass (DESIGN.md fact 9). The trunk behind it was freed by y2's pass, so the only
    error allowed is PyTorch's own, raised where the trunk saved something."""
    try:
        y1.backward()
    except graphprune.ReleasedTensorError as err:
        raise AssertionError(f"a zero pass through a released head raised: {err}") from err
    except RuntimeError as err:
        assert "backward through the graph a second time" in str(err)


def check_sample(op, sample, head2_first: bool) -> None:
    """Raise :class:`SkipSample` or fail an assert unless the sample passes."""
    ref_after_head1, ref_after_both, ref_warnings = reference_run(op, sample)

    with recorded_warnings() as caught:
        args, kwargs, leaves = fresh_leaves(sample)
        packed = []
        with graphprune.track():
            with packs_into(packed):
                out = run_op(op, sample, args, kwargs)
                y1 = head1(out)
            y2 = head2(out) if head2_first else None
        assert_saved_tensors_map_to_nodes(y1, packed)
        y1.backward(retain_graph=True)
        torch.testing.assert_close(grads_of(leaves), ref_after_head1, equal_nan=True)

        report = graphprune.prune_after(y1, keep=None if head2_first else out)
        assert report.released_tensors >= 1, str(report)
        assert RELEASED_HEAD_NODE in report.released_nodes, str(report)

        if not head2_first:
            y2 = head2(out)
        y2.backward()
        torch.testing.assert_close(grads_of(leaves), ref_after_both, equal_nan=True)

        if out.numel() == 0:
            assert_zero_pass_through_released_head(y1)
        else:
            with pytest.raises(graphprune.ReleasedTensorError, match=f"saved tensor of {RELEASED_HEAD_NODE}"):
                y1.backward()
    assert warning_keys(caught) <= ref_warnings, "tracking raised warnings plain PyTorch does not"


def op_params():
    for op in SWEEP_OPS:
        marks = ()
        if op_id(op) in KNOWN_BUGS:
            marks = pytest.mark.xfail(reason=KNOWN_BUGS[op_id(op)], strict=True)
        yield pytest.param(op, id=op_id(op), marks=marks)


@pytest.mark.parametrize("op", list(op_params()))
def test_prune_after_matches_plain_pytorch(op):
    dtype = choose_dtype(op)
    if dtype is None:
        record_outcome(op, "skipped", "no CPU dtype with forward and backward support")
        pytest.skip("no CPU dtype with forward and backward support")
    passed, skip_reasons = 0, []
    try:
        for index, sample in enumerate(first_samples(op, dtype)):
            try:
                check_sample(op, sample, head2_first=index % 2 == 1)
            except SkipSample as why:
                skip_reasons.append(str(why))
                SAMPLES_SKIPPED[str(why)] += 1
            else:
                passed += 1
    except BaseException:
        record_outcome(op, "xfailed" if op_id(op) in KNOWN_BUGS else "failed")
        raise
    if not passed:
        reason = "; ".join(sorted(set(skip_reasons))) or "no samples"
        record_outcome(op, "skipped", reason)
        pytest.skip(reason)
    record_outcome(op, "passed", samples_passed=passed)


def test_sweep_covers_op_db():
    assert len(SWEEP_OPS) > 400
