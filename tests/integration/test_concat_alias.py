"""Concat with no copy: from -O1 the compiler lets the producers of a
Concat's inputs write straight into their range of its output (when the
output's dimensions before the axis are all 1), so that the Concat costs
nothing; otherwise it copies.  Each small model is exported with
torch.onnx.export (opset 14), compiled at --optlevel 0 (copies, the
reference) and 3, run alone and with 2 threads, and compared with torch
(within 1e-4 of the output's largest magnitude).  At -O3 the concat
kernel must be gone (KILN_RT_PROFILE names none) where the inputs can be
aliased, and still run where they cannot: a batch of 2, a graph input
among the inputs, one tensor wanted in two places, offsets that are not
64-byte aligned.
"""

import numpy as np
import pytest
import torch

from engine_helpers import (compile_kar, export, kernel_ops, run_kar, seeded_model,
                            signing_dir)

TOLERANCE = 1e-4


class Dense(torch.nn.Module):
    """densenet's block: each layer reads the concatenation of all the
    tensors before it (growing prefixes of one list) and the block ends
    with the concatenation of all; a transition after it."""

    def __init__(self, c=16, g=8, layers=4):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.layers = torch.nn.ModuleList()
        for i in range(layers):
            self.layers.append(torch.nn.Sequential(
                torch.nn.BatchNorm2d(c + i * g), torch.nn.ReLU(),
                torch.nn.Conv2d(c + i * g, g, 3, padding=1, bias=False)))
        self.trans = torch.nn.Conv2d(c + layers * g, 8, 1)

    def forward(self, x):
        feats = [self.stem(x)]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return self.trans(torch.relu(torch.cat(feats, 1)))


class SharedInput(torch.nn.Module):
    """A concat input that another op also reads, after the concat."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(4, 16, 1)
        self.b = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.c = torch.nn.Conv2d(32, 16, 1)

    def forward(self, x):
        a = torch.relu(self.a(x))
        b = self.b(x)
        y = self.c(torch.cat([a, b], 1))
        return y + a * 2


class TwoPlaces(torch.nn.Module):
    """One tensor in two concats at different offsets, and twice in one:
    only one of them can hold it in place."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(4, 16, 1)
        self.b = torch.nn.Conv2d(4, 16, 1)

    def forward(self, x):
        a, b = self.a(x), torch.sigmoid(self.b(x))
        p = torch.cat([a, b], 1)
        q = torch.cat([b, a], 1)
        r = torch.cat([a, a], 1)
        return p * 3 + q - r


class GraphInput(torch.nn.Module):
    """The graph input itself is a concat input."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(16, 16, 1)

    def forward(self, x):
        return torch.cat([x, self.a(x)], 1) * 2


class Axis(torch.nn.Module):
    """Concats along a later axis: [1, 1, 6, 16] along axis 2 has only 1s
    before it (in place), [1, 8, 6, 16] along 2 does not (copies); and one
    of 1-D vectors of 5 floats (20 bytes: unaligned, copies)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(5, 5)

    def forward(self, x):
        a, b = self.a(x), self.b(x)             # [1, 8, 6, 16]
        wide = torch.cat([a, b], 2)             # [1, 8, 12, 16]: copies
        s = torch.cat([a[:, :1] * 2, b[:, :1] + 1], 2)  # [1, 1, 12, 16]: in place
        v = torch.cat([self.c(x[0, 0, 0, :5]), self.c(x[0, 0, 1, :5])], 0)
        return wide.sum() + s.sum(1) + v.sum()


MODELS = {
    # name: (model, input shape, concat ops at -O0, concat ops left at -O3)
    "dense_block": (Dense, (1, 3, 12, 12), 5, 0),
    "dense_block_batch2": (Dense, (2, 3, 12, 12), 5, 5),
    "shared_input": (SharedInput, (1, 4, 8, 8), 1, 0),
    "two_places": (TwoPlaces, (1, 4, 8, 8), 3, 2),     # [a, b] in place only
    "graph_input": (GraphInput, (1, 16, 4, 4), 1, 1),
    "later_axis": (Axis, (1, 8, 6, 16), 3, 2),         # the [1, 1, 12, 16] one in place
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "concat")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_concat_in_place_matches_torch(workdir, name):
    make, shape, at_o0, at_o3 = MODELS[name]
    model = seeded_model(make)
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*shape))
    scale = float(np.abs(want).max())
    assert scale > 0
    for optlevel in (0, 3):
        kar = compile_kar(workdir, kgraph, f"{name}.O{optlevel}.kar", f"--optlevel {optlevel}")
        for env in ({}, {"KILN_RT_THREADS": "2"}):
            env = dict(env, KILN_RT_PROFILE="all")
            got, log = run_kar(workdir, kar, xpath, f"{name}.O{optlevel}.{len(env)}", env)
            err = float(np.abs(got - want).max())
            assert err <= TOLERANCE * scale, \
                f"{name} -O{optlevel} {env}: error {err:.3g} of {scale:.3g}"
            ops = kernel_ops(log)
            assert ops, log[:400]
            want_ops = at_o0 if optlevel == 0 else at_o3
            assert ops.get("concat", 0) == want_ops, \
                f"{name} -O{optlevel}: {ops.get('concat', 0)} concat ops, not {want_ops}"


def test_concat_in_place_across_pipeline_stages(workdir):
    """A pipelined dense block: a stage receives the concatenation buffer
    its inputs were written into by the stage before (the handoff)."""
    torch.manual_seed(1)
    want, kgraph, xpath = export(workdir, "piped", Dense(layers=6).eval(),
                                 torch.randn(1, 3, 12, 12))
    kar = compile_kar(workdir, kgraph, "piped.kar", "--optlevel 3 --pipeline-cores 2")
    got, log = run_kar(workdir, kar, xpath, "piped.out",
                       {"KILN_RT_NUM_CORES": "2", "KILN_RT_PROFILE": "all"})
    ops = kernel_ops(log)
    assert ops and "concat" not in ops, log[:400]
    assert float(np.abs(got - want).max()) <= TOLERANCE * float(np.abs(want).max())
