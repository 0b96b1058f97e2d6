"""3x3 convolutions that -O3 runs by Winograd (runtime/kiln_winograd.c),
against torch, on every micro-kernel this CPU has (KILN_RT_ISA avx512,
avx2, generic) and with 2 threads.  The shapes cover both tile sizes (2
and 4), both product orientations (tiles as columns, and Winograd-T with
tiles as rows), partial tiles at the right and bottom edges, several
blocks of input channels, batches, a residual with its Relu, and the
planes too small to give every thread its own block of tiles, where the
input is transformed once into a V that the threads share (14 x 14 and
7 x 7, as in resnet50's last stages), and the products too few for the
threads (48 output channels on one block of tiles, DenseNet's 32 on 49
tiles: chunks under 32 channels, and Winograd-T blocks of fewer tile
panels).  Each output within 1e-4 of
torch's largest magnitude, and the product must really be Winograd: the
-O3 artifact's weights are the transformed ones (larger than at -O0).
"""

import numpy as np
import pytest
import torch

from engine_helpers import compile_kar, export, isas, run_kar, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "winograd")


class Conv3(torch.nn.Module):
    """A 3x3 convolution with its BatchNorm, the input added back when
    the channels match, and a Relu."""

    def __init__(self, c, m, residual):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, m, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(m)
        self.residual = residual and c == m

    def forward(self, x):
        y = self.bn(self.conv(x))
        return torch.relu(y + x if self.residual else y)


# n, c, m, h, w, residual
SHAPES = [
    (1, 80, 64, 14, 14, True),      # tile 4, one block of 16 tiles: shared V
    (1, 128, 80, 7, 7, False),      # tile 2, 16 tiles: shared V
    (1, 520, 40, 14, 14, False),    # two blocks of channels, shared V
    (2, 80, 48, 9, 11, False),      # partial tiles, a batch of two
    (1, 80, 96, 28, 28, True),      # 49 tiles of 4 x 4: Winograd-T
    (1, 32, 32, 56, 56, False),     # many blocks of tiles: no sharing
    (3, 128, 40, 6, 10, True),      # a batch, blocks of one image each
    (1, 128, 32, 28, 28, False),    # Winograd-T, one 32-channel panel: smaller blocks
    (1, 128, 48, 14, 14, False),    # one block of 16 tiles, 48 channels: chunks under 32
    # (32 output channels or fewer on one block, and few input channels
    # on a small plane, run direct: test_engine's
    # test_winograd_skips_few_output_channels and _input_channels)
]


def _weights_bytes(kar):
    import tarfile
    with tarfile.open(kar) as t:
        return t.getmember("weights.bin").size


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
def test_winograd_matches_torch(workdir, shape):
    n, c, m, h, w, residual = shape
    torch.manual_seed(c * 1000 + m + h)
    model = Conv3(c, m, residual).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    name = "w" + "x".join(map(str, shape[:5]))
    want, kgraph, xpath = export(workdir, name, model, torch.randn(n, c, h, w))
    scale = float(np.abs(want).max())
    assert scale > 0
    ref = compile_kar(workdir, kgraph, f"{name}.O0.kar", "--optlevel 0")
    kar = compile_kar(workdir, kgraph, f"{name}.O3.kar", "--optlevel 3")
    # transformed weights: 16/9 or 36/9 of the direct ones
    assert _weights_bytes(kar) > 1.5 * _weights_bytes(ref), "not run by Winograd"
    envs = [{"KILN_RT_ISA": isa} for isa in isas()]
    envs += [{"KILN_RT_THREADS": "2"}, {"KILN_RT_THREADS": "3"}]
    for env in envs:
        got, _ = run_kar(workdir, kar, xpath, f"{name}.{'.'.join(env.values())}", env)
        err = float(np.abs(got - want).max())
        assert err <= TOLERANCE * scale, f"{shape} {env}: error {err:.3g} of {scale:.3g}"
