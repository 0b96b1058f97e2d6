"""3-D convolutions (issue 15, item 4): torchvision's r3d_18 (random
weights, BatchNorm statistics randomised, nothing downloaded) and a small
net of grouped, dilated, strided and 1x1x1 Conv3d layers with a folded
BatchNorm3d and a residual, traced whole with kiln.trace and compared with
torch at -O0 and -O3 (max |kiln - torch| <= 1e-4 of the output's largest
magnitude)."""

import pytest
import torch
import torchvision

import kiln
from test_torchvision import _randomize_batchnorm

TOL = 1e-4


def _close(got, want, what):
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert scale > 1e-3, f"{what}: degenerate reference (max |y| = {scale})"
    assert err <= TOL * scale, f"{what}: max abs error {err} at scale {scale}"


def _trace(net, x, opt):
    return kiln.trace(net, x, compiler_args=["--optlevel", str(opt)], fallback=False,
                      check_trace=False)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv3d(3, 8, (3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2),
                                 bias=False)
        self.bn = torch.nn.BatchNorm3d(8)
        self.b = torch.nn.Conv3d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.c = torch.nn.Conv3d(8, 6, 1, stride=2)
        self.d = torch.nn.Conv3d(6, 5, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = torch.relu(self.b(h) + h)
        return self.d(self.c(h))


@pytest.mark.parametrize("opt", [0, 3])
def test_conv3d_layers_match_torch(opt):
    torch.manual_seed(3)
    net = _randomize_batchnorm(_Net(), 3)
    x = torch.randn(2, 3, 5, 12, 10)
    traced = _trace(net, x, opt)
    for seed in range(2):
        torch.manual_seed(10 + seed)
        y = torch.randn_like(x)
        with torch.no_grad():
            want = net(y)
        _close(traced(y), want, f"-O{opt}, input {seed}")


def test_r3d_18_matches_torch():
    torch.manual_seed(0)
    model = _randomize_batchnorm(torchvision.models.video.r3d_18(), 0)
    clip = torch.rand(1, 3, 8, 56, 56)
    traced = kiln.trace(model, clip, fallback=False, check_trace=False)
    x = torch.rand(1, 3, 8, 56, 56)
    with torch.no_grad():
        want = model(x)
    got = traced(x)
    assert got.shape == want.shape == (1, 400)
    _close(got, want, "r3d_18")
    assert torch.equal(got.argmax(1), want.argmax(1))


class _Pools(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pools = torch.nn.ModuleList([
            torch.nn.MaxPool3d(3, stride=2, padding=1),
            torch.nn.MaxPool3d((2, 3, 3), stride=(1, 2, 2), dilation=(1, 2, 1), ceil_mode=True),
            torch.nn.AvgPool3d(3, stride=2, padding=1),                      # pads counted
            torch.nn.AvgPool3d((3, 2, 3), stride=2, padding=(1, 1, 0),
                               count_include_pad=False, ceil_mode=True),
        ])

    def forward(self, x):
        return tuple(p(x) for p in self.pools)


@pytest.mark.parametrize("opt", [0, 3])
def test_3d_pools_match_torch(opt):
    torch.manual_seed(5)
    net = _Pools().eval()
    x = torch.randn(2, 3, 5, 9, 8)
    traced = _trace(net, x, opt)
    y = torch.randn_like(x)
    for k, (g, w) in enumerate(zip(traced(y), net(y))):
        assert g.shape == w.shape, (k, g.shape, w.shape)
        _close(g, w, f"pool {k}, -O{opt}")


class _Transposed(torch.nn.Module):
    """ConvTranspose3d with stride, padding, output_padding, groups,
    dilation and bias, then one without bias; and a 1-D one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.ConvTranspose3d(4, 6, (3, 2, 3), stride=(2, 1, 2), padding=(1, 0, 1),
                                          output_padding=(1, 0, 1), groups=2,
                                          dilation=(1, 2, 1))
        self.b = torch.nn.ConvTranspose3d(6, 3, 2, stride=2, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("opt", [0, 3])
def test_conv_transpose3d_matches_torch(opt):
    torch.manual_seed(7)
    net = _Transposed().eval()
    x = torch.randn(2, 4, 3, 5, 4)
    traced = _trace(net, x, opt)
    y = torch.randn_like(x)
    with torch.no_grad():
        want = net(y)
    got = traced(y)
    assert got.shape == want.shape == (2, 3, 12, 14, 16)
    _close(got, want, f"ConvTranspose3d -O{opt}")


def test_conv_transpose1d_matches_torch():
    torch.manual_seed(8)
    net = torch.nn.ConvTranspose1d(4, 6, 3, stride=3, padding=1, output_padding=2,
                                   groups=2, dilation=2).eval()
    x = torch.randn(2, 4, 9)
    traced = kiln.trace(net, x, fallback=False, check_trace=False)
    with torch.no_grad():
        want = net(x)
    _close(traced(x), want, "ConvTranspose1d")
