"""Small real models for the integration tests and the demo, exported to
ONNX with Debian's python3-torch.  Random weights; nothing is downloaded.
"""

import numpy as np
import torch
import torch.nn as nn


class Foo(nn.Module):
    """The seeds' function example: foo(x, y) = 2 * x + y."""

    def forward(self, x, y):
        return 2 * x + y


class SeedConv(nn.Module):
    """The seeds' module example: a 3x3 Conv2d over a 1x1x3x3 input, plus 1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3)

    def forward(self, x):
        return self.conv(x) + 1


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


def export(model, inputs, path, names=None, opset=13):
    """Trace `model` on `inputs`, export ONNX to `path`, and return
    (input names, torch outputs as numpy) computed by eager torch."""
    model.eval()
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    names = names or [f"input{i}" for i in range(len(inputs))]
    with torch.no_grad():
        expected = model(*inputs)
        torch.onnx.export(model, inputs, str(path), input_names=names,
                          output_names=["output"], opset_version=opset)
    return names, expected.numpy()


def seed_models():
    """(name, module, example inputs) for the seeds' examples."""
    torch.manual_seed(0)
    return [
        ("foo", Foo(), (torch.rand(3), torch.rand(3))),
        ("seed_conv", SeedConv(), (torch.rand(1, 1, 3, 3),)),
    ]


def save_inputs(inputs, names, directory):
    """Write each input as NAME.npy; return ['NAME=path', ...] for kiln-run."""
    args = []
    for name, t in zip(names, inputs):
        p = directory / f"{name}.npy"
        np.save(p, t.numpy())
        args += ["--input", f"{name}={p}"]
    return args
