"""ctypes bindings to build/lib/libkilnclient.so, for the conformance
harness: import an ONNX model, compile it locally into a signed artifact,
load the artifact with the runtime and run it, all in one process.

Only what the harness needs is bound.  The struct layouts below mirror
common/kiln_error.h, common/kiln_dtype.h, artifact/kiln_artifact.h,
client/kiln_client.h and runtime/kiln_rt.h; their array sizes are read
from the headers in the source tree (KILN_SRC) so that a changed limit
cannot silently shift a field, and KilnLib checks the loaded manifest for
sanity (format version, runtime ABI, target string) so that a changed
layout fails loudly instead of producing garbage.
"""

import ctypes
import os
import re

import numpy as np

# kiln dtype values are ONNX TensorProto.DataType values (kiln_dtype.h).
KILN_TO_NUMPY = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    # numpy has no bfloat16: onnx's numpy_helper carries its bits as
    # uint16 (which is not a kiln dtype), and so does the harness.
    16: np.dtype(np.uint16),
}
NUMPY_TO_KILN = {v: k for k, v in KILN_TO_NUMPY.items()}

KILN_EUNSUPPORTED = 6


class KilnHarnessError(Exception):
    """The bindings do not match the library: a harness problem, not a
    test result."""


def _header_defines(src, relpaths):
    """Integer #defines of the given headers, as a dict."""
    out = {}
    for rel in relpaths:
        with open(os.path.join(src, rel), encoding="utf-8") as f:
            for m in re.finditer(r"^#define\s+(KILN_\w+)\s+\(?\s*(\d+)[A-Za-z]*\s*\)?",
                                 f.read(), re.M):
                out[m.group(1)] = int(m.group(2))
    return out


class KilnLib:
    """libkilnclient.so with the functions the harness calls."""

    def __init__(self, lib_path, src):
        d = _header_defines(src, ["common/kiln_error.h", "common/kiln_limits.h",
                                  "common/kiln_hash.h", "artifact/kiln_artifact.h"])
        try:
            err_max = d["KILN_ERR_MSG_MAX"]
            max_rank = d["KILN_MAX_RANK"]
            max_name = d["KILN_MAX_NAME"]
            hex_len = 2 * d["KILN_DIGEST_LEN"] + 1
            args_bytes = d["KILN_MAX_ARGS_BYTES"]
            self.runtime_abi = d["KILN_RUNTIME_ABI_VERSION"]
            self.format_version = d["KILN_ARTIFACT_FORMAT_VERSION"]
        except KeyError as e:
            raise KilnHarnessError(f"a constant is missing from the headers: {e}")

        class Err(ctypes.Structure):
            _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * err_max)]

        class Shape(ctypes.Structure):
            _fields_ = [("rank", ctypes.c_int), ("dims", ctypes.c_int64 * max_rank)]

        class RtTensor(ctypes.Structure):
            _fields_ = [("dtype", ctypes.c_int), ("shape", Shape),
                        ("data", ctypes.c_void_p)]

        class IO(ctypes.Structure):
            _fields_ = [("name", ctypes.c_char * (max_name + 1)),
                        ("dtype", ctypes.c_int), ("shape", Shape)]

        class Manifest(ctypes.Structure):
            _fields_ = [("format_version", ctypes.c_int),
                        ("graph_digest", ctypes.c_char * hex_len),
                        ("action_key", ctypes.c_char * hex_len),
                        ("compiler_id", ctypes.c_char * 64),
                        ("compiler_version", ctypes.c_char * 64),
                        ("compiler_args", ctypes.c_char * args_bytes),
                        ("target", ctypes.c_char * 64),
                        ("runtime_abi", ctypes.c_int),
                        ("inputs", ctypes.POINTER(IO)), ("n_inputs", ctypes.c_int),
                        ("outputs", ctypes.POINTER(IO)), ("n_outputs", ctypes.c_int)]

        class CompileOpts(ctypes.Structure):
            _fields_ = [("compiler_args", ctypes.c_char_p), ("timeout_ms", ctypes.c_int)]

        class CompileResult(ctypes.Structure):
            _fields_ = [("artifact", ctypes.c_char * hex_len),
                        ("action_key", ctypes.c_char * hex_len),
                        ("graph_digest", ctypes.c_char * hex_len),
                        ("cached", ctypes.c_bool),
                        ("worker", ctypes.c_char * 128),
                        ("signer", ctypes.c_char * 17)]

        self.Err, self.Shape, self.RtTensor = Err, Shape, RtTensor
        self.Manifest, self.CompileResult = Manifest, CompileResult
        self.max_rank = max_rank

        lib = ctypes.CDLL(lib_path)
        vp, cp, ip = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
        perr = ctypes.POINTER(Err)

        def fn(name, restype, *argtypes):
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = list(argtypes)
            return f

        self._import_mem = fn("kiln_onnx_import_mem", vp, cp, ctypes.c_size_t, perr)
        self._graph_destroy = fn("kiln_graph_destroy", None, ctypes.POINTER(vp))
        self._compile_local = fn("kiln_compile_local", ip, vp, ctypes.POINTER(CompileOpts),
                                 cp, cp, ctypes.POINTER(CompileResult), perr)
        self._cc_target = fn("kiln_cc_target", cp)
        self._rt_new = fn("kiln_rt_new", vp, perr)
        self._rt_destroy = fn("kiln_rt_destroy", None, ctypes.POINTER(vp))
        self._rt_load = fn("kiln_rt_load", vp, vp, cp, cp, perr)
        self._model_destroy = fn("kiln_model_destroy", None, ctypes.POINTER(vp))
        self._model_manifest = fn("kiln_model_manifest", ctypes.POINTER(Manifest), vp)
        self._model_run = fn("kiln_model_run", ip, vp, ctypes.POINTER(RtTensor), ip,
                             ctypes.POINTER(RtTensor), ip, perr)
        # Newer runtimes describe a model's interface through functions and
        # report their struct sizes, for bindings like this one: use them
        # when they are there.
        self._io_count = self._io = None
        if hasattr(lib, "kiln_model_io") and hasattr(lib, "kiln_model_io_count"):
            self._io_count = fn("kiln_model_io_count", ip, vp, ip)
            self._io = fn("kiln_model_io", ip, vp, ip, ip, ctypes.POINTER(cp),
                          ctypes.POINTER(ip), ctypes.c_int64 * max_rank, perr)
        for sym, struct in (("kiln_rt_tensor_sizeof", RtTensor), ("kiln_rt_err_sizeof", Err)):
            if hasattr(lib, sym):
                size = fn(sym, ctypes.c_size_t)()
                if size != ctypes.sizeof(struct):
                    raise KilnHarnessError(f"{sym}() is {size}, kilnlib.py's copy of the "
                                           f"struct is {ctypes.sizeof(struct)} bytes")
        self.lib = lib
        self.target = self._cc_target().decode()
        err = Err()
        self.rt = self._rt_new(ctypes.byref(err))
        if not self.rt:
            raise KilnHarnessError(f"kiln_rt_new: {err.msg.decode(errors='replace')}")

    @staticmethod
    def _msg(err):
        return err.msg.decode("utf-8", errors="replace")

    def import_onnx(self, data):
        """Import ONNX bytes.  Returns (graph handle, None) or (None, (code, msg))."""
        err = self.Err()
        g = self._import_mem(data, len(data), ctypes.byref(err))
        if not g:
            return None, (err.code, self._msg(err))
        return g, None

    def graph_destroy(self, g):
        h = ctypes.c_void_p(g)
        self._graph_destroy(ctypes.byref(h))

    def compile_local(self, g, key_path, out_path):
        """Compile graph `g` and write a signed artifact.  None or (code, msg)."""
        err = self.Err()
        res = self.CompileResult()
        rc = self._compile_local(g, None, key_path.encode(), out_path.encode(),
                                 ctypes.byref(res), ctypes.byref(err))
        if rc != 0:
            return (err.code, self._msg(err))
        return None

    def load(self, kar_path, keyring):
        """Verify and load an artifact.  (model, manifest info) or (None, msg).
        The manifest info is ([(name, dtype, shape)] inputs, same outputs)."""
        err = self.Err()
        m = self._rt_load(self.rt, kar_path.encode(), keyring.encode(), ctypes.byref(err))
        if not m:
            return None, self._msg(err)
        if self._io:
            return m, (self._ios_by_function(m, 0), self._ios_by_function(m, 1))
        man = self._model_manifest(m).contents
        # A layout drift would put garbage here: refuse to go on with it.
        if (man.format_version != self.format_version or man.runtime_abi != self.runtime_abi
                or man.target.decode(errors="replace") != self.target
                or not 0 <= man.n_inputs <= 1024 or not 0 <= man.n_outputs <= 1024):
            self.model_destroy(m)
            raise KilnHarnessError("the manifest read through ctypes does not look like "
                                   "one: kilnlib.py's struct layout is out of date with "
                                   "artifact/kiln_artifact.h")

        def ios(arr, n):
            out = []
            for i in range(n):
                io = arr[i]
                if not 0 <= io.shape.rank <= self.max_rank:
                    raise KilnHarnessError(f"manifest io '{io.name}' has rank {io.shape.rank}")
                out.append((io.name.decode("utf-8", errors="replace"), io.dtype,
                            tuple(io.shape.dims[k] for k in range(io.shape.rank))))
            return out

        return m, (ios(man.inputs, man.n_inputs), ios(man.outputs, man.n_outputs))

    def _ios_by_function(self, m, output):
        out = []
        for i in range(self._io_count(m, output)):
            name, dtype = ctypes.c_char_p(), ctypes.c_int()
            dims = (ctypes.c_int64 * self.max_rank)()
            err = self.Err()
            rank = self._io(m, output, i, ctypes.byref(name), ctypes.byref(dtype), dims,
                            ctypes.byref(err))
            if not 0 <= rank <= self.max_rank:
                raise KilnHarnessError(f"kiln_model_io ({output}, {i}): {self._msg(err)}")
            out.append((name.value.decode("utf-8", errors="replace"), dtype.value,
                        tuple(dims[k] for k in range(rank))))
        return out

    def model_destroy(self, m):
        h = ctypes.c_void_p(m)
        self._model_destroy(ctypes.byref(h))

    def _tensor(self, arr, dtype_code, shape):
        t = self.RtTensor()
        t.dtype = dtype_code
        t.shape.rank = len(shape)
        for k, v in enumerate(shape):
            t.shape.dims[k] = v
        t.data = arr.ctypes.data if arr is not None else None
        return t

    def run(self, m, inputs, outputs):
        """Run model `m`.  `inputs`: list of C-contiguous arrays in manifest
        order (their dtype must be a kiln dtype); `outputs`: list of
        (kiln dtype, shape).  Returns (list of output arrays with the dtype
        and shape the runtime reported, None) or (None, msg)."""
        n_in, n_out = len(inputs), len(outputs)
        ins = (self.RtTensor * max(n_in, 1))()
        for i, a in enumerate(inputs):
            ins[i] = self._tensor(a, NUMPY_TO_KILN[a.dtype], a.shape)
        bufs = []
        outs = (self.RtTensor * max(n_out, 1))()
        for i, (code, shape) in enumerate(outputs):
            dt = KILN_TO_NUMPY.get(code)
            if dt is None:
                return None, f"output {i} has dtype {code}, which the harness cannot hold"
            # One spare element so that a zero-size output still has a buffer.
            b = np.zeros(int(np.prod(shape, dtype=np.int64)) + 1, dtype=dt)
            bufs.append(b)
            outs[i] = self.RtTensor()
            outs[i].data = b.ctypes.data
        err = self.Err()
        rc = self._model_run(m, ins, n_in, outs, n_out, ctypes.byref(err))
        if rc != 0:
            return None, self._msg(err)
        result = []
        for i, b in enumerate(bufs):
            code = outs[i].dtype
            rank = outs[i].shape.rank
            if code != outputs[i][0] or not 0 <= rank <= self.max_rank:
                return None, (f"output {i}: the runtime reported dtype {code} rank {rank}, "
                              f"the manifest says dtype {outputs[i][0]}")
            shape = tuple(outs[i].shape.dims[k] for k in range(rank))
            if shape != tuple(outputs[i][1]):
                return None, (f"output {i}: the runtime reported shape {list(shape)}, "
                              f"the manifest says {list(outputs[i][1])}")
            n = int(np.prod(shape, dtype=np.int64))
            result.append(b[:n].reshape(shape).copy())
        return result, None
