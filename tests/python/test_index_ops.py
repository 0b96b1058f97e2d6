"""Ops whose indices are data (issue 15, item 4): ScatterND,
ScatterElements, GatherND and TopK, compiled from small ONNX graphs whose
indices are graph inputs (so the kernels read them at run time) and
compared with torch / numpy in the same test.  An index out of range is
an error of that run (naming the op and the index), and the model runs
again afterwards.
"""

import subprocess

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from conftest import BIN


def _compile(tmp_path, name, nodes, inputs, outputs, opset=16):
    g = helper.make_graph(nodes, name, inputs, outputs)
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    kar = tmp_path / f"{name}.kar"
    subprocess.run([f"{BIN}/kiln", "compile", "--local", str(path), "-o", str(kar)],
                   check=True, timeout=120, capture_output=True)
    return kiln.load(kar)


def _vi(name, dt, shape):
    return helper.make_tensor_value_info(name, dt, shape)


F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _scatter_nd_ref(data, idx, upd, red):
    out = data.copy()
    k = idx.shape[-1]
    for t, tup in enumerate(idx.reshape(-1, k)):
        sl = tuple(int(v) for v in tup)
        u = upd.reshape((-1,) + data.shape[k:])[t]
        if red == "none":
            out[sl] = u
        elif red == "add":
            out[sl] += u
        else:
            out[sl] *= u
    return out


@pytest.mark.parametrize("red", ["none", "add", "mul"])
def test_scatter_nd_matches_numpy_and_refuses_an_index_out_of_range(tmp_path, red):
    m = _compile(tmp_path, f"snd_{red}",
                 [helper.make_node("ScatterND", ["d", "i", "u"], ["y"], reduction=red)],
                 [_vi("d", F, [4, 5, 3]), _vi("i", I64, [2, 3, 2]), _vi("u", F, [2, 3, 3])],
                 [_vi("y", F, [4, 5, 3])])
    rng = np.random.default_rng(1)
    d = rng.standard_normal((4, 5, 3)).astype(np.float32)
    u = rng.standard_normal((2, 3, 3)).astype(np.float32)
    # distinct positions (none's result is then defined), some negative
    flat = rng.choice(20, 6, replace=False)
    idx = np.stack([flat // 5, flat % 5], -1).reshape(2, 3, 2).astype(np.int64)
    idx[0, 0] -= [4, 5]
    got = m(torch.from_numpy(d), torch.from_numpy(idx), torch.from_numpy(u))
    want = _scatter_nd_ref(d, np.where(idx < 0, idx + [4, 5], idx), u, red)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    for bad in ([4, 0], [0, -6]):
        b = idx.copy()
        b[1, 2] = bad
        with pytest.raises(kiln.KilnError, match=r"scatter_nd.*index -?\d+ .*outside"):
            m(torch.from_numpy(d), torch.from_numpy(b), torch.from_numpy(u))
    again = m(torch.from_numpy(d), torch.from_numpy(idx), torch.from_numpy(u))
    assert torch.equal(again, got)


@pytest.mark.filterwarnings("ignore:scatter_reduce")
@pytest.mark.parametrize("red", ["none", "add", "mul"])
def test_scatter_elements_matches_torch(tmp_path, red):
    m = _compile(tmp_path, f"se_{red}",
                 [helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=-2,
                                   reduction=red)],
                 [_vi("d", F, [3, 6, 4]), _vi("i", I64, [2, 3, 4]), _vi("u", F, [2, 3, 4])],
                 [_vi("y", F, [3, 6, 4])])
    torch.manual_seed(2)
    d, u = torch.randn(3, 6, 4), torch.randn(2, 3, 4)
    idx = torch.stack([torch.randperm(6)[:3] for _ in range(8)], -1).reshape(3, 2, 4)
    idx = idx.permute(1, 0, 2).contiguous()           # distinct along axis 1
    neg = idx.clone()
    neg[0, 1, 2] -= 6
    got = m(d, neg, u)
    if red == "none":
        want = d.scatter(1, idx, u)
    else:
        want = d.scatter_reduce(1, idx, u, "sum" if red == "add" else "prod")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    bad = idx.clone()
    bad[1, 2, 3] = 6
    with pytest.raises(kiln.KilnError, match=r"scatter_elements.*index 6 .*outside -6\.\.5"):
        m(d, bad, u)


def test_gather_nd_matches_numpy_and_refuses_an_index_out_of_range(tmp_path):
    m = _compile(tmp_path, "gnd",
                 [helper.make_node("GatherND", ["d", "i"], ["y"], batch_dims=1)],
                 [_vi("d", F, [2, 4, 5, 3]), _vi("i", I64, [2, 6, 2])],
                 [_vi("y", F, [2, 6, 3])])
    rng = np.random.default_rng(4)
    d = rng.standard_normal((2, 4, 5, 3)).astype(np.float32)
    idx = np.stack([rng.integers(-4, 4, (2, 6)), rng.integers(-5, 5, (2, 6))], -1)
    got = m(torch.from_numpy(d), torch.from_numpy(idx)).numpy()
    want = np.stack([d[b][idx[b, :, 0], idx[b, :, 1]] for b in range(2)])
    np.testing.assert_array_equal(got, want)
    idx[1, 5, 1] = 5
    with pytest.raises(kiln.KilnError, match=r"gather_nd.*index 5 .*outside -5\.\.4 of axis 2"):
        m(torch.from_numpy(d), torch.from_numpy(idx))


@pytest.mark.parametrize("op", ["Gather", "GatherElements"])
def test_gather_matches_numpy_and_refuses_an_index_out_of_range(tmp_path, op):
    """Gather and GatherElements with indices read at run time: numpy's
    answer, negative indices from the end, and an index past the axis an
    error of that run (as ONNX Runtime and torch refuse it), not zeros."""
    ishape = [2, 3] if op == "Gather" else [4, 3, 2]
    oshape = [4, 2, 3, 2] if op == "Gather" else [4, 3, 2]
    m = _compile(tmp_path, op.lower(), [helper.make_node(op, ["d", "i"], ["y"], axis=1)],
                 [_vi("d", F, [4, 5, 2]), _vi("i", I64, ishape)], [_vi("y", F, oshape)])
    rng = np.random.default_rng(6)
    d = rng.standard_normal((4, 5, 2)).astype(np.float32)
    idx = rng.integers(-5, 5, ishape)
    got = m(torch.from_numpy(d), torch.from_numpy(idx)).numpy()
    want = (np.take(d, idx, axis=1) if op == "Gather"
            else np.take_along_axis(d, np.where(idx < 0, idx + 5, idx), axis=1))
    np.testing.assert_array_equal(got, want)
    bad = idx.copy()
    bad.flat[3] = 5
    kernel = "gather" if op == "Gather" else "gather_elements"
    with pytest.raises(kiln.KilnError, match=kernel + r".*index 5 .*outside -5\.\.4"):
        m(torch.from_numpy(d), torch.from_numpy(bad))
    bad.flat[3] = -6
    with pytest.raises(kiln.KilnError, match=r"index -6 .*outside -5\.\.4"):
        m(torch.from_numpy(d), torch.from_numpy(bad))
    np.testing.assert_array_equal(m(torch.from_numpy(d), torch.from_numpy(idx)).numpy(), want)


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_matches_a_stable_sort_with_ties(tmp_path, largest):
    k = helper.make_tensor("k", I64, [1], [3])
    g = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1,
                                            largest=largest)],
                          "topk", [_vi("x", F, [2, 7, 3])],
                          [_vi("v", F, [2, 3, 3]), _vi("i", I64, [2, 3, 3])], initializer=[k])
    path = tmp_path / "topk.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), str(path))
    kar = tmp_path / "topk.kar"
    subprocess.run([f"{BIN}/kiln", "compile", "--local", str(path), "-o", str(kar)],
                   check=True, timeout=120, capture_output=True)
    m = kiln.load(kar)
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 3, (2, 7, 3)).astype(np.float32)     # many ties
    v, i = m(torch.from_numpy(x))
    # ONNX: equal values by lower index first
    order = np.argsort(-x if largest else x, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(i.numpy(), order)
    np.testing.assert_array_equal(v.numpy(), np.take_along_axis(x, order, 1))
    tv, _ = torch.topk(torch.from_numpy(x), 3, dim=1, largest=bool(largest))
    np.testing.assert_array_equal(v.numpy(), tv.numpy())


class _Sample(torch.nn.Module):
    def __init__(self, mode, pad, align):
        super().__init__()
        self.mode, self.pad, self.align = mode, pad, align

    def forward(self, x, grid):
        return torch.nn.functional.grid_sample(x, grid, mode=self.mode, padding_mode=self.pad,
                                               align_corners=self.align)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_matches_torch(mode, pad, align):
    torch.manual_seed(6)
    x = torch.randn(2, 3, 5, 7)
    # the grid reaches past -1..1, so the padding modes matter; bicubic
    # with border or reflection stays inside, where ONNX (kiln's
    # reference, from the conformance tests) and torch agree: ONNX clamps
    # or reflects a coordinate outside before taking the 4x4 taps, torch
    # only each tap
    reach = 1.0 if mode == "bicubic" and pad != "zeros" else 1.6
    grid = (torch.rand(2, 4, 6, 2) * 2 - 1) * reach
    traced = kiln.trace(_Sample(mode, pad, align).eval(), (x, grid), fallback=False,
                        check_trace=False)
    grid2 = (torch.rand(2, 4, 6, 2) * 2 - 1) * reach
    grid2[0, 0, 0] = torch.tensor([float("nan"), 0.3])
    got, want = traced(x, grid2), _Sample(mode, pad, align)(x, grid2)
    # a NaN coordinate reads no memory out of X (kiln takes it as -1:
    # zeros, or the border), where torch's answer depends on its code path
    assert torch.isfinite(got[0, :, 0, 0]).all()
    got[0, :, 0, 0] = want[0, :, 0, 0] = 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
