"""The seed question: retain the graph up to ``x``, free the branch ``x -> y1``."""

import torch

import graphprune as gp

w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
with gp.track() as tape:  # forward passes under graphprune's saved-tensor hooks
    x = w + 10
    x1 = x * x
    y1 = (x1 * x1).sum()
y1.backward(retain_graph=True)
# y2 is built on x after this call: keep x's graph (the seed's "retain_graph=x")
report = gp.prune_after(y1, keep=x)  # frees x -> x1 -> y1
print(report)

x2 = torch.sqrt(x)
y2 = (x2 / 2).sum()
y2.backward()  # works: x's graph was kept
print("w.grad =", w.grad.tolist())

try:
    y1.backward()
except gp.ReleasedTensorError as err:  # never a crash, never a wrong gradient
    print("as expected:", type(err).__name__)
print("nodes left:", sorted(d["op"] for _, d in tape.graph().nodes(data=True)))
