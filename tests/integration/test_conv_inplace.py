"""Transposed convolutions whose tiles read their positions from a padded
copy of the input, with no gather (runtime/kiln_kernels_conv.c, "read in
place"; common/kiln_pack.h's kiln_pack_conv_inplace), against torch, on
every micro-kernel this CPU has (KILN_RT_ISA avx512, avx2, generic: AVX-512
broadcasts from the copy, the others copy panels from it) and with 2 and
3 threads, at -O2 and -O3.  The shapes are ones the compiler runs
transposed (positions as rows: k of 512 or more, or 128 or more on 64
positions or fewer, and clearly less padding than as columns) on output
rows of 7 or 8 positions: DenseNet's 3x3 128 -> 32 at 14x14 and 7x7, two
column panels, the second partial (60 channels), a batch, stride 2 with rows of 8 (the
padded copy wider than the input), dilation 2, groups, a 5x5 kernel, a
1-D convolution, a residual with its Relu, and SiLU applied after the
tile.  Each output within 1e-4 of torch's largest magnitude.  (That the
compiler picks the transposed product for such shapes is
test_engine.c's test_transposed_conv_pays_for_its_gather.)
"""

import pytest
import torch

from engine_helpers import export, profiles_within, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "conv_inplace")


class Block(torch.nn.Module):
    """A convolution with its BatchNorm, the input added back when asked
    (same channels), then an activation."""

    def __init__(self, c, m, k, stride, dilation, groups, residual, act, dims=2):
        super().__init__()
        conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv1d
        bn = torch.nn.BatchNorm2d if dims == 2 else torch.nn.BatchNorm1d
        self.conv = conv(c, m, k, stride=stride, padding=dilation * (k // 2),
                         dilation=dilation, groups=groups, bias=False)
        self.bn = bn(m)
        self.residual = residual
        self.act = act

    def forward(self, x):
        y = self.bn(self.conv(x))
        if self.residual:
            y = y + x
        return torch.relu(y) if self.act == "relu" else torch.nn.functional.silu(y)


# name, n, c, m, spatial input size, kernel, stride, dilation, groups, residual, act
SHAPES = [
    ("densenet14", 1, 128, 32, (14, 14), 3, 1, 1, 1, False, "relu"),
    ("densenet7", 1, 128, 32, (7, 7), 3, 1, 1, 1, False, "relu"),
    ("panels2", 1, 128, 60, (7, 7), 3, 1, 1, 1, False, "relu"),
    ("batch2", 2, 64, 64, (7, 7), 3, 1, 1, 1, True, "relu"),
    ("stride2rows8", 1, 48, 64, (9, 15), 3, 2, 1, 1, False, "relu"),
    ("dilated", 1, 64, 64, (14, 14), 3, 1, 2, 1, False, "relu"),
    ("groups", 1, 64, 64, (7, 7), 3, 1, 1, 2, False, "relu"),
    ("kernel5", 1, 32, 64, (7, 7), 5, 1, 1, 1, False, "silu"),
    ("conv1d", 1, 64, 32, (56,), 3, 1, 1, 1, False, "silu"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_inplace_convolution_matches_torch(workdir, shape):
    name, n, c, m, size, k, stride, dilation, groups, residual, act = shape
    torch.manual_seed(len(name) * 100 + c + m)
    model = Block(c, m, k, stride, dilation, groups, residual, act, dims=len(size)).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    want, kgraph, xpath = export(workdir, name, model, torch.randn(n, c, *size))
    profiles_within(workdir, name, kgraph, xpath, want, TOLERANCE)
