"""Mobile-network blocks that -O2 and -O3 keep channels-last
(compiler/kiln_cc_layout.c): 1x1 expansions, depthwise convolutions from and
to [N, H, W, C] (runtime/kiln_kernels_dwconv.c), squeeze-and-excitation
(global average pool of a channels-last tensor, a per-channel Mul; over
more than 256 positions summed block by block, as the heads of "wide"
and "stem" are, a partial last block and a batch in the latter), 1x1
projections with the block's input added back (to 16 channels, half an
AVX-512 column panel, over several k blocks), and the edges where a
channels-last region meets an op that takes only [N, C, H, W] (a max pool, a
3x3 convolution, a graph output), and the first convolution from the
image's 3 channels to channels-last (direct loops).  Against torch on every micro-kernel this
CPU has and with 2 and 3 threads, each output within 1e-4 of torch's largest
magnitude; channel counts with tails under 16 and under 8, planes from 1x1 to
130 wide, strides 1 and 2, dilation, kernels 3, 5 and 7, batches of 2.  Each
case also checks, from the run's profile, that the depthwise convolutions
really wrote channels-last tensors.
"""

import pytest
import torch
from torch import nn

from engine_helpers import export, kernel_ops, profiles_within, random_bn, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "channels_last")


class Block(nn.Module):
    """Inverted residual: 1x1 expansion, depthwise k x k, optional
    squeeze-and-excitation, 1x1 projection, the input added back when the
    shapes allow."""

    def __init__(self, cin, cexp, cout, k, stride, dilation, act, se):
        super().__init__()
        pad = dilation * (k - 1) // 2
        self.expand = nn.Sequential(nn.Conv2d(cin, cexp, 1, bias=False), random_bn(cexp), act())
        self.dw = nn.Sequential(nn.Conv2d(cexp, cexp, k, stride, pad, dilation,
                                          groups=cexp, bias=False), random_bn(cexp), act())
        self.se = None
        if se:
            sq = max(cexp // 4, 2)
            gate = nn.Sigmoid() if se == "sigmoid" else nn.Hardsigmoid()
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cexp, sq, 1),
                                    nn.ReLU(), nn.Conv2d(sq, cexp, 1), gate)
        self.project = nn.Sequential(nn.Conv2d(cexp, cout, 1, bias=False), random_bn(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = self.dw(self.expand(x))
        if self.se is not None:
            h = h * self.se(h)
        h = self.project(h)
        return h + x if self.residual else h


class Net(nn.Module):
    """A stem (3x3 stride 2), blocks, then a head (1x1, pool, linear) or
    the last block's feature map as the output; `mid` puts an op that takes
    only [N, C, H, W] between two blocks."""

    def __init__(self, c0, blocks, act, head, mid=None):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 3, 2, 1, bias=False), random_bn(c0), act())
        self.blocks = nn.ModuleList(Block(*b) for b in blocks)
        self.mid = mid
        last = blocks[-1][2]
        self.head = None
        if head:
            self.head = nn.Sequential(nn.Conv2d(last, head, 1), act(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(head, 10))

    def forward(self, x):
        h = self.stem(x)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i == 0 and self.mid is not None:
                h = self.mid(h)
        return self.head(h) if self.head is not None else h


R6, HS, SI = nn.ReLU6, nn.Hardswish, nn.SiLU

# name: (input shape, stem channels, blocks (cin, cexp, cout, k, stride,
# dilation, act, se), act, head channels or None, mid op or None,
# depthwise output shapes [N, H, W, C] the profile must show)
CASES = {
    # mobilenet_v2 / v3-like, a batch of 2 over odd planes
    "mobile": ((2, 3, 37, 45), 16,
               [(16, 64, 24, 3, 2, 1, R6, None), (24, 72, 24, 3, 1, 1, R6, None),
                (24, 72, 40, 5, 2, 1, HS, "hardsigmoid"),
                (40, 120, 40, 5, 1, 1, HS, "hardsigmoid")],
               HS, 96, None, [(2, 10, 12, 64), (2, 10, 12, 72), (2, 5, 6, 120)]),
    # efficientnet-like: SiLU, sigmoid gates, 7x7, dilation 2, channel
    # counts with tails of 8 and under 8
    "efficient": ((1, 3, 64, 64), 13,
                  [(13, 200, 24, 3, 1, 1, SI, "sigmoid"),
                   (24, 184, 24, 7, 1, 1, SI, "sigmoid"),
                   (24, 40, 36, 3, 2, 2, SI, None), (36, 99, 36, 5, 1, 1, SI, "sigmoid")],
                  SI, 64, None, [(1, 32, 32, 200), (1, 32, 32, 184), (1, 16, 16, 99)]),
    # a feature map as the graph output, a max pool between the blocks
    "edges": ((1, 3, 40, 52), 8,
              [(8, 48, 16, 3, 1, 1, R6, None), (16, 48, 16, 3, 1, 1, R6, None),
               (16, 48, 16, 5, 1, 1, R6, "sigmoid")],
              R6, None, nn.MaxPool2d(2), [(1, 20, 26, 48), (1, 10, 13, 48)]),
    # planes down to 1x1, kernels wider than the plane
    "tiny": ((1, 3, 8, 8), 16,
             [(16, 32, 16, 3, 2, 1, R6, None), (16, 32, 24, 7, 2, 1, HS, "hardsigmoid"),
              (24, 48, 24, 5, 1, 1, HS, None)],
             HS, 32, None, [(1, 2, 2, 32), (1, 1, 1, 32), (1, 1, 1, 48)]),
    # 1x1 products of 16 channels (half a column panel) over several k
    # blocks (600 channels in), with the input added back
    "deep": ((1, 3, 20, 28), 16,
             [(16, 600, 16, 3, 1, 1, R6, "sigmoid"), (16, 300, 16, 5, 1, 1, HS, None)],
             R6, 32, None, [(1, 10, 14, 600), (1, 10, 14, 300), (1, 10, 14, 16)]),
    # 7 x 7 planes (49 positions: the products' rows in panels of seven
    # read in place), a 5x5 stride 2 into one, SiLU and hard-swish
    # epilogues, a head of 200 channels (a masked last column panel)
    "seven": ((1, 3, 28, 28), 16,
              [(16, 96, 40, 5, 2, 1, HS, "hardsigmoid"), (40, 120, 40, 3, 1, 1, SI, "sigmoid")],
              HS, 200, None, [(1, 7, 7, 96), (1, 7, 7, 120)]),
    # a stem of 40 channels: two weight panels, the second of 8
    "stem": ((2, 3, 33, 35), 40, [(40, 80, 40, 3, 1, 1, R6, None)], R6, 24, None,
             [(2, 17, 18, 80), (2, 17, 18, 40)]),
    # wide planes with few channels: eight-column blocks, 8-lane and
    # single-channel tails
    "wide": ((1, 3, 30, 260), 8,
             [(8, 12, 8, 3, 1, 1, R6, None), (8, 21, 8, 5, 1, 1, R6, None)],
             R6, 16, None, [(1, 15, 130, 12), (1, 15, 130, 21)]),
}


def _shape_in_profile(stderr, shape):
    want = "-> [" + ", ".join(map(str, shape)) + "]"
    return any(want in line for line in stderr.splitlines())


@pytest.mark.parametrize("name", sorted(CASES))
def test_channels_last_blocks_match_torch(workdir, name):
    xshape, c0, blocks, act, head, mid, dw_shapes = CASES[name]
    torch.manual_seed(len(name))
    model = Net(c0, blocks, act, head, mid).eval()
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*xshape))
    for stderr in profiles_within(workdir, name, kgraph, xpath, want, TOLERANCE):
        for s in dw_shapes:
            assert _shape_in_profile(stderr, s), f"{name}: no channels-last {s}"


class NextBlock(nn.Module):
    """convnext's block: depthwise 7x7, permute to [N, H, W, C], LayerNorm,
    Linear, GELU, Linear, a per-channel scale, permute back, the input
    added back."""

    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.up = nn.Linear(c, 4 * c)
        self.down = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.down(nn.functional.gelu(self.up(self.norm(h)))) * self.gamma
        return x + h.permute(0, 3, 1, 2)


class NextNet(nn.Module):
    """A patchify stem (4x4 stride 4) with a channels-last LayerNorm
    between permutes, two blocks, a downsampling 2x2 convolution after
    another such LayerNorm (its input must come back to [N, C, H, W]),
    a block, then global average pooling and a linear head."""

    def __init__(self, c):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, 4)
        self.ln0 = nn.LayerNorm(c, eps=1e-6)
        self.blocks = nn.ModuleList([NextBlock(c), NextBlock(c)])
        self.ln1 = nn.LayerNorm(c, eps=1e-6)
        self.down = nn.Conv2d(c, 2 * c, 2, 2)
        self.last = NextBlock(2 * c)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * c, 10)

    @staticmethod
    def _ln(ln, x):
        return ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward(self, x):
        h = self._ln(self.ln0, self.stem(x))
        for b in self.blocks:
            h = b(h)
        h = self.last(self.down(self._ln(self.ln1, h)))
        return self.head(self.pool(h).flatten(1))


def test_convnext_permutes_move_no_bytes(workdir):
    """The permutes around the stem's and each block's LayerNorm and
    Linear layers are views of channels-last tensors (no strided copy):
    only the one before the downsampling convolution, which takes
    [N, C, H, W], is left; the depthwise convolutions read and write
    channels-last."""
    torch.manual_seed(3)
    model = NextNet(24).eval()
    want, kgraph, xpath = export(workdir, "next", model, torch.randn(2, 3, 36, 44))
    for stderr in profiles_within(workdir, "next", kgraph, xpath, want, TOLERANCE):
        ops = kernel_ops(stderr)
        assert ops.get("strided", 0) == 1, ops
        for s in ((2, 9, 11, 24), (2, 4, 5, 48)):
            assert _shape_in_profile(stderr, s), f"no channels-last {s}"
