"""A 200k-node chain, an unrolled RNN's depth, survives tracking, pruning and teardown.

On torch 2.13 a walked chain of ~50k nodes segfaults at teardown (DESIGN.md fact 12);
the run happens in a subprocess so that a crash fails this test and nothing else.
"""

from _subprocess import run_script


def test_200k_node_chain_tracked_pruned_explained_and_dropped():
    out = run_script(
        """
import json, torch, graphprune as gp
w = torch.ones(3, requires_grad=True)
with gp.track() as tape:
    x = w * 1.0
    for _ in range(100_000):
        x = x * 1.0001
    trunk = x
    for _ in range(100_000):
        x = x.sin()
explained = gp.explain(x, keep=trunk)
graph = tape.graph()
x.sum().backward(retain_graph=True)
report = gp.prune_after(x, keep=trunk)
trunk.sum().backward()
del x, trunk
print(json.dumps(dict(explained=explained.released_node_count, pruned=report.released_node_count,
                      nodes=graph.number_of_nodes(), grad=w.grad.tolist())))
""",
        timeout=600,
    )
    assert out["explained"] == out["pruned"] == 100_000
    assert out["nodes"] == 200_002  # w * 1.0, 2 x 100k ops, AccumulateGrad
    assert out["grad"][0] > 0


def test_a_deep_trunk_with_its_walk_left_by_prunes_tears_down():
    """NOTE [ The trunk walked once ]: prunes with keep=trunk leave the trunk's walk
    (every wrapper below its root) and its measure on the root's metadata."""
    out = run_script(
        """
import json, torch, graphprune as gp
from graphprune import _trunk
w = torch.ones(3, requires_grad=True)
with gp.track():
    x = w * 1.0
    for _ in range(_trunk.LEAVE_AT_MOST - 8):
        x = x * 1.0001
    trunk = x
    heads = [(trunk * (i + 1)).sin().sum() for i in range(4)]
released = []
for loss in heads[:-1]:
    loss.backward(retain_graph=True)
    released.append(gp.prune_after(loss, keep=trunk).released_node_count)
left = _trunk._TRUNK in trunk.grad_fn.metadata
heads[-1].backward()
del x, trunk, heads, loss
print(json.dumps(dict(left=left, released=released, grad=w.grad.tolist())))
""",
        timeout=600,
    )
    assert out["left"]
    assert out["released"] == [1, 1, 1]  # each head's SinBackward0 (its sum and scalar mul save nothing)
    assert out["grad"][0] > 0


def test_deep_chain_through_scripted_functions_tears_down():
    # the recorder reads grad_fn of the scripted function's outputs, which it never saw made
    out = run_script(
        """
import json, torch, graphprune as gp

@torch.jit.script
def step(x):
    return x * 1.0001

w = torch.randn(4, requires_grad=True)
with gp.track():
    x = w * 1
    for _ in range(100_000):
        x = step(x)
        x = x + 0
    y = x.sum()
del x, y
print(json.dumps(dict(ok=True)))
""",
        timeout=600,
    )
    assert out["ok"]


def test_deep_chain_under_anomaly_mode_tears_down():
    # anomaly mode: the recorder reads grad_fn of each output to trim its own frame
    out = run_script(
        """
import json, torch, graphprune as gp
torch.autograd.set_detect_anomaly(True, check_nan=False)
w = torch.randn(4, requires_grad=True)
with gp.track():
    x = w * 1
    for _ in range(100_000):
        x = x * 1.0001
    y = x.sum()
del x, y
print(json.dumps(dict(ok=True)))
""",
        timeout=600,
    )
    assert out["ok"]
