"""Products of one row against a packed weight, which AVX-512 runs as
row-times-panels (runtime/kiln_gemm.c, s_gemv): batch-1 classifiers
(Gemm and MatMul, with bias, a fused Relu or GELU, a residual), widths
that end inside a panel and inside a group of four panels, a long k,
and squeeze-and-excitation's 1x1 convolutions on a 1x1 plane (run
transposed).  Against torch on every micro-kernel this CPU has
(KILN_RT_ISA avx512, avx2, generic: the last two keep the tiles) and
with 2 and 3 threads; each output within 1e-4 of torch's largest
magnitude.
"""

import numpy as np
import pytest
import torch

from engine_helpers import compile_kar, export, isas, run_kar, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "gemv")


class Classifier(torch.nn.Module):
    def __init__(self, k, n, act, residual):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)
        self.act = act or torch.nn.Identity()
        self.residual = residual

    def forward(self, x):
        y = self.fc(torch.flatten(x, 1))
        return self.act(y + x if self.residual else y)


class MatVec(torch.nn.Module):
    """x @ W without a bias: a MatMul with a constant right operand."""

    def __init__(self, k, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x):
        return torch.relu(x @ self.w)


class SqueezeExcite(torch.nn.Module):
    def __init__(self, c, r):
        super().__init__()
        self.fc1 = torch.nn.Conv2d(c, r, 1)
        self.fc2 = torch.nn.Conv2d(r, c, 1)

    def forward(self, x):
        s = torch.nn.functional.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))


MODELS = {
    "fc_1000": (lambda: Classifier(1280, 1000, None, False), (1, 1280)),
    "fc_relu_33": (lambda: Classifier(300, 33, torch.nn.ReLU(), False), (1, 300)),
    "fc_gelu_130": (lambda: Classifier(64, 130, torch.nn.GELU(), False), (1, 64)),
    "fc_residual_200": (lambda: Classifier(200, 200, None, True), (1, 200)),
    "fc_7": (lambda: Classifier(3000, 7, None, False), (1, 3000)),
    "matvec_96": (lambda: MatVec(40, 96), (1, 40)),
    "squeeze_excite_960": (lambda: SqueezeExcite(960, 240), (1, 960, 5, 5)),
    "squeeze_excite_72": (lambda: SqueezeExcite(72, 24), (1, 72, 6, 6)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_row_products_match_torch(workdir, name):
    make, shape = MODELS[name]
    torch.manual_seed(len(name))
    model = make().eval()
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*shape))
    scale = float(np.abs(want).max())
    assert scale > 0
    kar = compile_kar(workdir, kgraph, f"{name}.kar", "--optlevel 3")
    envs = [{"KILN_RT_ISA": isa} for isa in isas()]
    envs += [{"KILN_RT_THREADS": "2"}, {"KILN_RT_THREADS": "3"}]
    for env in envs:
        got, _ = run_kar(workdir, kar, xpath, f"{name}.{'.'.join(env.values())}", env)
        assert got.shape == want.shape
        err = float(np.abs(got - want).max())
        assert err <= TOLERANCE * scale, f"{name} {env}: error {err:.3g} of {scale:.3g}"
