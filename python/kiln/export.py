"""From a torch function to ONNX bytes that kiln imports.

Three things make an export that works wherever torch.jit.trace works:

  - The call is wrapped so that the traced function takes and returns a
    flat list of tensors (kiln.structure keeps the nesting): dict inputs,
    keyword inputs and nested tuple/dict outputs all trace.
  - torch 1.13 has inference fast paths (nn.MultiheadAttention's
    aten::_native_multi_head_attention, nn.TransformerEncoderLayer's
    aten::_transformer_encoder_layer_fwd) that exist only for eager speed
    and have no ONNX form.  They are taken only when autograd is off or no
    parameter requires a gradient, so the trace runs with grad enabled and
    every parameter requiring grad (restored afterwards): the same
    numbers, through the decomposed ops.
  - The ONNX opset is the highest torch 1.13 exports reliably, 17
    (LayerNormalization, triu, grid_sample all have forms there), and the
    user may choose another with `--opset N` in compiler_args or
    KILN_CC_FLAGS.
"""

import contextlib
import gc
import io
import re
import traceback
import warnings

import torch

from . import errors, structure

DEFAULT_OPSET = 17
MIN_OPSET, MAX_OPSET = 13, 17


class TraceFlags:
    """What kiln.trace itself reads from compiler_args and KILN_CC_FLAGS,
    as torch-neuron reads seed 003's special flags from NEURON_CC_FLAGS:

      --opset N             the ONNX opset of the export (13..17, default 17)
      --workdir DIR         acts as compiler_workdir
      --dynamic-batch-size  the module comes back with dynamic batching on
      --extract-weights     accepted: a kiln artifact always keeps the
                            weights out of the program, as their own member

    They decide the export and the module, not the compiler, so they are
    taken out of the arguments the compiler sees."""

    def __init__(self):
        self.opset = DEFAULT_OPSET
        self.workdir = None
        self.dynamic_batch = False
        self.extract_weights = False

    @classmethod
    def take(cls, args):
        """(TraceFlags, the other args)."""
        flags, rest = cls(), []
        i = 0
        while i < len(args):
            a = args[i]
            name, value = a, None
            if "=" in a and a.startswith("--"):
                name, value = a.split("=", 1)
            if name in ("--opset", "--workdir"):
                if value is None:
                    if i + 1 >= len(args):
                        raise ValueError(f"compiler argument {name} needs a value")
                    value, i = args[i + 1], i + 2
                else:
                    i += 1
                if name == "--opset":
                    flags.opset = _opset(value)
                else:
                    flags.workdir = value
                continue
            if name in ("--dynamic-batch-size", "--extract-weights"):
                if value is not None:
                    raise ValueError(f"compiler argument {name} takes no value")
                if name == "--dynamic-batch-size":
                    flags.dynamic_batch = True
                else:
                    flags.extract_weights = True
                i += 1
                continue
            rest.append(a)
            i += 1
        return flags, rest


def _opset(value):
    try:
        opset = int(value)
    except ValueError:
        raise ValueError(f"compiler argument --opset {value!r}: not a number") from None
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"compiler argument --opset {opset}: torch "
                         f"{torch.__version__.split('+')[0]} exports ONNX opsets "
                         f"{MIN_OPSET} to {MAX_OPSET} reliably")
    return opset


class FlatCall(torch.nn.Module):
    """`func` called as the user calls it, seen as flat tensors: forward
    takes the tensors of (args, kwargs) in structure order and returns
    the output's tensors in structure order."""

    def __init__(self, func, in_structure):
        super().__init__()
        self.in_structure = in_structure
        # A module (or the owner of a bound method) is registered so that
        # its parameters are the traced module's.
        if isinstance(func, torch.nn.Module):
            self.inner = func
            self._call = None
        else:
            owner = getattr(func, "__self__", None)
            if isinstance(owner, torch.nn.Module):
                self.inner = owner
            self._call = func
        self.out_structure = None

    def forward(self, *flat):
        value = structure.unflatten(self.in_structure, flat)
        args, kwargs = value["args"], value["kwargs"]
        fn = self._call if self._call is not None else self.inner
        out = fn(*args, **kwargs)
        leaves, self.out_structure = structure.flatten(out, "the model's output")
        return tuple(leaves)


@contextlib.contextmanager
def no_fast_paths(module):
    """Grad enabled and every parameter of `module` requiring grad, so
    that torch's eager-only fused inference kernels are not taken."""
    params = list(module.parameters()) if module is not None else []
    saved = [p.requires_grad for p in params]
    try:
        for p in params:
            if p.is_floating_point() or p.is_complex():
                p.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for p, r in zip(params, saved):
            p.requires_grad_(r)


def jit_trace(wrapper, flat_inputs):
    """torch.jit.trace of `wrapper` on `flat_inputs`, fast paths off.
    Falls back to a trace without grad when a model cannot run with it
    (an in-place update of a parameter, say)."""
    try:
        with no_fast_paths(wrapper), warnings.catch_warnings():
            # The decomposed attention's shape checks warn from inside
            # torch; the user's own code still warns as it would.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning,
                                    module=r"torch\.")
            return torch.jit.trace(wrapper, tuple(flat_inputs), check_trace=False,
                                   strict=False)
    except RuntimeError as e:
        if "requires grad" not in str(e) and "leaf Variable" not in str(e):
            raise
        # the failed trace's frames hold wrappers of its graph (export_onnx)
        traceback.clear_frames(e.__traceback__)
    gc.collect()
    with torch.no_grad():
        return torch.jit.trace(wrapper, tuple(flat_inputs), check_trace=False,
                               strict=False)


_ATEN_RE = re.compile(r"'((?:aten|prim|quantized|torchvision)::[\w.]+)'")


# Models whose parameters reach this many bytes are exported to a file:
# past 2 GB protobuf cannot hold them, and torch then writes their tensors
# as ONNX external data beside the file (which kiln imports, confined to
# that directory).
EXTERNAL_DATA_BYTES = 1 << 30


def parameter_bytes(module):
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size()
               for t in list(module.parameters()) + list(module.buffers()))


def _refusal(e, opset):
    """A kiln.UnsupportedOperatorError for torch's export exception `e`
    when an op is what torch cannot export (naming it, e.ops, and what to
    do), else None."""
    text = str(e)
    ops = {m: 1 for m in _ATEN_RE.findall(text)}
    later = re.search(r"added in version (\d+)", text)
    hint = ""
    if later and int(later.group(1)) <= MAX_OPSET:
        hint = (f"; torch exports it from opset {later.group(1)}: pass "
                f"compiler_args=['--opset', '{later.group(1)}']")
    elif ops:
        hint = "; kiln.trace runs such an op on the CPU unless fallback=False"
    if not (ops or type(e).__name__ == "UnsupportedOperatorError" or "not supported" in text):
        return None
    what = ", ".join(ops) or "an operator"
    first = text.splitlines()[0] if text else ""
    return errors.UnsupportedOperatorError(
        f"torch cannot export {what} to ONNX opset {opset}: "
        f"{first or type(e).__name__}{hint}", ops=ops, reasons=[f"export: {first}"])


def export_onnx(traced, flat_inputs, input_names, output_names, opset, path=None):
    """ONNX bytes of a traced module; with `path`, exported to that file
    (torch puts a model over 2 GB's tensors in external data files beside
    it) and the model file's bytes returned.  When torch cannot export an
    op, a kiln.UnsupportedOperatorError naming it (e.ops) and what to do."""
    buf = io.BytesIO() if path is None else path
    # torch's exporter hands Python wrappers of its graph's nodes and
    # values around without owning them; one that outlives its graph (in
    # the frames of an earlier export's traceback, until the cyclic
    # collector frees them) is found again by pybind11 when a new graph
    # reuses the address: a segfault or "Unable to cast from non-held to
    # held instance" in a later export (kiln.trace after a refused one,
    # tests/python/test_front_door.py).  So no earlier export's frames
    # are left to collect, and a refused export's are cleared below.
    gc.collect()
    refused = None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(traced, tuple(flat_inputs), buf, input_names=list(input_names),
                              output_names=list(output_names), opset_version=opset,
                              do_constant_folding=True)
        except Exception as e:  # torch raises several types here
            refused = _refusal(e, opset)
            if refused is None:
                raise
            traceback.clear_frames(e.__traceback__)
    if refused is not None:
        # raised here, not in the handler: torch's exception (and the
        # frames it holds) is not kept as this one's __context__
        gc.collect()
        raise refused
    if path is None:
        return buf.getvalue()
    with open(path, "rb") as f:
        return f.read()


def set_metadata(onnx_bytes, key, value):
    """`onnx_bytes` with metadata_props[key] = value."""
    import onnx
    model = onnx.load_from_string(onnx_bytes)
    for p in list(model.metadata_props):
        if p.key == key:
            model.metadata_props.remove(p)
    entry = model.metadata_props.add()
    entry.key, entry.value = key, value
    return model.SerializeToString()
