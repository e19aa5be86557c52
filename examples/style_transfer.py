"""Neural style transfer with the PyTorch tutorial's ContentLoss and StyleLoss modules, under LBFGS.

Run: ``python examples/style_transfer.py``. The loss modules keep their ``.loss`` as an
attribute (the tutorial's design, tutorials/advanced_source/neural_style_tutorial.py);
a small VGG-like conv net with random weights stands in for VGG-19, so nothing is
downloaded. The closure backpropagates the style score and then the content score
(two passes, to weigh or log each objective's gradient); plain PyTorch needs
``retain_graph=True`` on the first, and the loss modules then keep the style branches
after the step. graphprune frees the style branches and the layers only they use
during the first pass, the rest during the second, with no ``keep=``. The script runs
one ``LBFGS.step`` in two fresh processes, one per strategy, checks that the optimised
image and its gradient are equal and prints RSS over the baseline in the middle of the
step (between the two passes of its last closure call) and at its end.
"""


import compare
import torch
from torch import nn
from torch.nn import functional as F

import graphprune as gp

PATTERN = "style_transfer"
SIZE, WIDTH = 256, 32


class ContentLoss(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.target = target.detach()

    def forward(self, input):
        self.loss = F.mse_loss(input, self.target)
        return input


def gram_matrix(input):
    a, b, c, d = input.size()
    features = input.view(a * b, c * d)
    G = torch.mm(features, features.t())
    return G.div(a * b * c * d)


class StyleLoss(nn.Module):
    def __init__(self, target_feature):
        super().__init__()
        self.target = gram_matrix(target_feature).detach()

    def forward(self, input):
        G = gram_matrix(input)
        self.loss = F.mse_loss(G, self.target)
        return input


def get_style_model_and_losses(cnn, style_img, content_img, content_layers=("conv_4",),
                               style_layers=("conv_1", "conv_2", "conv_3", "conv_4", "conv_5")):
    """The tutorial's function: the loss modules inserted after the named conv layers."""
    content_losses, style_losses = [], []
    model = nn.Sequential()
    i = 0
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = f"conv_{i}"
        elif isinstance(layer, nn.ReLU):
            name = f"relu_{i}"
            layer = nn.ReLU(inplace=False)
        else:
            name = f"pool_{i}"
        model.add_module(name, layer)
        if name in content_layers:
            content_loss = ContentLoss(model(content_img).detach())
            model.add_module(f"content_loss_{i}", content_loss)
            content_losses.append(content_loss)
        if name in style_layers:
            style_loss = StyleLoss(model(style_img).detach())
            model.add_module(f"style_loss_{i}", style_loss)
            style_losses.append(style_loss)
    return model, style_losses, content_losses


def step(model, optimizer, input_img, style_losses, content_losses, mode, probe=lambda phase: None):
    """One ``LBFGS.step``; ``mode`` is "plain", "graphprune" or "explicit" (the best keep= written out)."""
    reports = []

    def closure():
        with torch.no_grad():
            input_img.clamp_(0, 1)
        optimizer.zero_grad()
        with gp.track() if mode != "plain" else torch.enable_grad():
            model(input_img)
            style_score = 1e6 * sum(sl.loss for sl in style_losses)
            content_score = sum(cl.loss for cl in content_losses)
        if mode == "plain":
            style_score.backward(retain_graph=True)
        else:
            reports.append(gp.backward(style_score, keep=[content_score] if mode == "explicit" else None))
        probe("middle")
        if mode == "plain":
            content_score.backward()
        else:
            reports.append(gp.backward(content_score, keep=[] if mode == "explicit" else None))
        return style_score + content_score

    optimizer.step(closure)
    probe("end")  # the loss modules still hold their .loss
    return reports


def setup():
    cnn = nn.Sequential(
        nn.Conv2d(3, WIDTH, 3, padding=1), nn.ReLU(), nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(WIDTH, 2 * WIDTH, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * WIDTH, 2 * WIDTH, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * WIDTH, 4 * WIDTH, 3, padding=1), nn.ReLU(),
    ).requires_grad_(False)
    style_img, content_img = torch.rand(1, 3, SIZE, SIZE), torch.rand(1, 3, SIZE, SIZE)
    model, style_losses, content_losses = get_style_model_and_losses(cnn, style_img, content_img)
    input_img = content_img.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([input_img], max_iter=4, tolerance_grad=0, tolerance_change=0)
    return {"input_img": input_img}, lambda mode, probe=lambda phase: None: step(
        model, optimizer, input_img, style_losses, content_losses, mode, probe)


if __name__ == "__main__":
    compare.main(PATTERN, __file__, setup)
