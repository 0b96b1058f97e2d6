"""Shape, data-movement and window ops, and compile-time folding, end to
end: a small ONNX model built with onnx.helper (or exported from torch)
-> `kiln compile --local` -> `kiln-run`, compared with numpy or torch
computed here.

Each case is one model; the ONNX reference formulas (Resize's coordinate
mappings, DepthToSpace's channel orders, ConvTranspose's pads) are
written out in numpy so that a wrong kernel cannot agree with itself.
"""

import math
import os
import subprocess

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from conftest import kiln_bin, run
from engine_helpers import isas

RNG = np.random.default_rng(7)

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _i64(v):
    return np.array(v, dtype=np.int64)


# --- the pipeline -------------------------------------------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private KILN_CONFIG_DIR: the local key is made once per module, and
    its directory is the keyring kiln-run checks against."""
    cfg = tmp_path_factory.mktemp("config")
    e = dict(os.environ, KILN_CONFIG_DIR=str(cfg))
    e.pop("KILN_BROKER", None)
    return e, cfg / "keys"


def _model(nodes, feeds, outputs, inits=None, opset=14):
    """An ONNX model whose graph inputs are `feeds` (name -> array) and
    whose initializers are `inits` (name -> array)."""
    inputs = [helper.make_tensor_value_info(n, NP_TO_ONNX[a.dtype], list(a.shape))
              for n, a in feeds.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    init = [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()]
    graph = helper.make_graph(nodes, "case", inputs, outs, initializer=init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _compile(model, tmp_path, env_keys, name="m", optlevel=2):
    e, _ = env_keys
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    kar = tmp_path / f"{name}.kar"
    proc = run(["kiln", "compile", path, "-o", kar, "--local", "--compiler-args",
                f"--optlevel {optlevel}"], env=e)
    return proc, kar


def _kiln(model, feeds, outputs, tmp_path, env_keys, optlevel=2):
    """Compile and run `model` on `feeds`; return the outputs by name."""
    proc, kar = _compile(model, tmp_path, env_keys, optlevel=optlevel)
    assert proc.returncode == 0, proc.stderr
    e, ring = env_keys
    args = []
    for n, a in feeds.items():
        np.save(tmp_path / f"{n}.npy", a)
        args += ["--input", f"{n}={tmp_path / (n + '.npy')}"]
    out = tmp_path / "out"
    proc = run(["kiln-run", kar, "--keyring", ring, *args, "--output-dir", out], env=e)
    assert proc.returncode == 0, proc.stderr
    return {n: np.load(out / f"{n}.npy") for n in outputs}


def _check(nodes, feeds, expected, tmp_path, env_keys, inits=None, opset=14, tol=1e-5,
           optlevel=2):
    got = _kiln(_model(nodes, feeds, list(expected), inits, opset), feeds, list(expected),
                tmp_path, env_keys, optlevel)
    for n, want in expected.items():
        want = np.asarray(want)
        assert got[n].shape == want.shape, (n, got[n].shape, want.shape)
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got[n], want, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(got[n], want)


# --- reshaping and data movement ----------------------------------------------

X234 = _rand(2, 3, 4)


def _case_transpose():
    return ([helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1])],
            {"x": X234}, {"y": X234.transpose(2, 0, 1)}, None, 14)


def _case_transpose_default():
    return ([helper.make_node("Transpose", ["x"], ["y"])],
            {"x": X234}, {"y": X234.transpose()}, None, 14)


X_HEADS = np.random.default_rng(3).standard_normal((20, 3, 12)).astype(np.float32)


def _case_transpose_blocked():
    # An attention head split's [tokens, heads, d] -> [heads, d, tokens]:
    # the axis read contiguously is not the last, so the copy runs as
    # blocked 8 x 8 transposes (with partial blocks: 12 and 20).
    return ([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 2, 0])],
            {"x": X_HEADS}, {"y": X_HEADS.transpose(1, 2, 0)}, None, 14)


def _case_squeeze_unsqueeze_attr():
    x = _rand(1, 3, 1, 4)
    return ([helper.make_node("Squeeze", ["x"], ["s"], axes=[0, -2]),
             helper.make_node("Unsqueeze", ["s"], ["y"], axes=[1, -1])],
            {"x": x}, {"y": x.reshape(3, 1, 4, 1)}, None, 11)


def _case_squeeze_unsqueeze_input():
    x = _rand(1, 3, 1, 4)
    return ([helper.make_node("Squeeze", ["x"], ["s"]),
             helper.make_node("Unsqueeze", ["s", "ax"], ["y"])],
            {"x": x}, {"y": x.reshape(1, 3, 4, 1)}, {"ax": _i64([0, 3])}, 13)


def _case_flatten():
    x = _rand(2, 3, 4, 5)
    return ([helper.make_node("Flatten", ["x"], ["y"], axis=-2)],
            {"x": x}, {"y": x.reshape(6, 20)}, None, 14)


def _case_concat():
    a, b, c = _rand(2, 1, 4), _rand(2, 3, 4), _rand(2, 2, 4)
    return ([helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=-2)],
            {"a": a, "b": b, "c": c}, {"y": np.concatenate([a, b, c], 1)}, None, 14)


def _case_concat_many():
    # More inputs than one kernel call takes (8): chained calls.
    xs = {f"x{i}": _rand(2, i + 1) for i in range(11)}
    return ([helper.make_node("Concat", list(xs), ["y"], axis=1)],
            xs, {"y": np.concatenate(list(xs.values()), 1)}, None, 14)


def _case_split_attr():
    x = _rand(7, 4)
    return ([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=0, split=[2, 4, 1])],
            {"x": x}, {"a": x[:2], "b": x[2:6], "c": x[6:]}, None, 11)


def _case_split_input():
    x = _rand(3, 6)
    return ([helper.make_node("Split", ["x", "sp"], ["a", "b"], axis=-1)],
            {"x": x}, {"a": x[:, :1], "b": x[:, 1:]}, {"sp": _i64([1, 5])}, 13)


def _case_split_equal():
    x = _rand(2, 6, 2)
    return ([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1)],
            {"x": x}, {"a": x[:, 0:2], "b": x[:, 2:4], "c": x[:, 4:6]}, None, 13)


def _case_split_num_outputs():
    x = _rand(7, 2)
    return ([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=0, num_outputs=3)],
            {"x": x}, {"a": x[0:3], "b": x[3:6], "c": x[6:7]}, None, 18)


def _case_slice():
    x = _rand(5, 6, 7)
    big = np.iinfo(np.int64).max
    return ([helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])],
            {"x": x}, {"y": x[-4:big, ::-2, 1:-1:3]},
            {"st": _i64([-4, -1, 1]), "en": _i64([big, -big, -1]), "ax": _i64([0, 1, 2]),
             "sp": _i64([1, -2, 3])}, 13)


def _case_slice_clamped():
    x = _rand(4, 5)
    return ([helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"])],
            {"x": x}, {"y": x[:, 2:100]}, {"st": _i64([2]), "en": _i64([100]), "ax": _i64([-1])},
            13)


def _case_slice_attr():
    x = _rand(4, 5)
    return ([helper.make_node("Slice", ["x"], ["y"], starts=[1, -3], ends=[3, 10], axes=[0, 1])],
            {"x": x}, {"y": x[1:3, -3:10]}, None, 9)


def _case_gather_negative():
    x = _rand(3, 5, 2)
    idx = np.array([[0, -1], [2, -5]], dtype=np.int64)
    return ([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)],
            {"x": x, "i": idx}, {"y": np.take(x, idx, axis=1)}, None, 13)


def _case_gather_embedding():
    w = _rand(10, 4)
    idx = np.array([[1, 9, 0], [3, 3, 7]], dtype=np.int32)
    return ([helper.make_node("Gather", ["w", "i"], ["y"], axis=0)],
            {"i": idx}, {"y": w[idx]}, {"w": w}, 13)


def _case_pad_constant():
    x = _rand(2, 3)
    return ([helper.make_node("Pad", ["x", "p", "v"], ["y"], mode="constant")],
            {"x": x}, {"y": np.pad(x, ((1, 0), (2, 3)), constant_values=1.5)},
            {"p": _i64([1, 2, 0, 3]), "v": np.array(1.5, dtype=np.float32)}, 13)


def _case_pad_reflect():
    x = _rand(1, 2, 4, 5)
    return ([helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")],
            {"x": x}, {"y": np.pad(x, ((0, 0), (0, 0), (3, 2), (1, 4)), mode="reflect")},
            {"p": _i64([0, 0, 3, 1, 0, 0, 2, 4])}, 13)


def _case_pad_edge_negative():
    x = _rand(4, 5)
    want = np.pad(x, ((2, 0), (0, 1)), mode="edge")[:, 1:]
    return ([helper.make_node("Pad", ["x", "p"], ["y"], mode="edge")],
            {"x": x}, {"y": want}, {"p": _i64([2, -1, 0, 1])}, 13)


def _case_pad_attr():
    x = _rand(2, 2)
    return ([helper.make_node("Pad", ["x"], ["y"], pads=[0, 1, 1, 0], value=-2.0)],
            {"x": x}, {"y": np.pad(x, ((0, 1), (1, 0)), constant_values=-2.0)}, None, 10)


def _case_tile():
    x = _rand(2, 3)
    return ([helper.make_node("Tile", ["x", "r"], ["y"])],
            {"x": x}, {"y": np.tile(x, (3, 2))}, {"r": _i64([3, 2])}, 13)


def _case_expand():
    x = _rand(3, 1)
    return ([helper.make_node("Expand", ["x", "s"], ["y"])],
            {"x": x}, {"y": np.broadcast_to(x, (2, 3, 4))}, {"s": _i64([2, 1, 4])}, 13)


def _case_expand_int():
    x = np.arange(3, dtype=np.int64).reshape(3, 1)
    return ([helper.make_node("Expand", ["x", "s"], ["y"])],
            {"x": x}, {"y": np.broadcast_to(x, (3, 5))}, {"s": _i64([3, 5])}, 13)


def _d2s_reference(x, b, mode):
    n, c, h, w = x.shape
    if mode == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(n, c // (b * b), h * b, w * b)


def _case_depth_to_space_dcr():
    x = _rand(2, 8, 3, 2)
    return ([helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2)],
            {"x": x}, {"y": _d2s_reference(x, 2, "DCR")}, None, 13)


def _case_depth_to_space_crd():
    x = _rand(1, 18, 2, 2)
    return ([helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=3, mode="CRD")],
            {"x": x}, {"y": _d2s_reference(x, 3, "CRD")}, None, 13)


def _case_space_to_depth():
    x = _rand(2, 3, 4, 6)
    n, c, h, w = x.shape
    want = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 3, 5, 1, 2, 4)
    return ([helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)],
            {"x": x}, {"y": want.reshape(n, c * 4, h // 2, w // 2)}, None, 13)


# --- Einsum and MatMul ---------------------------------------------------------

def _einsum_case(eq, *shapes):
    def make():
        names = ["a", "b"][:len(shapes)]
        feeds = {n: _rand(*s) for n, s in zip(names, shapes)}
        want = np.einsum(eq, *feeds.values())
        return ([helper.make_node("Einsum", names, ["y"], equation=eq)], feeds, {"y": want},
                None, 12)
    return make


def _case_matmul_broadcast():
    a, b = _rand(2, 1, 3, 4), _rand(5, 4, 6)
    return ([helper.make_node("MatMul", ["a", "b"], ["y"])],
            {"a": a, "b": b}, {"y": np.matmul(a, b)}, None, 13)


def _case_matmul_vectors():
    a, b = _rand(4), _rand(3, 4, 2)
    return ([helper.make_node("MatMul", ["a", "b"], ["y"])],
            {"a": a, "b": b}, {"y": np.matmul(a, b)}, None, 13)


# --- Resize --------------------------------------------------------------------

def _resize_1d_coords(out_len, in_len, scale, coord):
    x = np.arange(out_len, dtype=np.float64)
    if coord == "asymmetric":
        return x / scale
    if coord == "align_corners":
        width = scale * in_len
        return np.zeros_like(x) if width == 1 else x * (in_len - 1) / (width - 1)
    if coord == "pytorch_half_pixel":
        return np.full_like(x, -0.5) if scale * in_len == 1 else (x + 0.5) / scale - 0.5
    return (x + 0.5) / scale - 0.5


def _resize_reference(x, out_shape, scales, mode, coord, nearest="round_prefer_floor"):
    """ONNX's Resize, one axis at a time (linear is separable; nearest
    picks one neighbour per axis); edge values beyond the border."""
    y = x.astype(np.float64)
    for axis, (n_out, s) in enumerate(zip(out_shape, scales)):
        n_in = y.shape[axis]
        xo = _resize_1d_coords(n_out, n_in, s, coord)
        lo = np.floor(xo)
        r = xo - lo
        lo = lo.astype(np.int64)
        if mode == "nearest":
            up = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5,
                  "floor": np.zeros_like(r, dtype=bool), "ceil": r > 0}[nearest]
            idx = np.clip(lo + up, 0, n_in - 1)
            y = np.take(y, idx, axis=axis)
        else:
            a = np.take(y, np.clip(lo, 0, n_in - 1), axis=axis)
            b = np.take(y, np.clip(lo + 1, 0, n_in - 1), axis=axis)
            shape = [1] * y.ndim
            shape[axis] = n_out
            r = r.reshape(shape)
            y = a * (1 - r) + b * r
    return y.astype(np.float32)


def _resize_case(in_shape, mode, coord, scales=None, sizes=None, nearest=None):
    def make():
        x = _rand(*in_shape)
        attrs = {"mode": mode, "coordinate_transformation_mode": coord}
        if nearest:
            attrs["nearest_mode"] = nearest
        inits = {"roi": np.zeros(0, dtype=np.float32)}
        if scales is not None:
            inits["sc"] = np.array(scales, dtype=np.float32)
            ins = ["x", "roi", "sc"]
            out = [int(np.floor(d * np.float32(s))) for d, s in zip(in_shape, inits["sc"])]
            sc = [float(s) for s in inits["sc"]]
        else:
            inits["sc"] = np.zeros(0, dtype=np.float32)
            inits["sz"] = _i64(sizes)
            ins = ["x", "roi", "sc", "sz"]
            out = list(sizes)
            sc = [o / i for o, i in zip(sizes, in_shape)]
        want = _resize_reference(x, out, sc, mode, coord, nearest or "round_prefer_floor")
        return ([helper.make_node("Resize", ins, ["y"], **attrs)], {"x": x}, {"y": want},
                inits, 13)
    return make


# --- windows -------------------------------------------------------------------

def _case_conv_groups_dilation_pads():
    x, w, b = _rand(2, 4, 9, 8), _rand(6, 2, 3, 2), _rand(6)
    want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                    stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2).numpy()
    return ([helper.make_node("Conv", ["x", "w", "b"], ["y"], group=2, dilations=[2, 1],
                              strides=[2, 1], pads=[1, 2, 1, 2])],
            {"x": x}, {"y": want}, {"w": w, "b": b}, 13)


def _case_conv_same_upper():
    x, w = _rand(1, 2, 7, 6), _rand(3, 2, 3, 4)
    # SAME_UPPER, stride 2: output ceil(in / 2); pads total (out-1)*2 + k - in,
    # the odd unit at the end.
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 2)))
    want = F.conv2d(torch.from_numpy(xp), torch.from_numpy(w), stride=2).numpy()
    return ([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])],
            {"x": x}, {"y": want}, {"w": w}, 13)


def _case_conv1d_same_lower():
    x, w = _rand(2, 3, 10), _rand(4, 3, 4)
    xp = np.pad(x, ((0, 0), (0, 0), (2, 1)))
    want = F.conv1d(torch.from_numpy(xp), torch.from_numpy(w)).numpy()
    return ([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_LOWER")],
            {"x": x}, {"y": want}, {"w": w}, 13)


def _convtr_reference(x, w, b, stride, pad_b, pad_e, dil, out_pad, groups):
    """Full transposed convolution with torch, then the ONNX pads cut off
    (they may be asymmetric, which torch's padding cannot say)."""
    full = F.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(w),
                              None if b is None else torch.from_numpy(b), stride=stride,
                              dilation=dil, groups=groups).numpy()
    h = full.shape[2] + out_pad[0]
    wd = full.shape[3] + out_pad[1]
    full = np.pad(full, ((0, 0), (0, 0), (0, out_pad[0]), (0, out_pad[1])))
    if b is not None:
        # output_padding rows/cols have only the bias
        full[:, :, full.shape[2] - out_pad[0]:, :] = b.reshape(1, -1, 1, 1)
        full[:, :, :, full.shape[3] - out_pad[1]:] = b.reshape(1, -1, 1, 1)
    return full[:, :, pad_b[0]:h - pad_e[0], pad_b[1]:wd - pad_e[1]]


def _case_conv_transpose_2d():
    x, w, b = _rand(2, 4, 5, 4), _rand(4, 3, 3, 2), _rand(6)
    want = _convtr_reference(x, w, b, (2, 3), (1, 0), (2, 1), (1, 2), (1, 2), 2)
    return ([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=2, strides=[2, 3],
                              pads=[1, 0, 2, 1], dilations=[1, 2], output_padding=[1, 2])],
            {"x": x}, {"y": want}, {"w": w, "b": b}, 13)


def _case_conv_transpose_output_shape():
    x, w = _rand(1, 2, 3, 3), _rand(2, 3, 3, 3)
    # output_shape [10, 8]: total padding s*(in-1) + k - out = 2*2 + 3 - 10 < 0 on H?
    # use stride 3: 3*2 + 3 = 9 -> out 8 leaves 1, the odd unit at the start (NOTSET).
    want = _convtr_reference(x, w, None, (3, 3), (1, 1), (0, 0), (1, 1), (0, 0), 1)
    return ([helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 3],
                              output_shape=[8, 8])],
            {"x": x}, {"y": want}, {"w": w}, 13)


def _case_conv_transpose_1d():
    x, w, b = _rand(2, 3, 6), _rand(3, 2, 4), _rand(2)
    want = F.conv_transpose1d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                              stride=2, padding=1, output_padding=1).numpy()
    return ([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2], pads=[1, 1],
                              output_padding=[1])],
            {"x": x}, {"y": want}, {"w": w, "b": b}, 13)


def _case_maxpool_1d():
    x = _rand(2, 3, 11)
    want = F.max_pool1d(torch.from_numpy(x), 3, stride=2, padding=1, ceil_mode=True).numpy()
    return ([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1],
                              ceil_mode=1)],
            {"x": x}, {"y": want}, None, 13)


def _case_avgpool_exclude_pad_ceil():
    x = _rand(2, 3, 7, 8)
    want = F.avg_pool2d(torch.from_numpy(x), (3, 2), stride=2, padding=1, ceil_mode=True,
                        count_include_pad=False).numpy()
    return ([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 2],
                              pads=[1, 1, 1, 1], ceil_mode=1)],
            {"x": x}, {"y": want}, None, 13)


def _case_avgpool_include_pad():
    x = _rand(1, 2, 6, 6)
    want = F.avg_pool2d(torch.from_numpy(x), 3, stride=1, padding=1,
                        count_include_pad=True).numpy()
    return ([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1], count_include_pad=1)],
            {"x": x}, {"y": want}, None, 13)


def _case_avgpool_1d_same():
    x = _rand(1, 2, 9)
    # SAME_UPPER, stride 2, kernel 4: out 5, pads 1 begin / 2 end; excluded.
    want = np.stack([x[..., max(0, 2 * i - 1):min(9, 2 * i + 3)].mean(-1) for i in range(5)], -1)
    return ([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[4], strides=[2],
                              auto_pad="SAME_UPPER")],
            {"x": x}, {"y": want}, None, 13)


def _case_global_pools():
    x = _rand(2, 3, 4, 5)
    return ([helper.make_node("GlobalMaxPool", ["x"], ["mx"]),
             helper.make_node("GlobalAveragePool", ["x"], ["av"])],
            {"x": x}, {"mx": x.max((2, 3), keepdims=True), "av": x.mean((2, 3), keepdims=True)},
            None, 13)


# --- folding -------------------------------------------------------------------

def _case_fold_reshape_from_shape():
    # The exporters' pattern: Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1, 4]))
    x = _rand(3, 2, 8)
    return ([helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
             helper.make_node("Concat", ["n1", "tail"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])],
            {"x": x}, {"y": x.reshape(3, -1, 4)},
            {"zero": _i64(0), "ax0": _i64([0]), "tail": _i64([-1, 4])}, 13)


def _case_fold_mask_arithmetic():
    # A causal mask built from Shape, Range, Unsqueeze, Less, Where,
    # ConstantOfShape and Cast; all of it folds into one constant.
    x = _rand(2, 5, 5)
    n = x.shape[1]
    mask = np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -1e4, 0.0).astype(np.float32)
    fill = helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])
    return ([helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Squeeze", ["s"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "ax0"], ["row"]),
             helper.make_node("Unsqueeze", ["r", "ax1"], ["col"]),
             helper.make_node("Greater", ["row", "col"], ["upper"]),
             helper.make_node("Concat", ["s", "s"], ["ss"], axis=0),
             helper.make_node("ConstantOfShape", ["ss"], ["zeros"], value=fill),
             helper.make_node("Cast", ["upper"], ["upf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["upf", "neg"], ["m"]),
             helper.make_node("Add", ["m", "zeros"], ["mask"]),
             helper.make_node("Add", ["x", "mask"], ["y"])],
            {"x": x}, {"y": x + mask},
            {"zero": _i64(0), "one": _i64(1), "ax0": _i64([0]), "ax1": _i64([1]),
             "neg": np.array(-1e4, dtype=np.float32)}, 15)


def _case_fold_size_where_expand():
    x = _rand(2, 3)
    return ([helper.make_node("Size", ["x"], ["sz"]),
             helper.make_node("Equal", ["sz", "six"], ["eq"]),
             helper.make_node("Where", ["eq", "a", "b"], ["shape"]),
             helper.make_node("Expand", ["x", "shape"], ["y"])],
            {"x": x}, {"y": np.broadcast_to(x, (4, 2, 3))},
            {"six": _i64(6), "a": _i64([4, 1, 1]), "b": _i64([1, 1, 1])}, 13)


CASES = {
    "transpose": _case_transpose,
    "transpose_default": _case_transpose_default,
    "transpose_blocked": _case_transpose_blocked,
    "squeeze_unsqueeze_attr": _case_squeeze_unsqueeze_attr,
    "squeeze_unsqueeze_input": _case_squeeze_unsqueeze_input,
    "flatten": _case_flatten,
    "concat": _case_concat,
    "concat_many": _case_concat_many,
    "split_attr": _case_split_attr,
    "split_input": _case_split_input,
    "split_equal": _case_split_equal,
    "split_num_outputs": _case_split_num_outputs,
    "slice": _case_slice,
    "slice_clamped": _case_slice_clamped,
    "slice_attr": _case_slice_attr,
    "gather_negative": _case_gather_negative,
    "gather_embedding": _case_gather_embedding,
    "pad_constant": _case_pad_constant,
    "pad_reflect": _case_pad_reflect,
    "pad_edge_negative": _case_pad_edge_negative,
    "pad_attr": _case_pad_attr,
    "tile": _case_tile,
    "expand": _case_expand,
    "expand_int": _case_expand_int,
    "depth_to_space_dcr": _case_depth_to_space_dcr,
    "depth_to_space_crd": _case_depth_to_space_crd,
    "space_to_depth": _case_space_to_depth,
    "einsum_attention_scores": _einsum_case("bhid,bhjd->bhij", (2, 3, 4, 5), (2, 3, 6, 5)),
    "einsum_attention_values": _einsum_case("bhij,bhjd->bhid", (2, 3, 4, 6), (2, 3, 6, 5)),
    "einsum_bmm": _einsum_case("bij,bjk->bik", (3, 4, 5), (3, 5, 2)),
    "einsum_mm": _einsum_case("ij,jk->ik", (4, 5), (5, 3)),
    "einsum_implicit": _einsum_case("ij,jk", (4, 5), (5, 3)),
    "einsum_permuted_output": _einsum_case("ibh,hnd->bnid", (4, 2, 6), (6, 3, 5)),
    "einsum_transpose": _einsum_case("abc->cab", (2, 3, 4)),
    "matmul_broadcast": _case_matmul_broadcast,
    "matmul_vectors": _case_matmul_vectors,
    "resize_nearest_torch": _resize_case((1, 2, 3, 4), "nearest", "asymmetric",
                                         scales=[1, 1, 2, 3], nearest="floor"),
    "resize_nearest_half_pixel": _resize_case((1, 1, 5, 4), "nearest", "half_pixel",
                                              scales=[1, 1, 0.6, 1.75]),
    "resize_nearest_ceil_sizes": _resize_case((2, 3, 4), "nearest", "align_corners",
                                              sizes=[2, 3, 7], nearest="ceil"),
    "resize_nearest_prefer_ceil": _resize_case((1, 1, 4, 4), "nearest", "asymmetric",
                                               scales=[1, 1, 0.5, 1.5],
                                               nearest="round_prefer_ceil"),
    "resize_linear_half_pixel": _resize_case((1, 2, 4, 5), "linear", "half_pixel",
                                             scales=[1, 1, 2, 1.5]),
    "resize_linear_align_corners": _resize_case((1, 2, 3, 4), "linear", "align_corners",
                                                sizes=[1, 2, 7, 5]),
    "resize_linear_asymmetric": _resize_case((1, 1, 6, 6), "linear", "asymmetric",
                                             scales=[1, 1, 0.5, 0.75]),
    "resize_linear_pytorch_half_pixel": _resize_case((2, 1, 5, 3), "linear",
                                                     "pytorch_half_pixel", sizes=[2, 1, 1, 7]),
    "conv_groups_dilation_pads": _case_conv_groups_dilation_pads,
    "conv_same_upper": _case_conv_same_upper,
    "conv1d_same_lower": _case_conv1d_same_lower,
    "conv_transpose_2d": _case_conv_transpose_2d,
    "conv_transpose_output_shape": _case_conv_transpose_output_shape,
    "conv_transpose_1d": _case_conv_transpose_1d,
    "maxpool_1d": _case_maxpool_1d,
    "avgpool_exclude_pad_ceil": _case_avgpool_exclude_pad_ceil,
    "avgpool_include_pad": _case_avgpool_include_pad,
    "avgpool_1d_same": _case_avgpool_1d_same,
    "global_pools": _case_global_pools,
    "fold_reshape_from_shape": _case_fold_reshape_from_shape,
    "fold_mask_arithmetic": _case_fold_mask_arithmetic,
    "fold_size_where_expand": _case_fold_size_where_expand,
}


@pytest.mark.parametrize("optlevel", [0, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_reference(tmp_path, env, name, optlevel):
    nodes, feeds, expected, inits, opset = CASES[name]()
    _check(nodes, feeds, expected, tmp_path, env, inits, opset, optlevel=optlevel)


def _onnx_slice_indices(d, start, end, step):
    """The indices ONNX's Slice reads along an axis of size d: negative
    starts and ends count from the end, then clamp to 0..d (positive
    step) or start to 0..d-1 and end to -1..d-1 (negative step).  Unlike
    Python's slicing, a start before the beginning with a negative step
    clamps to 0 rather than giving nothing."""
    start = start + d if start < 0 else start
    end = end + d if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), d), min(max(end, 0), d)
    else:
        start, end = min(max(start, 0), d - 1), min(max(end, -1), d - 1)
    return list(range(start, end, step))


def test_random_slices_transposes_and_pads_match_numpy(tmp_path, env):
    """Many random parameters in one model: each output is one op."""
    rng = np.random.default_rng(11)
    x = _rand(4, 5, 3, 6)
    nodes, inits, expected = [], {}, {}
    for k in range(12):
        # Slice: random starts/ends (past the ends too), steps of either sign.
        axes = rng.permutation(4)[:rng.integers(1, 5)]
        st, en, sp, want = [], [], [], x
        for a in axes:
            d = x.shape[a]
            step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
            s0, e0 = (int(v) for v in rng.integers(-d - 2, d + 3, size=2))
            st.append(s0)
            en.append(e0)
            sp.append(step)
            want = np.take(want, _onnx_slice_indices(d, s0, e0, step), axis=a)
        inits.update({f"st{k}": _i64(st), f"en{k}": _i64(en), f"ax{k}": _i64(axes),
                      f"sp{k}": _i64(sp)})
        nodes.append(helper.make_node("Slice", ["x", f"st{k}", f"en{k}", f"ax{k}", f"sp{k}"],
                                      [f"s{k}"]))
        expected[f"s{k}"] = want
        # Transpose by a random permutation.
        perm = [int(v) for v in rng.permutation(4)]
        nodes.append(helper.make_node("Transpose", ["x"], [f"t{k}"], perm=perm))
        expected[f"t{k}"] = x.transpose(perm)
        # Pad in a random mode, pads up to the dims (reflect: less).
        mode = ["constant", "reflect", "edge"][k % 3]
        lim = [d - 1 if mode == "reflect" else d for d in x.shape]
        pb = [int(rng.integers(-1, m + 1)) for m in lim]
        pe = [int(rng.integers(-1, m + 1)) for m in lim]
        inits[f"p{k}"] = _i64(pb + pe)
        nodes.append(helper.make_node("Pad", ["x", f"p{k}"], [f"p{k}_y"], mode=mode))
        crop = tuple(slice(max(0, -b), x.shape[i] + min(0, e) if e < 0 else None)
                     for i, (b, e) in enumerate(zip(pb, pe)))
        np_mode = {"edge": "edge", "reflect": "reflect", "constant": "constant"}[mode]
        grown = np.pad(x[crop], [(max(b, 0), max(e, 0)) for b, e in zip(pb, pe)], mode=np_mode)
        expected[f"p{k}_y"] = grown
    _check(nodes, {"x": x}, expected, tmp_path, env, inits, 13)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("isa", isas())
def test_blocked_transposes_match_numpy(tmp_path, env, isa, threads):
    """Transposes whose two inner axes swap run in blocks of 8 × 8 (on
    AVX2 a register transpose), 8 output rows a task: whole and partial
    blocks on both sides (19 × 21, 16 × 40, 8 × 8), outer axes of one or
    more, the bits moved as they are (NaN, -0 and infinities kept)."""
    e, keys = env
    x = _rand(3, 19, 21)
    x[0, 3, 5], x[1, 0, 0], x[2, 18, 20] = np.nan, -0.0, np.inf
    y = _rand(2, 5, 16, 40)
    z = _rand(8, 8)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[1, 0, 3, 2]),
             helper.make_node("Transpose", ["z"], ["zt"], perm=[1, 0])]
    expected = {"xt": x.transpose(0, 2, 1), "yt": y.transpose(1, 0, 3, 2), "zt": z.T}
    feeds = {"x": x, "y": y, "z": z}
    got = _kiln(_model(nodes, feeds, list(expected), {}, 13), feeds, list(expected), tmp_path,
                (dict(e, KILN_RT_ISA=isa, KILN_RT_THREADS=str(threads)), keys), 2)
    for n, want in expected.items():
        assert got[n].shape == want.shape, n
        assert np.array_equal(got[n].view(np.uint32), np.ascontiguousarray(want).view(np.uint32)), n


# --- what folding leaves, and what it refuses -------------------------------------

def test_folding_leaves_no_shape_arithmetic_in_the_graph(tmp_path, env):
    nodes, feeds, _, inits, opset = _case_fold_mask_arithmetic()
    onnx.save(_model(nodes, feeds, ["y"], inits, opset), str(tmp_path / "m.onnx"))
    proc = run(["kiln", "inspect", tmp_path / "m.onnx"], env=env[0])
    assert proc.returncode == 0, proc.stderr
    # Eleven nodes fold into one constant: only the final Add runs.
    assert "Add" in proc.stdout
    for op in ("Shape", "Range", "ConstantOfShape", "Where", "Greater", "Cast", "Concat"):
        assert op not in proc.stdout, (op, proc.stdout)


@pytest.mark.parametrize("what", ["range_of_input", "nonzero", "einsum_sum", "if"])
def test_refusals_name_the_node(tmp_path, env, what):
    x = _rand(4)
    if what == "range_of_input":
        feeds = {"n": _i64(5)}
        nodes = [helper.make_node("Range", ["zero", "n", "one"], ["y"], name="my_range")]
        inits = {"zero": _i64(0), "one": _i64(1)}
        want = ["my_range", "Range", "'n'", "run time", "compile time"]
    elif what == "nonzero":
        feeds, inits = {"x": x}, None
        nodes = [helper.make_node("NonZero", ["x"], ["y"], name="nz")]
        want = ["NonZero", "fixed shapes"]
    elif what == "einsum_sum":
        feeds, inits = {"a": _rand(3, 4)}, None
        nodes = [helper.make_node("Einsum", ["a"], ["y"], equation="ij->i", name="es")]
        want = ["'es'", "Einsum", "sums over label 'j'"]
    else:
        feeds, inits = {"x": x}, None
        branch = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "b", [],
                                   [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
        nodes = [helper.make_node("Greater", ["x", "x"], ["c0"]),
                 helper.make_node("ReduceMax", ["c0"], ["c"], keepdims=0),
                 helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
        want = ["If (1)", "control flow"]
    proc, _ = _compile(_model(nodes, feeds, ["y"], inits, 13), tmp_path, env)
    assert proc.returncode != 0
    for w in want:
        assert w in proc.stderr, (w, proc.stderr)


# --- models exported from torch ----------------------------------------------------

class _UNetish(torch.nn.Module):
    """Concat of a skip connection, ConvTranspose up-sampling, and the two
    interpolations torch exports as Resize."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.c3 = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        a = F.relu(self.c1(x))
        u = self.up(F.relu(self.c2(a)))
        y = self.c3(torch.cat([a, u], 1))
        return (F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
                + F.interpolate(y, scale_factor=2, mode="nearest"))


class _Views(torch.nn.Module):
    """view from size(0), permute, strided slicing, expand, repeat, the
    pixel shuffles (DepthToSpace/SpaceToDepth) and F.pad's modes."""

    def forward(self, x):
        b = x.size(0)
        y = x.view(b, -1, 4).permute(0, 2, 1)[:, 1:, ::2]
        z = y.flatten(1).unsqueeze(-1).expand(-1, -1, 3).repeat(1, 2, 1)
        p = F.pixel_unshuffle(F.pixel_shuffle(x.view(b, 4, 3, 4), 2), 2)
        q = torch.cat([F.pad(p, (1, 2, 2, 1), mode="reflect"),
                       F.pad(p, (1, 2, 2, 1), mode="replicate"),
                       F.pad(p, (1, 2, 2, 1), value=3.0)], 1)
        return z.sum() + q


class _CausalMask(torch.nn.Module):
    """A causal mask from tril/triu of a constant (Trilu, folded away)."""

    def forward(self, x):
        n = x.shape[1]
        keep = torch.ones(n, n).tril().bool()
        return x.masked_fill(~keep, float("-inf")).softmax(-1) + torch.triu(torch.ones(n, n), 1)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::UserWarning")
@pytest.mark.parametrize("name", ["unet", "views", "causal"])
def test_torch_exported_model_matches_torch(tmp_path, env, name):
    torch.manual_seed(3)
    module, x = {"unet": (_UNetish(), torch.rand(1, 3, 16, 16)),
                 "views": (_Views(), torch.rand(2, 3, 16)),
                 "causal": (_CausalMask(), torch.rand(2, 5, 5))}[name]
    module.eval()
    with torch.no_grad():
        want = module(x).numpy()
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"],
                      opset_version=14)
    got = _kiln(onnx.load(str(path)), {"x": x.numpy()}, ["y"], tmp_path, env)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- a torch-exported attention block ----------------------------------------------

@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_transformer_encoder_layer_matches_torch(tmp_path, env):
    """TransformerEncoderLayer exported at opset 14 computes its reshape
    targets from Shape: folding makes them constants."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             dropout=0.0, batch_first=True).eval()
    x = torch.rand(2, 5, 32)
    path = tmp_path / "enc.onnx"
    with torch.no_grad():
        want = layer(x).numpy()
    # Exported with gradients on, so that torch takes the composite path
    # (its fused inference kernel has no ONNX export).
    torch.onnx.export(layer, (x,), str(path), input_names=["x"], output_names=["y"],
                      opset_version=14)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Shape" in ops or "Reshape" in ops
    e, ring = env
    kar = tmp_path / "enc.kar"
    proc = run(["kiln", "compile", path, "-o", kar, "--local"], env=e)
    assert proc.returncode == 0, proc.stderr
    np.save(tmp_path / "x.npy", x.numpy())
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={tmp_path / 'x.npy'}",
                "--output-dir", tmp_path / "out"], env=e)
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "y.npy")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# --- products reading their operands through strides ---------------------------

def _attention_case(n_, t_=6, e_=8, h_=2):
    """Torch's attention at opset 14, by hand: slices of one QKV tensor,
    head splits, K transposed, Q divided by sqrt(d), the heads merged.
    With a batch (n_) of 1 every slice and split is a strided view of
    QKV; with 2 the split merges the batch with the heads and is not."""
    d_ = e_ // h_
    qkv = _rand(t_, n_, 3 * e_)
    nodes = [helper.make_node("Slice", ["qkv", "s0", "s1", "ax"], ["q0"]),
             helper.make_node("Slice", ["qkv", "s1", "s2", "ax"], ["k0"]),
             helper.make_node("Slice", ["qkv", "s2", "s3", "ax"], ["v0"]),
             helper.make_node("Reshape", ["q0", "heads"], ["q1"]),
             helper.make_node("Reshape", ["k0", "heads"], ["k1"]),
             helper.make_node("Reshape", ["v0", "heads"], ["v1"]),
             helper.make_node("Transpose", ["q1"], ["q2"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["v1"], ["v2"], perm=[1, 0, 2]),
             helper.make_node("Div", ["q2", "scale"], ["q3"]),
             helper.make_node("Transpose", ["k1"], ["kt"], perm=[1, 2, 0]),
             helper.make_node("MatMul", ["q3", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("Mul", ["half", "v2"], ["v3"]),
             helper.make_node("MatMul", ["p", "v3"], ["o"]),
             helper.make_node("Transpose", ["o"], ["o1"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["o1", "merged"], ["y"])]
    inits = {"s0": _i64([0]), "s1": _i64([e_]), "s2": _i64([2 * e_]),
             "s3": _i64([3 * e_]), "ax": _i64([2]), "heads": _i64([t_, n_ * h_, d_]),
             "merged": _i64([t_, n_, e_]),
             "scale": np.array(math.sqrt(d_), np.float32),
             "half": np.array(0.5, np.float32)}
    x = qkv.astype(np.float64)
    q = x[:, :, :e_].reshape(t_, n_ * h_, d_).transpose(1, 0, 2) / math.sqrt(d_)
    k = x[:, :, e_:2 * e_].reshape(t_, n_ * h_, d_).transpose(1, 2, 0)
    v = x[:, :, 2 * e_:].reshape(t_, n_ * h_, d_).transpose(1, 0, 2) * 0.5
    s = q @ k
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = (p @ v).transpose(1, 0, 2).reshape(t_, n_, e_)
    return nodes, {"qkv": qkv}, inits, {"y": y.astype(np.float32)}


def _broadcast_case():
    """A transposed A broadcast against B's batch, a strided slice (step 2)
    as B, a scale on each side, the result transposed; and an operand
    whose transpose moves its last axis (read after a copy)."""
    m, k, n = 5, 7, 3
    xa = _rand(m, 2, k)                 # A = xa transposed to [2, m, k]
    xb = _rand(6, 1, k, n)              # B = xb[::2], [3, 1, k, n]
    xc = _rand(k, m)                    # C = xc transposed to [m, k]
    xd = _rand(k, n)
    nodes = [helper.make_node("Transpose", ["xa"], ["a"], perm=[1, 0, 2]),
             helper.make_node("Mul", ["a", "two"], ["a2"]),
             helper.make_node("Slice", ["xb", "b0", "b1", "bax", "bstep"], ["b"]),
             helper.make_node("Div", ["b", "two"], ["b2"]),
             helper.make_node("MatMul", ["a2", "b2"], ["ab"]),
             helper.make_node("Transpose", ["ab"], ["y"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["xc"], ["c"], perm=[1, 0]),
             helper.make_node("MatMul", ["c", "xd"], ["z"])]
    inits = {"two": np.array(2.0, np.float32), "b0": _i64([0]), "b1": _i64([6]),
             "bax": _i64([0]), "bstep": _i64([2])}
    a = xa.astype(np.float64).transpose(1, 0, 2)
    b = xb.astype(np.float64)[::2]
    y = ((a * 2) @ (b / 2)).transpose(0, 2, 1, 3)
    z = xc.astype(np.float64).T @ xd
    return (nodes, {"xa": xa, "xb": xb, "xc": xc, "xd": xd}, inits,
            {"y": y.astype(np.float32), "z": z.astype(np.float32)})


@pytest.mark.parametrize("isa", isas())
def test_products_of_empty_k_are_their_addends(tmp_path, env, isa):
    """k = 0 on the matrix engine (its epilogue of zeros): a MatMul is
    zeros, a Gemm beta times C broadcast with its fused Relu, values the
    engine must write; a batched MatMul whose constant B has k = 0 too
    (a batch of B is not packed as one weight: it had been, and the
    runtime refused it)."""
    e, keys = env
    c = np.array([-1.0, 0.5, 2.0, -3.0, 4.0], np.float32)
    x = np.zeros((3, 0), np.float32)
    xb = np.zeros((2, 3, 0), np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Gemm", ["x", "w", "c"], ["g"], beta=2.0),
             helper.make_node("Relu", ["g"], ["z"]),
             helper.make_node("MatMul", ["xb", "wb"], ["yb"])]
    inits = {"w": np.zeros((0, 5), np.float32), "c": c,
             "wb": np.zeros((2, 0, 4), np.float32)}
    expected = {"y": np.zeros((3, 5), np.float32),
                "z": np.broadcast_to(np.maximum(2.0 * c, 0.0), (3, 5)),
                "yb": np.zeros((2, 3, 4), np.float32)}
    _check(nodes, {"x": x, "xb": xb}, expected, tmp_path, (dict(e, KILN_RT_ISA=isa), keys),
           inits, opset=14)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens,width,heads", [(37, 96, 3), (70, 64, 2)])
def test_attention_products_on_every_isa_match_numpy(tmp_path, env, tokens, width, heads,
                                                     isa, threads):
    """The products of activations by activations (each head's Q·Kᵀ and
    its P·V: K read transposed through strides, Q scaled by alpha) run on
    the matrix engine on every micro-kernel and thread count: token
    counts that leave partial row and column panels (37 and 70 rows of
    8, scores of 37 and 70 columns of 32), head widths of 32."""
    e, keys = env
    nodes, feeds, inits, expected = _attention_case(1, tokens, width, heads)
    _check(nodes, feeds, expected, tmp_path,
           (dict(e, KILN_RT_ISA=isa, KILN_RT_THREADS=str(threads)), keys), inits,
           opset=14, tol=1e-5, optlevel=2)


@pytest.mark.parametrize("case", [lambda: _attention_case(1), lambda: _attention_case(2),
                                  _broadcast_case],
                         ids=["attention_batch_1", "attention_batch_2", "broadcast"])
@pytest.mark.parametrize("optlevel", [0, 2, 3])
def test_matmul_reads_sliced_transposed_scaled_operands_like_numpy(tmp_path, env, case,
                                                                   optlevel):
    """From -O2 the slices, transposes and scalar factors around a MatMul
    are read and written through strides: the results stay numpy's."""
    nodes, feeds, inits, expected = case()
    _check(nodes, feeds, expected, tmp_path, env, inits, opset=14, tol=1e-5,
           optlevel=optlevel)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("isa", isas())
def test_small_plane_pools_match_torch(tmp_path, env, isa, threads):
    """Average and max pools on small planes, whose AVX-512 paths take
    sixteen outputs of a row at a time and the portable loops elsewhere
    (runtime/kiln_kernels_pool.c): padded or not, the padding counted or
    not, ceil_mode, stride 1 and 2, a dilated window, rows of 5 to 13
    outputs, several planes a task; against torch, on every micro-kernel,
    1 and 3 threads."""
    e, keys = env
    x, x5 = _rand(2, 24, 13, 13), _rand(1, 40, 5, 5)
    tx, t5 = torch.from_numpy(x), torch.from_numpy(x5)
    nodes = [
        helper.make_node("AveragePool", ["x"], ["a1"], kernel_shape=[3, 3], pads=[1] * 4,
                         count_include_pad=1),
        helper.make_node("AveragePool", ["x"], ["a2"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1] * 4, ceil_mode=1),
        helper.make_node("AveragePool", ["x5"], ["a3"], kernel_shape=[3, 3], pads=[1] * 4,
                         count_include_pad=1),
        helper.make_node("MaxPool", ["x"], ["m1"], kernel_shape=[3, 3], pads=[1] * 4,
                         ceil_mode=1),
        helper.make_node("MaxPool", ["x"], ["m2"], kernel_shape=[2, 2], strides=[2, 2],
                         ceil_mode=1),
        helper.make_node("MaxPool", ["x5"], ["m3"], kernel_shape=[3, 3], pads=[1] * 4,
                         dilations=[2, 2]),
    ]
    expected = {
        "a1": F.avg_pool2d(tx, 3, 1, 1, count_include_pad=True),
        "a2": F.avg_pool2d(tx, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        "a3": F.avg_pool2d(t5, 3, 1, 1, count_include_pad=True),
        "m1": F.max_pool2d(tx, 3, 1, 1, ceil_mode=True),
        "m2": F.max_pool2d(tx, 2, 2, ceil_mode=True),
        "m3": F.max_pool2d(t5, 3, 1, 1, dilation=2),
    }
    _check(nodes, {"x": x, "x5": x5}, {k: v.numpy() for k, v in expected.items()}, tmp_path,
           (dict(e, KILN_RT_ISA=isa, KILN_RT_THREADS=str(threads)), keys), opset=13)
