"""Pre-activation blocks (DenseNet's BatchNormalization and Relu over the
concatenated features, a ResNet v2 block's) whose pointwise convolution
applies the normalisation and the Relu to its input as the matrix engine
packs it (compiler/kiln_cc_fuse.c's prologue, runtime/kiln_gemm_pack.c),
so that the normalised tensor is never written.  Against torch on every
micro-kernel this CPU has and with 2 and 3 threads, at -O2 and -O3, each
output within 1e-4 of torch's largest magnitude: planes read as the
columns of the product (15 x 15, a last panel of one column) and as its
rows (7 x 7 in panels of 7, 5 x 5 with a short last panel, 1 x 1, a single
row), 600 input channels over several k blocks, a batch of 2, a residual
and a bias on the same convolution.  Each case also counts, from the run's
profile, the BatchNormalizations left as ops of their own: those that must
stay (read twice, before a 3x3 convolution, before a pool that runs first)
and no others.
"""

import numpy as np
import pytest
import torch
from torch import nn

from engine_helpers import (compile_kar, export, kernel_ops, profiles_within, random_bn,
                            run_kar, signing_dir)

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "prologue")


def _bn(c):
    return random_bn(c, (-1.5, 1.5))    # negative scales too


class DenseLayer(nn.Module):
    """BN, Relu, 1x1 to 4 x growth, BN, Relu, 3x3 to growth; the input
    and the new features concatenated."""

    def __init__(self, c, growth):
        super().__init__()
        self.pre = nn.Sequential(_bn(c), nn.ReLU(), nn.Conv2d(c, 4 * growth, 1, bias=False))
        self.conv = nn.Sequential(_bn(4 * growth), nn.ReLU(),
                                  nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))

    def forward(self, x):
        return torch.cat([x, self.conv(self.pre(x))], 1)


class Dense(nn.Module):
    """Dense layers on one plane; when `second`, a transition (BN, Relu,
    1x1, 2x2 average pool: the pool runs first, so its BatchNormalization
    stays) and more layers on the pooled plane; then a head (its
    BatchNormalization stays: no convolution reads it)."""

    def __init__(self, c0, growth, first, second):
        super().__init__()
        layers, c = [], c0
        for _ in range(first):
            layers.append(DenseLayer(c, growth))
            c += growth
        if second:
            layers.append(nn.Sequential(_bn(c), nn.ReLU(), nn.Conv2d(c, c, 1, bias=False),
                                        nn.AvgPool2d(2)))
        for _ in range(second):
            layers.append(DenseLayer(c, growth))
            c += growth
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(_bn(c), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(c, 10))

    def forward(self, x):
        return self.head(self.body(x))


class PreAct(nn.Module):
    """ResNet v2's blocks, 1x1 all: x + conv(relu(bn(x))) with a bias (the
    residual is the BatchNormalization's own input), a BatchNormalization
    without a Relu before a 1x1 with a residual, and one whose Relu's
    output is read twice (it stays)."""

    def __init__(self, c):
        super().__init__()
        self.bn1, self.conv1 = _bn(c), nn.Conv2d(c, c, 1)
        self.bn2, self.conv2 = _bn(c), nn.Conv2d(c, c, 1, bias=False)
        self.bn3, self.conv3 = _bn(c), nn.Conv2d(c, 2 * c, 1)

    def forward(self, x):
        h = x + self.conv1(torch.relu(self.bn1(x)))
        h = h + self.conv2(self.bn2(h))
        t = torch.relu(self.bn3(h))
        return self.conv3(t) + t[:, :1]


# name: (model, input shape, BatchNormalizations left as ops of their own)
CASES = {
    # 15 x 15: columns, a last panel of one; 7 x 7 in panels of 7 rows
    "dense": (lambda: Dense(24, 32, 3, 3), (2, 24, 15, 15), 2),
    # 600 channels in, several k blocks, on 5 x 5 (a last panel of 4 rows)
    "deep": (lambda: Dense(600, 32, 1, 2), (1, 600, 10, 10), 2),
    # a plane of one position: a product of one row
    "point": (lambda: Dense(256, 32, 2, 0), (1, 256, 1, 1), 1),
    "preact": (lambda: PreAct(160), (1, 160, 7, 9), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prologue_matches_torch(workdir, name):
    make, xshape, left = CASES[name]
    torch.manual_seed(len(name))
    model = make().eval()
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*xshape))
    for stderr in profiles_within(workdir, name, kgraph, xpath, want, TOLERANCE):
        assert kernel_ops(stderr).get("batch_norm", 0) == left, stderr


def test_no_prologue_below_o2(workdir):
    """-O1 keeps every pre-activation BatchNormalization an op of its own
    (no packed weights to apply it in), with the same values."""
    torch.manual_seed(1)
    model = Dense(24, 32, 2, 0).eval()
    want, kgraph, xpath = export(workdir, "o1", model, torch.randn(1, 24, 9, 9))
    kar = compile_kar(workdir, kgraph, "o1.kar", "--optlevel 1")
    got, stderr = run_kar(workdir, kar, xpath, "o1.out", {"KILN_RT_PROFILE": "all"})
    assert float(np.abs(got - want).max()) <= TOLERANCE * float(np.abs(want).max())
    assert kernel_ops(stderr).get("batch_norm", 0) == 3, stderr
