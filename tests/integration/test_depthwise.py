"""Depthwise convolutions against torch on every micro-kernel this CPU has
(KILN_RT_ISA avx512, avx2, generic) and with 2 threads: widths around the
16-column vectors and 8-row blocks of the AVX-512 planes
(runtime/kiln_kernels_dwconv_avx512.c), strides 1 and 2, dilations, channel
multipliers, non-square kernels, fused activations and residuals, and the
shapes that stay on the portable loops; small planes, which AVX-512 runs
sixteen at a time, with a last group of fewer than sixteen, groups that
span two images of a batch, and planes of fewer than sixteen elements.  Each output within 1e-4 of
torch's largest magnitude.
"""

import numpy as np
import pytest
import torch

from engine_helpers import compile_kar, export, isas, run_kar, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "depthwise")


class Depthwise(torch.nn.Module):
    """A depthwise convolution (channel multiplier `mult`), its activation,
    and the input added back where the shapes allow (the residual the
    compiler fuses into the convolution's epilogue)."""

    def __init__(self, c, mult, k, stride, dilation, pad, act, residual):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c * mult, k, stride, pad, dilation, groups=c)
        self.act = act or torch.nn.Identity()
        self.residual = residual

    def forward(self, x):
        y = self.conv(x)
        return self.act(y + x) if self.residual else self.act(y)


# c, h, w, multiplier, kernel, stride, dilation, padding, activation, residual
# (and the batch, 1 unless given):
# widths around the 16-column vectors and the 8-row blocks of the AVX-512
# planes (runtime/kiln_kernels_dwconv_avx512.c), strides 1 and 2, dilations, a non-square
# kernel and the shapes that stay on the portable loops (dilated stride 1,
# a 4-wide kernel, a plane under 8 columns)
DEPTHWISE = [
    (8, 9, 8, 1, 3, 1, 1, 1, torch.nn.ReLU6(), False),
    (6, 17, 17, 1, 3, 1, 1, 1, None, True),
    (5, 33, 40, 2, 3, 1, 1, 1, torch.nn.Hardswish(), False),
    (7, 30, 31, 1, 5, 1, 1, 2, torch.nn.SiLU(), True),
    (4, 23, 57, 1, 7, 1, 1, 3, torch.nn.GELU(), False),
    (3, 12, 48, 1, (3, 5), 1, 1, (1, 2), None, False),
    (4, 20, 21, 1, 3, 1, 1, 0, torch.nn.ReLU(), False),
    (6, 35, 33, 1, 3, 2, 1, 1, torch.nn.ReLU(), False),
    (3, 20, 64, 1, 5, 2, 1, 2, None, False),
    (4, 16, 40, 1, 3, 2, 2, 2, torch.nn.Sigmoid(), False),
    (5, 19, 36, 1, 3, 1, 2, 2, torch.nn.ReLU(), False),
    (4, 18, 18, 1, 4, 1, 1, 1, None, False),
    (4, 6, 6, 1, 3, 1, 1, 1, None, True),
    # sixteen planes at a time: 40 planes over a batch of 2 (a group
    # spanning both images, a last group of 8), planes under 16 elements,
    # a channel multiplier with stride 2
    (20, 7, 7, 1, 3, 1, 1, 1, torch.nn.ReLU6(), True, 2),
    (18, 3, 4, 1, 3, 1, 1, 1, torch.nn.ReLU(), False),
    (6, 9, 10, 2, 3, 2, 1, 1, torch.nn.Hardswish(), False),
]


@pytest.mark.parametrize("case", range(len(DEPTHWISE)))
def test_depthwise_matches_torch_on_every_isa(workdir, case):
    c, h, w, mult, k, stride, dilation, pad, act, residual, *batch = DEPTHWISE[case]
    torch.manual_seed(case)
    model = Depthwise(c, mult, k, stride, dilation, pad, act, residual).eval()
    name = f"depthwise{case}"
    want, kgraph, xpath = export(workdir, name, model, torch.randn(batch[0] if batch else 1, c, h, w) * 2)
    kar = compile_kar(workdir, kgraph, f"{name}.kar", "--optlevel 3")
    scale = float(np.abs(want).max())
    for env in [{"KILN_RT_ISA": isa} for isa in isas()] + [{"KILN_RT_THREADS": "2"}]:
        got, _ = run_kar(workdir, kar, xpath, f"{name}.{'.'.join(env.values())}", env)
        assert got.shape == want.shape
        err = float(np.abs(got - want).max())
        assert err <= TOLERANCE * scale, f"{DEPTHWISE[case]} {env}: error {err:.3g} of {scale:.3g}"
