"""Convolutions whose product reads the input where it lies, with no
gather (runtime/kiln_kernels_conv.c), against torch, on every
micro-kernel this CPU has (KILN_RT_ISA avx512, avx2, generic: AVX-512
reads the copy where it lies, the others copy panels from it) and with 2
and 3 threads, at -O2 and -O3.  Each output within 1e-4 of torch's
largest magnitude.

Transposed ("read in place": positions as rows, from a zero-padded copy;
common/kiln_pack.h's kiln_pack_conv_inplace): shapes the compiler runs
transposed (k of 512 or more, or 128 or more on 64 positions or fewer,
and clearly less padding than as columns) on output rows of 7 or 8
positions: DenseNet's 3x3 128 -> 32 at 14x14 and 7x7, two column panels,
the second partial (60 channels), a batch, stride 2 with rows of 8 (the
padded copy wider than the input), dilation 2, groups, a 5x5 kernel, a
1-D convolution, a residual with its Relu, and SiLU applied after the
tile.  (That the compiler picks the transposed product for such shapes
is test_engine.c's test_transposed_conv_pays_for_its_gather.)

Untransposed ("phases": positions as columns, from the input split into
its stride's phases, 64 to 256 sums an output): RegNet's grouped 3x3
convolutions of 8 channels a group, at stride 1 and 2 (12 output
channels a group: a partial row panel), a 7x7 stride-2 stem, dilation
2, a grouped 5x5, and a batch of odd sizes whose tiles of 32 positions
cross output rows and end past the last; stride 2 from odd sizes and
from padding 2 over rows of 60, and stride 3.
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
    # untransposed, from the phases
    ("regnet", 1, 48, 48, (28, 28), 3, 1, 1, 6, True, "relu"),
    ("regnet_s2", 1, 32, 48, (56, 56), 3, 2, 1, 4, False, "relu"),
    ("stem7", 1, 3, 24, (64, 64), 7, 2, 1, 1, False, "relu"),
    ("dilated_phases", 1, 16, 16, (40, 40), 3, 1, 2, 1, False, "silu"),
    ("grouped5", 1, 16, 32, (40, 40), 5, 1, 1, 2, False, "relu"),
    ("odd_batch", 2, 12, 20, (23, 29), 3, 1, 1, 1, False, "relu"),
    # stride 2 from odd sizes (a 7-wide output, rows of 13 split into
    # phases of 8), padding 2 with rows of 60 (four blocks of 16 columns
    # a phase), stride 3 (the portable copy on every ISA)
    ("regnet_s2_odd", 1, 64, 64, (15, 13), 3, 2, 1, 4, False, "relu"),
    ("grouped5_s2", 1, 32, 32, (21, 60), 5, 2, 1, 4, False, "relu"),
    ("stride3", 1, 16, 16, (40, 40), 3, 3, 1, 2, False, "relu"),
    # a 7x7 output (a grid of 7 x 9: two tiles, as gathered), 4 groups
    # (copied apart, then computed, at 2 and 3 threads) and 25 (each
    # group's copy in its own task)
    ("regnet7", 1, 64, 64, (7, 7), 3, 1, 1, 4, True, "relu"),
    ("regnet7_g25", 1, 400, 400, (7, 7), 3, 1, 1, 25, False, "relu"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_convolution_read_in_place_matches_torch(workdir, shape):
    name, n, c, m, size, k, stride, dilation, groups, residual, act = shape
    torch.manual_seed(len(name) * 100 + c + m)
    model = Block(c, m, k, stride, dilation, groups, residual, act, dims=len(size)).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    want, kgraph, xpath = export(workdir, name, model, torch.randn(n, c, *size))
    profiles_within(workdir, name, kgraph, xpath, want, TOLERANCE)
