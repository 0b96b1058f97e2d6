"""The math ops end to end: elementwise arithmetic and activations,
comparisons and logic, Where, Cast, Clip, Softmax/LogSoftmax, the Reduce*
family, ArgMax/ArgMin and the normalisations.

Each test builds a small ONNX model with onnx.helper (several ops side by
side in one model where they share inputs, so that one compile covers
many), compiles it with `kiln compile --local`, runs it with `kiln-run`
on .npy inputs and compares every output with numpy or torch computed
here.  Inputs are graph inputs, never initializers, so that nothing is
folded at compile time and the runtime's kernels are what is measured.
Tolerances are tighter than ONNX's backend tests (rtol 1e-3, atol 1e-7)
where float32 allows.  A last group checks that bad models are refused
with a message naming the node and the problem.
"""

import math
import shutil

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from conftest import run

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}

RNG = np.random.default_rng(20241120)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private KILN_CONFIG_DIR (the local signing key is made once) and a
    keyring holding its public key."""
    d = tmp_path_factory.mktemp("kiln-math")
    cfg = d / "config"
    return {"KILN_CONFIG_DIR": str(cfg), "dir": d}


class Kiln:
    """Compile and run ONNX models through the kiln programs."""

    def __init__(self, env, tmp_path):
        self.env = {"KILN_CONFIG_DIR": env["KILN_CONFIG_DIR"]}
        self.tmp = tmp_path
        self.n = 0

    def _keyring(self):
        ring = self.tmp / "keyring"
        if not ring.exists():
            ring.mkdir()
            shutil.copy(f"{self.env['KILN_CONFIG_DIR']}/keys/kiln.pub", ring / "me.pub")
        return ring

    def model(self, nodes, inputs, outputs, opset=13, initializers=()):
        """An ONNX model: inputs {name: array} (their dtype and shape),
        outputs a list of names (types left to kiln's inference) or of
        (name, onnx type, shape)."""
        vin = [helper.make_tensor_value_info(k, NP_TO_ONNX[v.dtype], list(v.shape))
               for k, v in inputs.items()]
        vout = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
                if isinstance(o, str) else helper.make_tensor_value_info(*o)
                for o in outputs]
        g = helper.make_graph(nodes, "g", vin, vout, initializer=list(initializers))
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])

    def compile(self, model):
        """Compile; returns (path of the artifact or None, the process)."""
        self.n += 1
        src = self.tmp / f"m{self.n}.onnx"
        kar = self.tmp / f"m{self.n}.kar"
        onnx.save(model, src)
        proc = run(["kiln", "compile", src, "-o", kar, "--local"], env=self.env)
        return (kar if proc.returncode == 0 else None), proc

    def run(self, nodes, inputs, outputs, opset=13, initializers=()):
        """Compile and run; returns {output name: array}."""
        kar, proc = self.compile(self.model(nodes, inputs, outputs, opset, initializers))
        assert kar is not None, f"compile failed: {proc.stderr}"
        args = []
        for name, v in inputs.items():
            p = self.tmp / f"in{self.n}_{name}.npy"
            np.save(p, v)
            args += ["--input", f"{name}={p}"]
        out = self.tmp / f"out{self.n}"
        r = run(["kiln-run", kar, "--keyring", self._keyring(), *args,
                 "--output-dir", out], env=self.env)
        assert r.returncode == 0, f"kiln-run failed: {r.stderr}"
        names = [o if isinstance(o, str) else o[0] for o in outputs]
        return {n: np.load(out / f"{n}.npy") for n in names}

    def refusal(self, nodes, inputs, outputs, opset=13, initializers=()):
        """Compile a model that must be refused; returns stderr."""
        kar, proc = self.compile(self.model(nodes, inputs, outputs, opset, initializers))
        assert kar is None, "the model was accepted"
        return proc.stderr


@pytest.fixture
def kiln(env, tmp_path):
    return Kiln(env, tmp_path)


def check(got, want, rtol=1e-5, atol=1e-6, name=""):
    want = np.asarray(want)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op.lower()}_{outs[0]}", **attrs)


def f32(*shape, lo=-3.0, hi=3.0):
    return RNG.uniform(lo, hi, size=shape).astype(np.float32)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


# --- unary float ops ------------------------------------------------------

def _selu(x, alpha=1.6732632423543772, gamma=1.0507009873554805):
    return np.where(x > 0, gamma * x, gamma * (alpha * np.exp(x) - alpha))


def _hard_sigmoid(x, alpha=0.2, beta=0.5):
    return np.clip(alpha * x + beta, 0, 1)


def test_unary_float_ops_match_numpy_and_torch(kiln):
    x = f32(3, 4, 5)
    x[0, 0, :3] = [0.0, -0.0, 1e-3]
    xp = np.abs(f32(3, 4, 5)) + 0.05
    x64 = x.astype(np.float64)
    cases = [
        # (op, input, attrs, expected)
        ("Sqrt", "xp", {}, np.sqrt(xp)),
        ("Reciprocal", "xp", {}, 1.0 / xp),
        ("Exp", "x", {}, np.exp(x64)),
        ("Log", "xp", {}, np.log(xp.astype(np.float64))),
        ("Neg", "x", {}, -x),
        ("Abs", "x", {}, np.abs(x)),
        ("Floor", "x", {}, np.floor(x)),
        ("Ceil", "x", {}, np.ceil(x)),
        ("Erf", "x", {}, torch.erf(t(x64)).numpy()),
        ("Tanh", "x", {}, np.tanh(x64)),
        ("Sigmoid", "x", {}, 1 / (1 + np.exp(-x64))),
        ("Relu", "x", {}, np.maximum(x, 0)),
        ("LeakyRelu", "x", {}, np.where(x >= 0, x64, 0.01 * x64)),
        ("LeakyRelu", "x", {"alpha": 0.3}, np.where(x >= 0, x64, 0.3 * x64)),
        ("Elu", "x", {}, F.elu(t(x64)).numpy()),
        ("Elu", "x", {"alpha": 0.5}, F.elu(t(x64), alpha=0.5).numpy()),
        ("Selu", "x", {}, F.selu(t(x64)).numpy()),
        ("Selu", "x", {"alpha": 2.0, "gamma": 3.0}, _selu(x64, 2.0, 3.0)),
        ("Celu", "x", {}, F.celu(t(x64)).numpy()),
        ("Celu", "x", {"alpha": 2.0}, F.celu(t(x64), alpha=2.0).numpy()),
        ("HardSigmoid", "x", {}, _hard_sigmoid(x64)),
        ("HardSigmoid", "x", {"alpha": 0.5, "beta": 0.6}, _hard_sigmoid(x64, 0.5, 0.6)),
        ("HardSwish", "x", {}, F.hardswish(t(x64)).numpy()),
        ("Softplus", "x", {}, F.softplus(t(x64)).numpy()),
        ("Softsign", "x", {}, F.softsign(t(x64)).numpy()),
        ("Identity", "x", {}, x),
    ]
    nodes = [node(op, [i], [f"y{k}"], **a) for k, (op, i, a, _) in enumerate(cases)]
    # Dropout at inference passes its input through.
    nodes.append(node("Dropout", ["x"], ["drop"]))
    outs = [f"y{k}" for k in range(len(cases))] + ["drop"]
    # ... and so does Dropout whose training_mode is a constant false.
    false = helper.make_tensor("no", TensorProto.BOOL, [], [False])
    nodes.append(node("Dropout", ["x", "", "no"], ["drop2"]))
    outs.append("drop2")
    # ... and Dropout in training mode with a ratio of 0 (torchvision's
    # swin_t exports its attention dropout so), with a mask nobody reads.
    yes = helper.make_tensor("yes", TensorProto.BOOL, [], [True])
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes.append(node("Dropout", ["x", "zero", "yes"], ["drop3", "unread_mask"]))
    outs.append("drop3")
    got = kiln.run(nodes, {"x": x, "xp": xp}, outs, opset=14,
                   initializers=[false, yes, zero])
    for k, (op, _, a, want) in enumerate(cases):
        check(got[f"y{k}"], np.asarray(want).astype(np.float32), name=f"{op} {a}")
    check(got["drop"], x, name="Dropout")
    check(got["drop2"], x, name="Dropout training_mode=false")
    check(got["drop3"], x, name="Dropout training_mode=true ratio=0")


def test_softplus_and_sigmoid_do_not_overflow_on_large_inputs(kiln):
    x = np.array([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0], np.float32)
    got = kiln.run([node("Softplus", ["x"], ["sp"]), node("Sigmoid", ["x"], ["sg"]),
                    node("Exp", ["x"], ["e"])], {"x": x}, ["sp", "sg", "e"])
    x64 = x.astype(np.float64)
    check(got["sp"], np.logaddexp(0, x64).astype(np.float32), name="Softplus")
    check(got["sg"], (1 / (1 + np.exp(-x64))).astype(np.float32), name="Sigmoid")
    with np.errstate(over="ignore"):
        check(got["e"], np.exp(x), name="Exp")


def test_unary_float64_and_nan_propagation(kiln):
    x = RNG.uniform(-2, 2, size=(4, 6))
    x[1, 2] = np.nan
    got = kiln.run([node("Exp", ["x"], ["e"]), node("Tanh", ["x"], ["th"]),
                    node("Relu", ["y"], ["r"]), node("Abs", ["x"], ["a"])],
                   {"x": x, "y": x.astype(np.float32)}, ["e", "th", "r", "a"])
    check(got["e"], np.exp(x), rtol=1e-12, atol=0, name="Exp float64")
    check(got["th"], np.tanh(x), rtol=1e-12, atol=0, name="Tanh float64")
    check(got["a"], np.abs(x), name="Abs float64")
    assert np.isnan(got["r"][1, 2]), "Relu must keep NaN"


# --- binary arithmetic and variadic ops ----------------------------------

BROADCASTS = [((3, 4, 5), (3, 4, 5)), ((3, 4, 5), (4, 1)), ((3, 4, 5), (5,)),
              ((3, 4, 5), ()), ((1, 4, 1), (3, 1, 5)), ((2, 1), (1, 3))]


@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary_float_ops_broadcast_like_numpy(kiln, sa, sb):
    a = f32(*sa)
    b = f32(*sb)
    bp = (np.abs(f32(*sb)) + 0.5).astype(np.float32)
    ap = (np.abs(a) + 0.1).astype(np.float32)
    ops = [("Add", "a", "b", a + b), ("Sub", "a", "b", a - b), ("Mul", "a", "b", a * b),
           ("Div", "a", "bp", a / bp), ("Pow", "ap", "b", np.power(ap.astype(np.float64), b)),
           ("Max", "a", "b", np.maximum(a, b)), ("Min", "a", "b", np.minimum(a, b)),
           ("Sum", "a", "b", a + b), ("Mean", "a", "b", (a + b) / 2)]
    nodes = [node(op, [i, j], [f"y{k}"]) for k, (op, i, j, _) in enumerate(ops)]
    got = kiln.run(nodes, {"a": a, "b": b, "bp": bp, "ap": ap},
                   [f"y{k}" for k in range(len(ops))])
    for k, (op, _, _, want) in enumerate(ops):
        check(got[f"y{k}"], np.asarray(want, np.float32), name=f"{op} {sa} {sb}")


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("sb", [(5, 37, 96), (37, 1), (96,), (5, 1, 96), ()])
def test_binary_float_ops_shared_by_threads_are_exact(env, tmp_path, sb, threads):
    """Add, Sub, Mul and Div over 17 760 elements run on the pool, rows of
    the output a task (each task starting its broadcast mid-way); every
    element is the float32 operation numpy computes, bit for bit, on any
    thread count."""
    k = Kiln(env, tmp_path)
    k.env["KILN_RT_THREADS"] = threads
    a = f32(5, 37, 96)
    b = (np.abs(f32(*sb)) + 0.5).astype(np.float32)
    ops = [("Add", a + b), ("Sub", a - b), ("Mul", a * b), ("Div", a / b)]
    got = k.run([node(op, ["a", "b"], [f"y{i}"]) for i, (op, _) in enumerate(ops)],
                {"a": a, "b": b}, [f"y{i}" for i in range(len(ops))])
    for i, (op, want) in enumerate(ops):
        assert np.array_equal(got[f"y{i}"].view(np.uint32),
                              np.ascontiguousarray(want, np.float32).view(np.uint32)), op


def test_variadic_ops_over_three_broadcast_inputs_and_one(kiln):
    a, b, c = f32(2, 3, 4), f32(3, 1), f32(4)
    c[1] = np.nan
    got = kiln.run([node("Max", ["a", "b", "c"], ["mx"]), node("Min", ["a", "b", "c"], ["mn"]),
                    node("Sum", ["a", "b", "c"], ["s"]), node("Mean", ["a", "b", "c"], ["me"]),
                    node("Sum", ["b"], ["s1"]), node("Max", ["c"], ["m1"]),
                    node("Mean", ["a"], ["me1"])],
                   {"a": a, "b": b, "c": c}, ["mx", "mn", "s", "me", "s1", "m1", "me1"])
    check(got["mx"], np.maximum(np.maximum(a, b), c), name="Max")
    check(got["mn"], np.minimum(np.minimum(a, b), c), name="Min")
    check(got["s"], a + b + c, name="Sum")
    check(got["me"], (a + b + c) / 3, name="Mean")
    check(got["s1"], b, name="Sum of one")
    check(got["m1"], c, name="Max of one")
    check(got["me1"], a, name="Mean of one")
    assert np.isnan(got["mx"][..., 1]).all() and np.isnan(got["mn"][..., 1]).all()


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_integer_arithmetic_wraps_and_truncates_like_c(kiln, dt):
    info = np.iinfo(dt)
    a = RNG.integers(-50, 50, size=(3, 4)).astype(dt)
    a[0, :3] = [info.max, info.min, -7]
    b = RNG.integers(1, 9, size=(4,)).astype(dt) * np.array([1, -1, 1, -1], dt)
    e = RNG.integers(0, 4, size=(3, 4)).astype(dt)
    got = kiln.run([node("Add", ["a", "b"], ["add"]), node("Sub", ["a", "b"], ["sub"]),
                    node("Mul", ["a", "b"], ["mul"]), node("Div", ["a", "b"], ["div"]),
                    node("Max", ["a", "b"], ["max"]), node("Min", ["a", "b"], ["min"]),
                    node("Neg", ["a"], ["neg"]), node("Abs", ["a"], ["abs"]),
                    node("Pow", ["e", "e"], ["pow"]), node("Sum", ["a", "b", "a"], ["sum"])],
                   {"a": a, "b": b, "e": e},
                   ["add", "sub", "mul", "div", "max", "min", "neg", "abs", "pow", "sum"])
    with np.errstate(over="ignore"):
        check(got["add"], a + b, name="Add")
        check(got["sub"], a - b, name="Sub")
        check(got["mul"], a * b, name="Mul")
        check(got["neg"], -a, name="Neg")
        check(got["abs"], np.abs(a), name="Abs")
        check(got["sum"], a + b + a, name="Sum")
    # ONNX Runtime and C truncate toward zero (numpy's // floors).
    trunc = (np.abs(a.astype(object)) // np.abs(b.astype(object))) * np.sign(a) * np.sign(b)
    check(got["div"], np.array(trunc.tolist(), dtype=object).astype(dt), name="Div")
    check(got["max"], np.maximum(a, b), name="Max")
    check(got["min"], np.minimum(a, b), name="Min")
    check(got["pow"], np.power(e, e), name="Pow")


def test_pow_with_mixed_types(kiln):
    x = np.abs(f32(2, 3)) + 0.5
    n = RNG.integers(-2, 4, size=(3,)).astype(np.int64)
    i = RNG.integers(1, 5, size=(2, 3)).astype(np.int64)
    y = np.array([0.5, 2.0, 3.0], np.float32)
    got = kiln.run([node("Pow", ["x", "n"], ["fx"]), node("Pow", ["i", "y"], ["ix"])],
                   {"x": x, "n": n, "i": i, "y": y}, ["fx", "ix"], opset=15)
    check(got["fx"], np.power(x.astype(np.float64), n).astype(np.float32), name="float^int")
    check(got["ix"], np.power(i, y.astype(np.float64)).astype(np.int64), name="int^float")


def test_prelu_broadcasts_slope_to_x(kiln):
    x = f32(2, 3, 4)
    per_channel = f32(3, 1)
    scalar = np.array([0.25], np.float32)
    got = kiln.run([node("PRelu", ["x", "c"], ["pc"]), node("PRelu", ["x", "s"], ["ps"])],
                   {"x": x, "c": per_channel, "s": scalar}, ["pc", "ps"], opset=16)
    check(got["pc"], np.where(x < 0, x * per_channel, x), name="PRelu per channel")
    check(got["ps"], F.prelu(t(x), t(scalar)).numpy(), name="PRelu scalar vs torch")


def test_float64_arithmetic(kiln):
    a, b = RNG.normal(size=(3, 4)), RNG.normal(size=(4,))
    got = kiln.run([node("Add", ["a", "b"], ["add"]), node("Div", ["a", "b"], ["div"]),
                    node("Mul", ["a", "a"], ["mul"])], {"a": a, "b": b}, ["add", "div", "mul"])
    check(got["add"], a + b, rtol=1e-15, atol=0, name="Add")
    check(got["div"], a / b, rtol=1e-15, atol=0, name="Div")
    check(got["mul"], a * a, rtol=1e-15, atol=0, name="Mul")


# --- comparisons, logic, Where ----------------------------------------------

@pytest.mark.parametrize("dt", [np.float32, np.int64, np.int32, np.uint8])
def test_comparisons_give_bool(kiln, dt):
    a = RNG.integers(0, 4, size=(3, 4)).astype(dt)
    b = RNG.integers(0, 4, size=(4,)).astype(dt)
    ops = [("Equal", np.equal), ("Less", np.less), ("Greater", np.greater),
           ("LessOrEqual", np.less_equal), ("GreaterOrEqual", np.greater_equal)]
    got = kiln.run([node(op, ["a", "b"], [op.lower()]) for op, _ in ops],
                   {"a": a, "b": b}, [op.lower() for op, _ in ops], opset=16)
    for op, fn in ops:
        check(got[op.lower()], fn(a, b), name=op)


def test_comparisons_with_nan(kiln):
    a = np.array([1.0, np.nan, 3.0, np.nan], np.float32)
    b = np.array([1.0, 1.0, np.nan, np.nan], np.float32)
    got = kiln.run([node("Equal", ["a", "b"], ["eq"]), node("Less", ["a", "b"], ["lt"]),
                    node("GreaterOrEqual", ["a", "b"], ["ge"])], {"a": a, "b": b},
                   ["eq", "lt", "ge"])
    check(got["eq"], a == b, name="Equal")
    check(got["lt"], a < b, name="Less")
    check(got["ge"], a >= b, name="GreaterOrEqual")


def test_logic_ops_on_bool(kiln):
    a = RNG.integers(0, 2, size=(2, 3, 4)).astype(bool)
    b = RNG.integers(0, 2, size=(3, 1)).astype(bool)
    got = kiln.run([node("And", ["a", "b"], ["and"]), node("Or", ["a", "b"], ["or"]),
                    node("Xor", ["a", "b"], ["xor"]), node("Not", ["a"], ["not"]),
                    node("Equal", ["a", "b"], ["eq"])],
                   {"a": a, "b": b}, ["and", "or", "xor", "not", "eq"])
    check(got["and"], a & b, name="And")
    check(got["or"], a | b, name="Or")
    check(got["xor"], a ^ b, name="Xor")
    check(got["not"], ~a, name="Not")
    check(got["eq"], a == b, name="Equal bool")


@pytest.mark.parametrize("dt", [np.float32, np.int64, np.uint8, np.float64, np.bool_])
def test_where_selects_with_three_way_broadcast(kiln, dt):
    c = RNG.integers(0, 2, size=(3, 1, 5)).astype(bool)
    x = RNG.integers(0, 100, size=(3, 4, 5)).astype(dt)
    y = RNG.integers(0, 100, size=(5,)).astype(dt)
    got = kiln.run([node("Where", ["c", "x", "y"], ["w"])], {"c": c, "x": x, "y": y}, ["w"])
    check(got["w"], np.where(c, x, y), name="Where")


# --- Cast -------------------------------------------------------------------

def test_cast_between_types(kiln):
    x = np.array([[-3.7, -1.5, -0.5, 0.0], [0.49, 1.5, 2.5, 100.25]], np.float32)
    i = np.array([[-5, 0, 7, 1 << 40]], np.int64)
    b = np.array([True, False, True])
    d = RNG.normal(size=(2, 3))
    pairs = [("x", TensorProto.INT32, x.astype(np.int32)),
             ("x", TensorProto.INT64, x.astype(np.int64)),
             ("x", TensorProto.INT8, x.astype(np.int8)),
             ("x", TensorProto.BOOL, x.astype(bool)),
             ("x", TensorProto.DOUBLE, x.astype(np.float64)),
             ("x", TensorProto.FLOAT16, x.astype(np.float16)),
             ("i", TensorProto.FLOAT, i.astype(np.float32)),
             ("i", TensorProto.INT32, i.astype(np.int32)),
             ("i", TensorProto.UINT8, i.astype(np.uint8)),
             ("b", TensorProto.FLOAT, b.astype(np.float32)),
             ("b", TensorProto.INT64, b.astype(np.int64)),
             ("d", TensorProto.FLOAT, d.astype(np.float32)),
             ("x", TensorProto.FLOAT, x)]
    nodes = [node("Cast", [src], [f"c{k}"], to=to) for k, (src, to, _) in enumerate(pairs)]
    got = kiln.run(nodes, {"x": x, "i": i, "b": b, "d": d},
                   [f"c{k}" for k in range(len(pairs))])
    for k, (src, to, want) in enumerate(pairs):
        check(got[f"c{k}"], want, rtol=0, atol=0, name=f"Cast {src} to {to}")


def test_castlike_takes_the_dtype_of_its_second_input(kiln):
    x = f32(3, 4) * 10
    got = kiln.run([node("CastLike", ["x", "like_i"], ["ci"]),
                    node("CastLike", ["x", "like_d"], ["cd"])],
                   {"x": x, "like_i": np.zeros(1, np.int32), "like_d": np.zeros(2)},
                   ["ci", "cd"], opset=15)
    check(got["ci"], x.astype(np.int32), name="CastLike int32")
    check(got["cd"], x.astype(np.float64), name="CastLike float64")


def test_cast_float16_round_trip(kiln):
    # every finite float16 value, a few ties and out-of-range values
    h = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    x = np.concatenate([h.astype(np.float32),
                        np.array([65520.0, 1e6, -1e6, 2.0 ** -25, 1.0 + 2.0 ** -11,
                                  1.0 + 3 * 2.0 ** -11, np.inf, -np.inf], np.float32)])
    got = kiln.run([node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                    node("Cast", ["h"], ["f"], to=TensorProto.FLOAT)],
                   {"x": x}, ["h", "f"])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(got["h"].view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(got["f"], want.astype(np.float32))


def test_float16_math_computes_in_float32_and_rounds_each_result(kiln):
    # float16 ops compute in float32 and round each result to float16, as
    # numpy's float16 ufuncs do: Exp, then Mul by a float16 constant
    x = np.clip(f32(4, 64) * 4, -10, 10).astype(np.float16)
    c = helper.make_tensor("c", TensorProto.FLOAT16, [], [np.float16(0.3)])
    got = kiln.run([node("Exp", ["x"], ["e"]), node("Mul", ["e", "c"], ["y"])],
                   {"x": x}, ["e", "y"], initializers=[c])
    want_e = np.exp(x.astype(np.float32)).astype(np.float16)
    want_y = (got["e"].astype(np.float32) * np.float32(np.float16(0.3))).astype(np.float16)
    assert got["e"].dtype == np.float16 and got["y"].dtype == np.float16
    # kiln's float32 exp is within a few ulp of libm's: at most one float16
    # ulp apart where that lands on the other side of a float16 tie
    np.testing.assert_allclose(got["e"].astype(np.float32), want_e.astype(np.float32),
                               rtol=2.0 ** -10, atol=0)
    np.testing.assert_array_equal(got["y"].view(np.uint16), want_y.view(np.uint16))


# --- Clip --------------------------------------------------------------------

def test_clip_attribute_and_input_forms(kiln):
    x = f32(3, 4)
    x[0, 0] = np.inf
    x[0, 1] = np.nan
    lo = np.array(-0.5, np.float32)
    hi = np.array(1.25, np.float32)
    # opsets 6..10 (Clip-6): attributes, with float-limit defaults
    got6 = kiln.run([node("Clip", ["x"], ["both"], min=-1.0, max=0.5),
                     node("Clip", ["x"], ["lo_only"], min=0.0)], {"x": x}, ["both", "lo_only"],
                    opset=10)
    check(got6["both"], np.clip(x, -1.0, 0.5), name="Clip-6")
    check(got6["lo_only"], np.clip(x, 0.0, np.finfo(np.float32).max), name="Clip-6 min only")
    got = kiln.run([node("Clip", ["x", "lo", "hi"], ["both"]),
                    node("Clip", ["x", "", "hi"], ["hi_only"]),
                    node("Clip", ["x", "lo"], ["lo_only"]),
                    node("Clip", ["x"], ["none"])],
                   {"x": x, "lo": lo, "hi": hi}, ["both", "hi_only", "lo_only", "none"])
    check(got["both"], np.clip(x, lo, hi), name="Clip min max")
    check(got["hi_only"], np.minimum(x, hi), name="Clip max")
    check(got["lo_only"], np.maximum(x, lo), name="Clip min")
    check(got["none"], x, name="Clip none")
    assert np.isnan(got["both"][0, 1])


def test_clip_integers(kiln):
    x = RNG.integers(-100, 100, size=(10,)).astype(np.int64)
    x8 = x.astype(np.int8)
    got = kiln.run([node("Clip", ["x", "lo", "hi"], ["y"]),
                    node("Clip", ["x8", "", "hi8"], ["y8"])],
                   {"x": x, "lo": np.array(-10, np.int64), "hi": np.array(20, np.int64),
                    "x8": x8, "hi8": np.array(5, np.int8)}, ["y", "y8"])
    check(got["y"], np.clip(x, -10, 20), name="Clip int64")
    check(got["y8"], np.minimum(x8, 5), name="Clip int8")


# --- Softmax, LogSoftmax ------------------------------------------------------

def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _softmax_2d(x, axis):
    """Softmax before opset 13: flatten to [prod(d[:axis]), prod(d[axis:])]."""
    n = int(np.prod(x.shape[:axis]))
    return _softmax(x.reshape(n, -1), 1).reshape(x.shape)


def test_softmax_opset11_flattens_around_axis(kiln):
    x = f32(2, 3, 4).astype(np.float32) * 3
    got = kiln.run([node("Softmax", ["x"], ["d"]), node("Softmax", ["x"], ["a0"], axis=0),
                    node("Softmax", ["x"], ["a2"], axis=2),
                    node("LogSoftmax", ["x"], ["ld"]),
                    node("LogSoftmax", ["x"], ["lneg"], axis=-2)],
                   {"x": x}, ["d", "a0", "a2", "ld", "lneg"], opset=11)
    x64 = x.astype(np.float64)
    check(got["d"], _softmax_2d(x64, 1).astype(np.float32), name="Softmax-11 default")
    check(got["a0"], _softmax_2d(x64, 0).astype(np.float32), name="Softmax-11 axis 0")
    check(got["a2"], _softmax_2d(x64, 2).astype(np.float32), name="Softmax-11 axis 2")
    check(got["ld"], np.log(_softmax_2d(x64, 1)).astype(np.float32), name="LogSoftmax-11")
    check(got["lneg"], np.log(_softmax_2d(x64, 1)).astype(np.float32), name="LogSoftmax-11 -2")


def test_softmax_opset13_runs_over_one_axis(kiln):
    x = f32(2, 3, 4) * 5
    x[1, 2, :] += 1000.0          # large values must not overflow
    xd = RNG.normal(size=(3, 5))
    got = kiln.run([node("Softmax", ["x"], ["d"]), node("Softmax", ["x"], ["a1"], axis=1),
                    node("Softmax", ["x"], ["a0"], axis=0),
                    node("LogSoftmax", ["x"], ["l1"], axis=1),
                    node("LogSoftmax", ["x"], ["ld"]), node("Softmax", ["xd"], ["dd"])],
                   {"x": x, "xd": xd}, ["d", "a1", "a0", "l1", "ld", "dd"])
    xt = t(x.astype(np.float64))
    check(got["d"], torch.softmax(xt, -1).float().numpy(), name="Softmax-13 default")
    check(got["a1"], torch.softmax(xt, 1).float().numpy(), name="Softmax-13 axis 1")
    check(got["a0"], torch.softmax(xt, 0).float().numpy(), name="Softmax-13 axis 0")
    check(got["l1"], torch.log_softmax(xt, 1).float().numpy(), rtol=1e-5, atol=1e-5,
          name="LogSoftmax-13 axis 1")
    check(got["ld"], torch.log_softmax(xt, -1).float().numpy(), rtol=1e-5, atol=1e-5,
          name="LogSoftmax-13 default")
    check(got["dd"], _softmax(xd, -1), rtol=1e-12, atol=0, name="Softmax float64")


# --- reductions ---------------------------------------------------------------

def _logsumexp(x, axis, keepdims):
    m = np.max(x, axis=axis, keepdims=True)
    r = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return r if keepdims else np.squeeze(r, axis=axis)


REDUCERS = {
    "ReduceSum": lambda x, a, k: np.sum(x, axis=a, keepdims=k),
    "ReduceMean": lambda x, a, k: np.mean(x, axis=a, keepdims=k),
    "ReduceMax": lambda x, a, k: np.max(x, axis=a, keepdims=k),
    "ReduceMin": lambda x, a, k: np.min(x, axis=a, keepdims=k),
    "ReduceProd": lambda x, a, k: np.prod(x, axis=a, keepdims=k),
    "ReduceL1": lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k),
    "ReduceL2": lambda x, a, k: np.sqrt(np.sum(x * x, axis=a, keepdims=k)),
    "ReduceSumSquare": lambda x, a, k: np.sum(x * x, axis=a, keepdims=k),
    "ReduceLogSum": lambda x, a, k: np.log(np.sum(x, axis=a, keepdims=k)),
    "ReduceLogSumExp": _logsumexp,
}

# (axes attribute or None, keepdims)
AXES = [([1], 1), ([0, 2], 0), ([-1], 0), (None, 1), (None, 0), ([0, 1, 2], 1),
        ([0, 3], 1), ([1, 2], 0)]


@pytest.mark.parametrize("opset", [11, 13])
def test_reductions_with_axes_attribute(kiln, opset):
    x = (np.abs(f32(2, 3, 4, 5)) + 0.5).astype(np.float32)  # positive for ReduceLogSum
    nodes, outs, want = [], [], {}
    for op, fn in REDUCERS.items():
        for k, (axes, keep) in enumerate(AXES):
            attrs = {"keepdims": keep}
            if axes is not None:
                attrs["axes"] = axes
            if op == "ReduceSum" and opset >= 13:
                continue       # axes is an input there; see the next test
            name = f"{op}_{k}"
            nodes.append(node(op, ["x"], [name], **attrs))
            outs.append(name)
            a = None if axes is None else tuple(v % 4 for v in axes)
            want[name] = np.asarray(fn(x.astype(np.float64), a, bool(keep)))
    got = kiln.run(nodes, {"x": x}, outs, opset=opset)
    for name in outs:
        check(got[name], want[name].astype(np.float32), rtol=2e-5, atol=1e-5, name=name)


def test_reduce_sum_axes_input_and_noop(kiln):
    x = f32(2, 3, 4)
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [0, -1])
    empty = helper.make_tensor("none", TensorProto.INT64, [0], [])
    got = kiln.run([node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
                    node("ReduceSum", ["x", "none"], ["all"]),
                    node("ReduceSum", ["x"], ["all2"], keepdims=0),
                    node("ReduceSum", ["x", "none"], ["noop"], noop_with_empty_axes=1),
                    node("ReduceSum", ["x"], ["noop2"], noop_with_empty_axes=1)],
                   {"x": x}, ["s", "all", "all2", "noop", "noop2"], opset=13,
                   initializers=[axes, empty])
    x64 = x.astype(np.float64)
    check(got["s"], x64.sum(axis=(0, 2)).astype(np.float32), name="axes input")
    check(got["all"], x64.sum(keepdims=True).astype(np.float32), name="empty axes")
    check(got["all2"], np.asarray(x64.sum(), np.float32), name="no axes, keepdims 0")
    check(got["noop"], x, name="noop_with_empty_axes")
    check(got["noop2"], x, name="noop_with_empty_axes, no axes input")


@pytest.mark.parametrize("dt", [np.int64, np.int32])
def test_integer_reductions(kiln, dt):
    x = RNG.integers(-20, 20, size=(3, 4, 2)).astype(dt)
    ops = ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"]
    got = kiln.run([node(op, ["x"], [op], axes=[1], keepdims=0) for op in ops],
                   {"x": x}, ops, opset=11)
    check(got["ReduceSum"], x.sum(axis=1, dtype=dt), name="ReduceSum int")
    check(got["ReduceMax"], x.max(axis=1), name="ReduceMax int")
    check(got["ReduceMin"], x.min(axis=1), name="ReduceMin int")
    check(got["ReduceProd"], x.prod(axis=1, dtype=dt), name="ReduceProd int")


def test_reduce_max_propagates_nan_and_logsumexp_handles_large_values(kiln):
    x = f32(3, 4)
    x[1, 2] = np.nan
    y = np.array([[1000.0, 1000.0, -1000.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    got = kiln.run([node("ReduceMax", ["x"], ["mx"], axes=[1], keepdims=0),
                    node("ReduceLogSumExp", ["y"], ["lse"], axes=[1], keepdims=0)],
                   {"x": x, "y": y}, ["mx", "lse"])
    assert np.isnan(got["mx"][1]) and not np.isnan(got["mx"][[0, 2]]).any()
    check(got["lse"], np.array([1000.0 + math.log(2.0), -np.inf], np.float32), name="LSE")


# --- ArgMax, ArgMin -----------------------------------------------------------

def test_argmax_argmin_axis_keepdims_and_select_last_index(kiln):
    x = RNG.integers(0, 3, size=(3, 4, 5)).astype(np.float32)   # many ties
    xi = RNG.integers(-3, 3, size=(4, 6)).astype(np.int32)
    nodes, outs, want = [], [], {}
    for op, fn in (("ArgMax", np.argmax), ("ArgMin", np.argmin)):
        for axis in (0, 1, -1):
            for keep in (0, 1):
                for last in (0, 1):
                    name = f"{op}_{axis}_{keep}_{last}"
                    nodes.append(node(op, ["x"], [name], axis=axis, keepdims=keep,
                                      select_last_index=last))
                    outs.append(name)
                    if last:
                        flipped = np.flip(x, axis=axis)
                        r = x.shape[axis] - 1 - fn(flipped, axis=axis)
                    else:
                        r = fn(x, axis=axis)
                    if keep:
                        r = np.expand_dims(r, axis)
                    want[name] = r.astype(np.int64)
        nodes.append(node(op, ["xi"], [f"{op}_int"]))
        outs.append(f"{op}_int")
        want[f"{op}_int"] = np.expand_dims(fn(xi, axis=0), 0).astype(np.int64)
    got = kiln.run(nodes, {"x": x, "xi": xi}, outs, opset=13)
    for name in outs:
        check(got[name], want[name], name=name)


# --- normalisations -----------------------------------------------------------

@pytest.mark.parametrize("opset", [9, 15])
def test_batch_normalization_matches_torch_eval(kiln, opset):
    x = f32(2, 3, 4, 5)
    scale, bias = f32(3), f32(3)
    mean, var = f32(3), np.abs(f32(3)) + 0.1
    x3 = f32(2, 3, 7)
    got = kiln.run([node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3),
                    node("BatchNormalization", ["x3", "s", "b", "m", "v"], ["y3"])],
                   {"x": x, "s": scale, "b": bias, "m": mean, "v": var, "x3": x3},
                   ["y", "y3"], opset=opset)
    want = F.batch_norm(t(x), t(mean), t(var), t(scale), t(bias), False, 0.0, 1e-3)
    want3 = F.batch_norm(t(x3), t(mean), t(var), t(scale), t(bias), False, 0.0, 1e-5)
    check(got["y"], want.numpy(), rtol=1e-5, atol=1e-5, name="BatchNormalization")
    check(got["y3"], want3.numpy(), rtol=1e-5, atol=1e-5, name="BatchNormalization rank 3")


def test_instance_normalization_matches_torch(kiln):
    x = f32(2, 3, 4, 5)
    scale, bias = f32(3), f32(3)
    got = kiln.run([node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-4)],
                   {"x": x, "s": scale, "b": bias}, ["y"])
    want = F.instance_norm(t(x), weight=t(scale), bias=t(bias), eps=1e-4)
    check(got["y"], want.numpy(), rtol=1e-5, atol=1e-5, name="InstanceNormalization")


def _layer_norm(x, axis, scale, bias, eps):
    axes = tuple(range(axis, x.ndim))
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(var + eps)
    y = (x64 - mean) * inv * scale
    if bias is not None:
        y = y + bias
    return y.astype(np.float32), mean.astype(np.float32), inv.astype(np.float32)


def test_layer_normalization_axes_and_statistics(kiln):
    x = f32(2, 3, 4) * 2 + 1
    s_last, b_last = f32(4), f32(4)
    s_mid, b_mid = f32(3, 4), f32(3, 4)
    got = kiln.run([node("LayerNormalization", ["x", "sl", "bl"], ["y_last"]),
                    node("LayerNormalization", ["x", "sm", "bm"], ["y_mid", "mean", "inv"],
                         axis=1, epsilon=1e-3),
                    node("LayerNormalization", ["x", "sl"], ["y_nob", "mean2"], axis=-1),
                    node("LayerNormalization", ["x", "sl", ""], ["y_nob2", "", "inv2"])],
                   {"x": x, "sl": s_last, "bl": b_last, "sm": s_mid, "bm": b_mid},
                   ["y_last", "y_mid", "mean", "inv", "y_nob", "mean2", "y_nob2", "inv2"],
                   opset=17)
    y, _, _ = _layer_norm(x, 2, s_last, b_last, 1e-5)
    check(got["y_last"], y, rtol=1e-5, atol=1e-5, name="LayerNormalization axis -1")
    want = F.layer_norm(t(x), (4,), t(s_last), t(b_last), 1e-5).numpy()
    check(got["y_last"], want, rtol=1e-5, atol=1e-5, name="LayerNormalization vs torch")
    y, mean, inv = _layer_norm(x, 1, s_mid, b_mid, 1e-3)
    check(got["y_mid"], y, rtol=1e-5, atol=1e-5, name="LayerNormalization axis 1")
    check(got["mean"], mean, name="LayerNormalization Mean")
    check(got["inv"], inv, rtol=1e-5, name="LayerNormalization InvStdDev")
    y, mean, _ = _layer_norm(x, 2, s_last, None, 1e-5)
    check(got["y_nob"], y, rtol=1e-5, atol=1e-5, name="LayerNormalization no bias")
    check(got["mean2"], mean, name="LayerNormalization Mean without InvStdDev")
    y, _, inv = _layer_norm(x, 2, s_last, None, 1e-5)
    check(got["y_nob2"], y, rtol=1e-5, atol=1e-5, name="LayerNormalization B absent")
    check(got["inv2"], inv, rtol=1e-5, name="LayerNormalization InvStdDev without Mean")


def _lrn(x, size, alpha, beta, bias):
    """ONNX's LRN: the window of channel c is c - floor((size-1)/2) ..
    c + ceil((size-1)/2) (PyTorch centres even sizes the other way)."""
    c = x.shape[1]
    sq = np.zeros_like(x, dtype=np.float64)
    for i in range(c):
        lo, hi = max(0, i - (size - 1) // 2), min(c - 1, i + math.ceil((size - 1) / 2))
        sq[:, i] = (x[:, lo:hi + 1].astype(np.float64) ** 2).sum(axis=1)
    return (x / (bias + alpha / size * sq) ** beta).astype(np.float32)


@pytest.mark.parametrize("size", [1, 3, 4])
def test_lrn_matches_onnx_definition_and_torch(kiln, size):
    x = f32(2, 6, 3, 3)
    got = kiln.run([node("LRN", ["x"], ["y"], size=size, alpha=1e-2, beta=0.75, bias=2.0)],
                   {"x": x}, ["y"])
    check(got["y"], _lrn(x, size, 1e-2, 0.75, 2.0), rtol=1e-5, atol=1e-6,
          name=f"LRN size {size}")
    if size % 2:
        want = F.local_response_norm(t(x), size, alpha=1e-2, beta=0.75, k=2.0)
        check(got["y"], want.numpy(), rtol=1e-5, atol=1e-6, name=f"LRN size {size} torch")


def test_small_network_of_math_ops_matches_torch(kiln):
    """A transformer-ish block: LayerNorm, matmul, GELU through Erf,
    softmax, residual, mean pooling."""
    x = f32(2, 5, 8)
    w = f32(8, 8) * 0.3
    nodes = [node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1),
             node("MatMul", ["ln", "w"], ["h"]),
             node("Div", ["h", "sqrt2"], ["hs"]), node("Erf", ["hs"], ["erf"]),
             node("Add", ["erf", "one"], ["e1"]), node("Mul", ["h", "e1"], ["he"]),
             node("Mul", ["he", "half"], ["gelu"]),
             node("Softmax", ["gelu"], ["sm"], axis=-1),
             node("Add", ["sm", "x"], ["res"]),
             node("ReduceMean", ["res"], ["pool"], axes=[1], keepdims=0)]
    inputs = {"x": x, "g": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "w": w,
              "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32),
              "half": np.array(0.5, np.float32)}
    got = kiln.run(nodes, inputs, ["pool"], opset=17)
    xt = t(x)
    h = F.layer_norm(xt, (8,)) @ t(w)
    want = (torch.softmax(F.gelu(h), -1) + xt).mean(1)
    check(got["pool"], want.numpy(), rtol=1e-4, atol=1e-5, name="block")


# --- refusals -----------------------------------------------------------------

def test_dtype_mismatch_is_refused_naming_node_and_inputs(kiln):
    err = kiln.refusal([node("Add", ["a", "b"], ["y"])],
                       {"a": f32(2), "b": np.zeros(2, np.int64)}, ["y"])
    assert "add_y" in err and "'a' is float32" in err and "'b' is int64" in err


def test_bad_axis_is_refused_naming_node(kiln):
    err = kiln.refusal([node("ReduceMean", ["x"], ["y"], axes=[3])], {"x": f32(2, 3)}, ["y"])
    assert "reducemean_y" in err and "axis 3" in err
    err = kiln.refusal([node("Softmax", ["x"], ["y"], axis=2)], {"x": f32(2, 3)}, ["y"])
    assert "softmax_y" in err and "axis" in err
    err = kiln.refusal([node("ArgMax", ["x"], ["y"], axis=-3)], {"x": f32(2, 3)}, ["y"])
    assert "argmax_y" in err and "'axis'" in err


def test_unsupported_cases_are_clean_refusals(kiln):
    err = kiln.refusal([node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"],
                             training_mode=1)],
                       {"x": f32(2, 3), "s": f32(3), "b": f32(3), "m": f32(3), "v": f32(3)},
                       ["y"], opset=15)
    assert "training_mode" in err and "batchnormalization_y" in err
    err = kiln.refusal([node("Sqrt", ["x"], ["y"])], {"x": np.zeros(3, np.int64)}, ["y"])
    assert "int64" in err and "sqrt_y" in err
    err = kiln.refusal([node("ReduceSum", ["x", "ax"], ["y"])],
                       {"x": f32(2, 3), "ax": np.array([1], np.int64)}, ["y"])
    assert "run time" in err and "reducesum_y" in err
    # Dropout in training mode drops elements: not the identity.
    true = helper.make_tensor("tm", TensorProto.BOOL, [], [True])
    err = kiln.refusal([node("Dropout", ["x", "", "tm"], ["y"])], {"x": f32(3)}, ["y"],
                       initializers=[true])
    assert "training_mode" in err and "dropout_y" in err
    err = kiln.refusal([node("Dropout", ["x", "", "tm"], ["y"])],
                       {"x": f32(3), "tm": np.array(False)}, ["y"])
    assert "training_mode" in err
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    err = kiln.refusal([node("Dropout", ["x", "half", "tm"], ["y"])], {"x": f32(3)}, ["y"],
                       initializers=[true, half])
    assert "training_mode" in err and "ratio" in err
    err = kiln.refusal([node("Where", ["c", "x", "y"], ["w"])],
                       {"c": np.ones(3, np.float32), "x": f32(3), "y": f32(3)}, ["w"])
    assert "'c' is float32" in err and "bool" in err
