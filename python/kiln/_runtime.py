"""The runtime binding: one libkilnrt runtime per process, its execution
cores, and models loaded onto them.

As seed 001 describes for NeuronCores, every model loaded in a process
goes to the next core round-robin (`KILN_RT_VISIBLE_CORES`,
`KILN_RT_NUM_CORES`; by default every CPU), and runs on a thread pinned
to that core; models on different cores run concurrently (the GIL is
released while a model runs).
"""

import collections
import ctypes
import threading

import torch

from . import _lib, errors

IOSpec = collections.namedtuple("IOSpec", "name dtype shape")
IOSpec.__doc__ = "An input or output: name, torch dtype and shape (a tuple)."

# kiln dtype codes (ONNX's) <-> torch dtypes (common/kiln_dtype.h).
_KILN_TO_TORCH = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 6: torch.int32,
    7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}
_TORCH_TO_KILN = {v: k for k, v in _KILN_TO_TORCH.items()}


def dtype_name(dtype):
    """'float32' for torch.float32: the spelling kiln's messages use."""
    return str(dtype).replace("torch.", "")


def describe(dtype, shape):
    """'float32 [1, 3, 224, 224]'."""
    return f"{dtype_name(dtype)} [{', '.join(str(int(d)) for d in shape)}]"


class Runtime:
    """The process's libkilnrt runtime (kiln_rt_shared).  Use `runtime()`.

    It is the one every binding in the process loads through, the
    TorchScript extension (torch.classes.kiln.Model) too, so that they
    share the cores and the round-robin placement.  libkilnrt owns it and
    keeps it until the process exits: nothing here destroys it."""

    def __init__(self):
        self._lib = _lib.rt()
        err = _lib.Err()
        self._ptr = self._lib.kiln_rt_shared(ctypes.byref(err))
        if not self._ptr:
            raise _lib.error_from(err, prefix="kiln runtime")

    @property
    def num_cores(self):
        return self._lib.kiln_rt_num_cores(self._ptr)

    def core_cpu(self, core):
        """The CPU core `core`'s thread is pinned to."""
        cpu = self._lib.kiln_rt_core_cpu(self._ptr, int(core))
        if cpu < 0:
            raise ValueError(f"no core {core}: the runtime has {self.num_cores}")
        return cpu

    def load(self, path, keyring, core=None):
        """Verify the artifact at `path` against `keyring` (a directory of
        public keys) and load it on `core` (None: the next, round-robin)."""
        return Model(self, path, keyring, -1 if core is None else int(core))


_runtime = None
_runtime_lock = threading.Lock()


def runtime():
    """The process's runtime, created on first use."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


def num_cores():
    """How many execution cores this process's runtime has."""
    return runtime().num_cores


class Model:
    """A verified artifact loaded on one core, or, pipelined, on one core
    per stage."""

    def __init__(self, rt, path, keyring, core=-1):
        self._rt = rt            # keeps the Python side alive, for order
        self._lib = rt._lib
        self.path = str(path)
        err = _lib.Err()
        ptr = self._lib.kiln_rt_load_on(rt._ptr, _lib.fs(path), _lib.fs(keyring),
                                        core, ctypes.byref(err))
        if not ptr:
            raise _lib.error_from(err)
        self._ptr = ptr
        self.core = self._lib.kiln_model_core(ptr)
        # A model compiled with --pipeline-cores N runs as N stages, stage
        # s on stage_cores[s]; any other has one stage, on `core`.
        self.stages = self._lib.kiln_model_stage_count(ptr)
        self.stage_cores = [self._lib.kiln_model_stage_core(ptr, s)
                            for s in range(self.stages)]
        self.inputs = self._io(0)
        self.outputs = self._io(1)
        self._batch = None

    def _io(self, output):
        specs = []
        for i in range(self._lib.kiln_model_io_count(self._ptr, output)):
            name = ctypes.c_char_p()
            dtype = ctypes.c_int()
            dims = (ctypes.c_int64 * _lib.KILN_MAX_RANK)()
            err = _lib.Err()
            rank = self._lib.kiln_model_io(self._ptr, output, i, ctypes.byref(name),
                                           ctypes.byref(dtype), dims, ctypes.byref(err))
            if rank < 0:
                raise _lib.error_from(err)
            tdtype = _KILN_TO_TORCH.get(dtype.value)
            if tdtype is None:
                raise errors.KilnError(f"{'output' if output else 'input'} "
                                       f"'{name.value.decode()}' has kiln dtype "
                                       f"{dtype.value}, which torch cannot hold")
            specs.append(IOSpec(name.value.decode("utf-8", "replace"), tdtype,
                                tuple(dims[:rank])))
        return specs

    @property
    def io_structure(self):
        """How the model's inputs and outputs nest, as the JSON text
        kiln.trace recorded (the manifest's io_structure), or None."""
        text = self._lib.kiln_model_io_structure(self._ptr)
        return text.decode("utf-8") if text is not None else None

    @property
    def batch_size(self):
        """The compiled batch (dimension 0 shared by every input and
        output); raises KilnError when the model cannot be batched."""
        if self._batch is None:
            err = _lib.Err()
            b = self._lib.kiln_model_batch_size(self._ptr, ctypes.byref(err))
            if b < 0:
                raise _lib.error_from(err)
            self._batch = int(b)
        return self._batch

    def run(self, tensors):
        """Run on contiguous CPU tensors of exactly the compiled shapes;
        returns the outputs as a list of new tensors."""
        outs = [torch.empty(o.shape, dtype=o.dtype) for o in self.outputs]
        ins_c = _tensor_array(tensors)
        outs_c = _tensor_array(outs)
        err = _lib.Err()
        rc = self._lib.kiln_model_run(self._ptr, ins_c, len(tensors), outs_c, len(outs),
                                      ctypes.byref(err))
        if rc != 0:
            raise _lib.error_from(err)
        return outs

    def close(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._lib.kiln_model_destroy(ctypes.byref(ctypes.c_void_p(ptr)))

    def __del__(self):
        self.close()


def run_batched(models, tensors):
    """Dynamic batching over `models` (replicas of one artifact): inputs of
    any size in dimension 0 (the same in all) run in chunks of the
    compiled batch across the replicas' cores; returns the joined
    outputs."""
    m0 = models[0]
    b = m0.batch_size
    n = tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 0
    outs = [torch.empty((n,) + tuple(o.shape[1:]), dtype=o.dtype) for o in m0.outputs]
    arr = (ctypes.c_void_p * len(models))(*[m._ptr for m in models])
    ins_c = _tensor_array(tensors)
    outs_c = _tensor_array(outs)
    err = _lib.Err()
    rc = m0._lib.kiln_model_run_batched(arr, len(models), ins_c, len(tensors), outs_c,
                                        len(outs), ctypes.byref(err))
    if rc != 0:
        raise _lib.error_from(err)
    assert b > 0
    return outs


def _tensor_array(tensors):
    """kiln_rt_tensor_t[] viewing `tensors` (which must stay alive)."""
    arr = (_lib.Tensor * max(1, len(tensors)))()
    for i, t in enumerate(tensors):
        c = arr[i]
        c.dtype = _TORCH_TO_KILN.get(t.dtype, 0)
        if t.dim() > _lib.KILN_MAX_RANK:
            raise errors.InputError(f"tensor {i} has {t.dim()} dimensions; kiln "
                                    f"handles at most {_lib.KILN_MAX_RANK}",
                                    errors.ESHAPE)
        c.shape.rank = t.dim()
        for d, size in enumerate(t.shape):
            c.shape.dims[d] = size
        c.data = t.data_ptr() if t.numel() > 0 else None
    return arr
