"""The activations the compiler fuses into a product's epilogue, against
torch: SiLU (Sigmoid, Mul), Sigmoid, HardSwish, HardSigmoid, Tanh and
the erf GELU after a Conv (direct, depthwise, Winograd) or a Linear, and
the squeeze-and-excitation block around them (global average pool, two
small convolutions, the gate's Mul), and a BatchNormalization that no
product absorbs taking the Relu or SiLU after it (densenet's layers).  Each small model is exported with
torch.onnx.export (opset 14), compiled at --optlevel 0 (op by op, the
reference) and 3, and run on every micro-kernel this CPU has
(KILN_RT_ISA avx512, avx2, generic) and with 2 threads; every output
must be within 1e-4 of torch's largest magnitude, and at -O3 the
activation must have gone into the product (KILN_RT_PROFILE names no
sigmoid, mul, erf or tanh kernel).
"""

import numpy as np
import pytest
import torch

from engine_helpers import (compile_kar, export, isas, kernel_ops, run_kar, seeded_model,
                            signing_dir)

TOLERANCE = 1e-4


class ConvAct(torch.nn.Module):
    def __init__(self, act, c=16, m=32, k=1, groups=1, bn=True):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, m, k, padding=k // 2, groups=groups, bias=not bn)
        self.bn = torch.nn.BatchNorm2d(m) if bn else torch.nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SqueezeExcite(torch.nn.Module):
    """efficientnet's block: expand (SiLU), depthwise 3x3 (SiLU), SE with
    SiLU and a Sigmoid gate, project."""

    def __init__(self, c=24, e=96):
        super().__init__()
        self.expand = ConvAct(torch.nn.SiLU(), c, e, 1)
        self.dw = ConvAct(torch.nn.SiLU(), e, e, 3, groups=e)
        self.fc1 = torch.nn.Conv2d(e, 8, 1)
        self.fc2 = torch.nn.Conv2d(8, e, 1)
        self.project = torch.nn.Conv2d(e, c, 1)

    def forward(self, x):
        y = self.dw(self.expand(x))
        s = torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(
            torch.nn.functional.adaptive_avg_pool2d(y, 1)))))
        return self.project(y * s) + x


class PreActivation(torch.nn.Module):
    """densenet's layer: BatchNorm -> Relu (or SiLU) -> Conv on a
    concatenation; the BatchNorm cannot fold into a product, so it takes
    the activation."""

    def __init__(self, c=16):
        super().__init__()
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv1 = torch.nn.Conv2d(c, c, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(2 * c)
        self.conv2 = torch.nn.Conv2d(2 * c, c, 3, padding=1, bias=False)

    def forward(self, x):
        y = self.conv1(torch.relu(self.bn1(x)))
        z = torch.cat([x, y], 1)
        return self.conv2(torch.nn.functional.silu(self.bn2(z)))


class LinearGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


MODELS = {
    "conv_silu": (lambda: ConvAct(torch.nn.SiLU()), (1, 16, 20, 20)),
    # (80 channels in: Winograd; from 16 the 3x3 runs direct)
    "conv_sigmoid": (lambda: ConvAct(torch.nn.Sigmoid(), c=80, k=3), (1, 80, 28, 28)),
    "conv_hardswish": (lambda: ConvAct(torch.nn.Hardswish(), k=3, bn=False), (1, 16, 14, 14)),
    "conv_hardsigmoid": (lambda: ConvAct(torch.nn.Hardsigmoid()), (1, 16, 7, 7)),
    "conv_tanh": (lambda: ConvAct(torch.nn.Tanh()), (1, 16, 9, 9)),
    "depthwise_silu": (lambda: ConvAct(torch.nn.SiLU(), 32, 32, 5, groups=32), (1, 32, 14, 14)),
    "squeeze_excite": (SqueezeExcite, (1, 24, 28, 28)),
    "linear_gelu": (LinearGelu, (1, 40, 64)),
    "preact_bn_relu": (PreActivation, (1, 16, 12, 12)),
}

FUSED_AWAY = ("sigmoid", "mul", "erf", "tanh", "hard_swish", "hard_sigmoid", "relu")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "fusion")


def _each_run(workdir, name, kgraph, xpath, want):
    """Compile at -O0 and -O3, run on every micro-kernel and at 2 threads
    with the profile on, each output within TOLERANCE of torch's largest
    magnitude; yield each run's optlevel and profile."""
    scale = float(np.abs(want).max())
    assert scale > 0
    for optlevel in (0, 3):
        kar = compile_kar(workdir, kgraph, f"{name}.O{optlevel}.kar", f"--optlevel {optlevel}")
        envs = [{"KILN_RT_ISA": isa} for isa in isas()] + [{"KILN_RT_THREADS": "2"}]
        for env in envs:
            env = dict(env, KILN_RT_PROFILE="all")
            got, log = run_kar(workdir, kar, xpath,
                               f"{name}.O{optlevel}.{'.'.join(env.values())}", env)
            err = float(np.abs(got - want).max())
            assert err <= TOLERANCE * scale, \
                f"{name} -O{optlevel} {env}: error {err:.3g} of {scale:.3g}"
            yield optlevel, log


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_activation_matches_torch(workdir, name):
    make, shape = MODELS[name]
    model = seeded_model(make)
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*shape) * 3)
    for optlevel, log in _each_run(workdir, name, kgraph, xpath, want):
        if optlevel == 3 and name != "squeeze_excite":
            left = set(kernel_ops(log)) & set(FUSED_AWAY)
            assert not left, f"{name}: {left} not fused ({log[:400]})"


class Transition(torch.nn.Module):
    """densenet's transition (BatchNorm, Relu, 1x1 Conv, 2x2 AveragePool):
    the pool can run first, on the Conv's input; beside it a 1x1 Conv + BN
    whose padded pool (count_include_pad) cannot, then a Relu."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(16)
        self.conv = torch.nn.Conv2d(16, 8, 1)
        self.conv2 = torch.nn.Conv2d(16, 8, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        a = torch.nn.functional.avg_pool2d(self.conv(torch.relu(self.bn(x))), 2)
        b = torch.nn.functional.avg_pool2d(self.bn2(self.conv2(x)), 3, 2, 1)
        return torch.relu(a + b)


def _op_shapes(log, kernel):
    """Output shapes of every `kernel` op in a KILN_RT_PROFILE=all report."""
    shapes = []
    for line in log.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[1] == kernel and "->" in parts:
            shapes.append(line.split("->")[1].strip())
    return sorted(shapes)


def test_average_pool_runs_before_a_pointwise_conv(workdir):
    """(The 2x2 stride-2 pool runs the runtime's path for windows wholly
    inside X, alone and on 2 threads; the padded one the general loop.)"""
    model = seeded_model(Transition)
    want, kgraph, xpath = export(workdir, "transition", model, torch.randn(1, 16, 12, 12))
    scale = float(np.abs(want).max())
    for optlevel, pools in ((0, ["[1, 8, 6, 6]", "[1, 8, 6, 6]"]),
                            (3, ["[1, 16, 6, 6]", "[1, 8, 6, 6]"])):
        kar = compile_kar(workdir, kgraph, f"transition.O{optlevel}.kar",
                          f"--optlevel {optlevel}")
        for threads in ("1", "2"):
            got, log = run_kar(workdir, kar, xpath, f"transition.O{optlevel}.{threads}",
                               {"KILN_RT_PROFILE": "all", "KILN_RT_THREADS": threads})
            assert float(np.abs(got - want).max()) <= TOLERANCE * scale
            assert _op_shapes(log, "avgpool2d") == sorted(pools), log


class PadPools(torch.nn.Module):
    """Average pools after Pads: torch exports count_include_pad (its
    default) as a Pad of zeros before an unpadded AveragePool, which -O2
    takes as the pool's own padding (`taken`: inception's 3x3 stride-1
    branch pools, and a stride-2 ceil_mode one whose last windows pass
    the padded plane); not a Pad of 0.5, nor one whose output something
    else reads too (`kept`)."""

    def __init__(self, taken):
        super().__init__()
        self.taken = taken

    def forward(self, x):
        f = torch.nn.functional
        if self.taken:
            return torch.cat([f.avg_pool2d(x, 3, 1, 1).flatten(1),
                              f.avg_pool2d(x, 3, 2, 1, ceil_mode=True).flatten(1)], 1)
        p = f.pad(x, (1, 1, 1, 1), value=0.5)
        q = f.pad(x, (1, 1, 1, 1))
        return (f.avg_pool2d(p, 3, 1) + f.avg_pool2d(q, 3, 1) + q[..., 1:-1, 1:-1]).flatten(1)


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "kept"])
def test_pad_before_average_pool_is_its_padding(workdir, taken):
    name = f"padpool{int(taken)}"
    want, kgraph, xpath = export(workdir, name, PadPools(taken).eval(), torch.randn(1, 24, 13, 13))
    for optlevel, log in _each_run(workdir, name, kgraph, xpath, want):
        pads = kernel_ops(log).get("pad", 0)
        assert pads == (2 if optlevel == 0 or not taken else 0), log
