"""Property test: random graphs with shared subgraphs, outputs backpropagated in turn.

Each output's pass runs through ``gp.backward`` with ``keep=None``: the other
outputs are alive, so exactly what only this output reaches may go. Gradients must
equal plain PyTorch's, and once every output has run, nothing saved is left.
"""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torch.testing import assert_close

import graphprune as gp

UNARY = [torch.sin, torch.tanh, torch.exp, torch.sigmoid, lambda t: t * t, lambda t: t.softmax(-1)]
BINARY = [torch.mul, torch.add, lambda a, b: a @ b.T @ a]


@st.composite
def programs(draw):
    """A list of steps ``(op, operand indices)`` and the indices of the outputs."""
    steps = []
    for i in range(draw(st.integers(2, 12))):
        available = i + 1  # the input is tensor 0
        if draw(st.booleans()):
            steps.append(("u", draw(st.integers(0, len(UNARY) - 1)), (draw(st.integers(0, available - 1)),)))
        else:
            pair = tuple(draw(st.integers(0, available - 1)) for _ in range(2))
            steps.append(("b", draw(st.integers(0, len(BINARY) - 1)), pair))
    total = len(steps) + 1
    outputs = draw(st.lists(st.integers(1, total - 1), min_size=1, max_size=4, unique=True))
    return steps, outputs


def run(program, w):
    steps, outputs = program
    values = [w * 0.5]
    for kind, op, args in steps:
        fn = UNARY[op] if kind == "u" else BINARY[op]
        values.append(fn(*(values[a] for a in args)))
    return [values[i].sum() for i in outputs]


@settings(max_examples=60, deadline=None)
@given(programs())
def test_each_output_in_turn_matches_plain_pytorch(program):
    torch.manual_seed(0)
    w0 = torch.randn(3, 3, dtype=torch.float64) * 0.3
    w = w0.clone().requires_grad_()
    expected = []
    for out in (outs := run(program, w)):
        (g,) = torch.autograd.grad(out, w, retain_graph=True)
        expected.append(g)
    del outs

    w = w0.clone().requires_grad_()
    with gp.track() as tape:
        outs = run(program, w)
    for out, want in zip(outs, expected):
        (got,) = gp.grad(out, w)
        assert_close(got, want)
    left = [d["saved_tensors"] for _, d in tape.graph().nodes(data=True)]
    assert sum(left) == 0, "every saved tensor should be gone once each output has run"
