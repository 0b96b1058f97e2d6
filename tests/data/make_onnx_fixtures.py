#!/usr/bin/python3
"""Generate the ONNX fixtures used by tests/unit/test_onnx.c.

Run from the repository root with Debian's Python (torch, onnx, numpy):

    /usr/bin/python3 tests/data/make_onnx_fixtures.py

It rewrites tests/data/onnx/*.onnx and tests/data/onnx/weights.txt.  The
models are tiny (a few KB each) and committed, so the C tests need no
Python.  Weights come from fixed seeds or fixed values, so running the
script again gives the same tensors; the protobuf bytes may still differ
between torch versions (producer strings, node names), which is why the
tests compare weights through weights.txt rather than file checksums.

weights.txt has one line per initializer or Constant the importer must
turn into a weight, in the form

    <model file> <tensor name> <dtype> <dims, comma-separated or "scalar"> <sha256 of the little-endian bytes>

and the C test checks each imported weight against it.
"""

import hashlib
import io
import os
import sys

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onnx")
OPSET = 13

weight_lines = []


def dims_text(shape):
    return ",".join(str(d) for d in shape) if len(shape) else "scalar"


def record_weight(model_file, name, array):
    """Remember the bytes kiln must hold for a weight (little-endian)."""
    # copy(order="C") keeps 0-d arrays 0-d (np.ascontiguousarray would not).
    array = np.asarray(array).copy(order="C")
    data = array.astype(array.dtype.newbyteorder("<")).tobytes()
    weight_lines.append("%s %s %s %s %s" % (
        model_file, name, array.dtype.name, dims_text(array.shape),
        hashlib.sha256(data).hexdigest()))


def record_initializers(model_file, model):
    """Initializers, and Constant nodes holding a tensor (torch emits those
    for Python scalars such as the 2 in `2 * x`)."""
    for init in model.graph.initializer:
        record_weight(model_file, init.name, numpy_helper.to_array(init))
    for node in model.graph.node:
        if node.op_type == "Constant":
            (attr,) = node.attribute
            assert attr.name == "value", attr.name
            record_weight(model_file, node.output[0], numpy_helper.to_array(attr.t))


def save(model_file, model, check=True):
    if check:
        onnx.checker.check_model(model)
    data = model.SerializeToString()
    if len(data) > 50 * 1024:
        sys.exit("%s is %d bytes; keep fixtures under 50 KB" % (model_file, len(data)))
    with open(os.path.join(OUT, model_file), "wb") as f:
        f.write(data)


def export_torch(model_file, module, args, record=True, **kwargs):
    """torch.onnx.export as kiln.trace does it, then save and record."""
    module.eval()
    buf = io.BytesIO()
    torch.onnx.export(module, args, buf, opset_version=OPSET, **kwargs)
    model = onnx.load_from_string(buf.getvalue())
    save(model_file, model)
    if record:
        record_initializers(model_file, model)
    return model


# --- models traced by torch ------------------------------------------

class AddMul(torch.nn.Module):
    def forward(self, x, y):
        return 2 * x + y


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 3)
        with torch.no_grad():
            # Fixed, exactly representable values so that the C test can
            # check them one by one: weight[k] = k / 8, bias = 0.5.
            self.conv.weight.copy_(torch.arange(9, dtype=torch.float32).reshape(1, 1, 3, 3) / 8)
            self.conv.bias.fill_(0.5)

    def forward(self, x):
        return self.conv(x)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.gap = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv(x)))
        return self.fc(torch.flatten(self.gap(x), 1))


def torch_models():
    torch.manual_seed(0)
    export_torch("add_mul.onnx", AddMul(), (torch.randn(2, 3), torch.randn(2, 3)),
                 input_names=["x", "y"], output_names=["z"])
    export_torch("conv.onnx", Conv(), (torch.randn(1, 1, 5, 5),),
                 input_names=["x"], output_names=["y"])
    export_torch("mlp.onnx", Mlp(), (torch.randn(3, 4),),
                 input_names=["x"], output_names=["y"])
    export_torch("cnn.onnx", Cnn(), (torch.randn(1, 1, 8, 8),),
                 input_names=["x"], output_names=["y"])
    # Older exporters list every initializer among the graph inputs too.
    export_torch("mlp_init_inputs.onnx", Mlp(), (torch.randn(3, 4),),
                 input_names=["x"], output_names=["y"],
                 keep_initializers_as_inputs=True)
    # A dynamic batch dimension: kiln must refuse it and name it.
    export_torch("symbolic_batch.onnx", Mlp(), (torch.randn(3, 4),),
                 input_names=["x"], output_names=["y"],
                 dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, record=False)


# --- models written with onnx.helper -----------------------------------

def opsets(version=OPSET, extra=()):
    return [helper.make_opsetid("", version)] + [helper.make_opsetid(d, 1) for d in extra]


def unsupported_ops():
    """Two NonZero and one Unique: one error must list both, with counts."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz1"], name="nz1"),
        helper.make_node("NonZero", ["x"], ["nz2"], name="nz2"),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Unique", ["r"], ["y"], name="uniq"),
    ]
    g = helper.make_graph(nodes, "unsupported", [x], [y])
    save("unsupported_ops.onnx", helper.make_model(g, opset_imports=opsets()))


def custom_domain():
    """An op from another domain is unsupported and named with it."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    nodes = [helper.make_node("FusedMatMul", ["a", "a"], ["y"], name="fmm",
                              domain="com.microsoft")]
    g = helper.make_graph(nodes, "custom", [a], [y])
    save("custom_domain.onnx",
         helper.make_model(g, opset_imports=opsets(extra=["com.microsoft"])), check=False)


# One array per dtype kiln accepts for weights, with values that show a
# byte-order or width mistake (negative numbers, values above 127, NaN-free
# floats that are not integers).
TYPED_ARRAYS = [
    ("w_f32", np.array([[1.5, -2.25, 3.0], [0.125, -0.0, 1e-3]], dtype=np.float32)),
    ("w_f64", np.array([3.141592653589793, -1e300], dtype=np.float64)),
    ("w_i64", np.array([-1, 1 << 40, 7], dtype=np.int64)),
    ("w_i32", np.array([-5, 1 << 30], dtype=np.int32)),
    ("w_u8", np.array([0, 200, 255], dtype=np.uint8)),
    ("w_i8", np.array([-128, 5, 127], dtype=np.int8)),
    ("w_bool", np.array([True, False, True, True], dtype=np.bool_)),
    ("w_scalar", np.array(42.0, dtype=np.float32)),
]


def typed_weights(model_file, raw):
    """Each initializer through Identity, stored in raw_data or typed fields."""
    inits, nodes, outputs = [], [], []
    for name, arr in TYPED_ARRAYS:
        dt = onnx.mapping.NP_TYPE_TO_TENSOR_TYPE[arr.dtype]
        if raw:
            t = numpy_helper.from_array(arr, name)
        else:
            # make_tensor with raw=False fills float_data / int32_data /
            # int64_data / double_data as the spec says for each dtype.
            t = helper.make_tensor(name, dt, arr.shape, arr.flatten().tolist(), raw=False)
        assert t.HasField("raw_data") == raw, name
        inits.append(t)
        nodes.append(helper.make_node("Identity", [name], ["out_" + name], name="id_" + name))
        outputs.append(helper.make_tensor_value_info("out_" + name, dt, arr.shape))
        record_weight(model_file, name, arr)
    g = helper.make_graph(nodes, "typed", [], outputs, initializer=inits)
    save(model_file, helper.make_model(g, opset_imports=opsets()))


def constants():
    """Constant nodes in each attribute form become weights, not nodes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])
    bias = np.array([0.25, -4.0], dtype=np.float32)
    nodes = [
        helper.make_node("Constant", [], ["shape"], value_ints=[3, 2]),
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Constant", [], ["bias"], value=numpy_helper.from_array(bias, "b")),
        helper.make_node("Constant", [], ["ones"], value_floats=[1.0, 1.0]),
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Mul", ["r", "two"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "bias"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "ones"], ["y"], name="mul_ones"),
    ]
    g = helper.make_graph(nodes, "constants", [x], [y])
    save("constants.onnx", helper.make_model(g, opset_imports=opsets()))
    record_weight("constants.onnx", "shape", np.array([3, 2], dtype=np.int64))
    record_weight("constants.onnx", "two", np.array(2.0, dtype=np.float32))
    record_weight("constants.onnx", "bias", bias)
    record_weight("constants.onnx", "ones", np.array([1.0, 1.0], dtype=np.float32))


def dropout():
    """Dropout at inference is the identity; its optional inputs are absent."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Dropout", ["x", "", ""], ["d"], name="drop"),
        helper.make_node("Relu", ["d"], ["y"], name="relu"),
    ]
    g = helper.make_graph(nodes, "dropout", [x], [y])
    save("dropout.onnx", helper.make_model(g, opset_imports=opsets()))


def external_data():
    """An initializer whose bytes live in another file, which is not there."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    w = numpy_helper.from_array(np.ones(4, dtype=np.float32), "big_weight")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "big_weight.bin"), ("offset", "0"), ("length", "16")):
        e = w.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Add", ["x", "big_weight"], ["y"])],
                          "external", [x], [y], initializer=[w])
    save("external_data.onnx", helper.make_model(g, opset_imports=opsets()), check=False)


def opset_out_of_range():
    """Opset 6's Add broadcast by its `broadcast` attribute, not numpy's
    rules: kiln refuses it (a Relu at opset 6 is opset 7's and imports)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Add", ["r", "x"], ["y"])], "old", [x], [y])
    save("opset6.onnx", helper.make_model(g, opset_imports=opsets(6)), check=False)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch_models()
    unsupported_ops()
    custom_domain()
    typed_weights("typed_raw.onnx", raw=True)
    typed_weights("typed_fields.onnx", raw=False)
    constants()
    dropout()
    external_data()
    opset_out_of_range()
    with open(os.path.join(OUT, "weights.txt"), "w") as f:
        f.write("# generated by tests/data/make_onnx_fixtures.py; "
                "model tensor dtype dims sha256\n")
        for line in weight_lines:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
