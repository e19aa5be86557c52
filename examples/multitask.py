"""Multi-task learning: one conv trunk, two heads, ``loss1`` then ``loss2``, one step.

Run: ``python examples/multitask.py``. It prints what each prune freed and checks
the gradients against plain ``retain_graph=True``.
"""

import copy

import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

torch.manual_seed(0)
trunk = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
seg_head = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 1, 1))
cls_head = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))
model = nn.ModuleDict(dict(trunk=trunk, seg=seg_head, cls=cls_head))
reference = copy.deepcopy(model)

images = torch.randn(16, 3, 64, 64)
masks = torch.rand(16, 1, 64, 64)
labels = torch.randint(0, 10, (16,))


def losses(m):
    feat = m["trunk"](images)
    seg_loss = F.binary_cross_entropy_with_logits(m["seg"](feat), masks)
    return feat, seg_loss, F.cross_entropy(m["cls"](feat), labels)


# Plain PyTorch: retain_graph=True keeps both heads' graphs until the end.
_, ref1, ref2 = losses(reference)
ref1.backward(retain_graph=True)
ref2.backward()

optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with gp.track():
    feat, loss1, loss2 = losses(model)
# No keep=: loss2, not backpropagated yet, keeps the trunk; feat, loss1 and loss2 stay
# alive in locals, as for logging, and pin nothing.
first = gp.backward(loss1)  # the seg head is freed during its own pass
print(first)
second = gp.backward(loss2)  # the classification head and the trunk, during this pass
print(second)
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad)
optimizer.step()
freed = first.bytes_freed + second.bytes_freed
print(f"bytes freed: {freed / 2**20:.1f} MiB (seg head {first.bytes_freed / 2**20:.1f} MiB); "
      "gradients equal plain retain_graph=True")
