"""ctypes bindings of libkilnrt (the runtime) and libkilnclient (import
and compile), and where to find them and the kiln programs.

Libraries are looked up, in order, in $KILN_LIB, the directory `make
install` recorded in kiln/_paths.py, the source tree's build/lib (when the
package is used from python/ with PYTHONPATH), the lib/ directory above an
installed dist-packages, and finally the system's loader path.  Programs
(`kiln`, used for compiles with a timeout) likewise: $KILN_BIN, the
recorded bin directory, build/bin, then $PATH.

libkilnrt is all an inference host needs (kiln.load); libkilnclient is
loaded only when something is traced or compiled.
"""

import ctypes
import os
import shutil
import threading

from . import errors

_PKG = os.path.dirname(os.path.abspath(__file__))
_SRC_ROOT = os.path.abspath(os.path.join(_PKG, "..", ".."))

try:  # written by `make install`
    from . import _paths  # type: ignore
except ImportError:  # pragma: no cover - the source tree has none
    _paths = None

KILN_MAX_RANK = 8
ERR_MSG_MAX = 1024


class Err(ctypes.Structure):
    """kiln_err_t (common/kiln_error.h)."""
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * ERR_MSG_MAX)]

    @property
    def message(self):
        # bytes that are not UTF-8 are kept (as surrogates), so that
        # KilnError can show them escaped as \xNN like kiln's C side
        return self.msg.decode("utf-8", "surrogateescape")


class Shape(ctypes.Structure):
    """kiln_shape_t (common/kiln_dtype.h)."""
    _fields_ = [("rank", ctypes.c_int), ("dims", ctypes.c_int64 * KILN_MAX_RANK)]


class Tensor(ctypes.Structure):
    """kiln_rt_tensor_t (runtime/kiln_rt.h)."""
    _fields_ = [("dtype", ctypes.c_int), ("shape", Shape), ("data", ctypes.c_void_p)]


def _candidate_dirs(kind):
    """Directories to look in for 'lib' or 'bin', most specific first."""
    dirs = []
    env = os.environ.get("KILN_LIB" if kind == "lib" else "KILN_BIN")
    if env:
        dirs.append(env)
    recorded = getattr(_paths, "LIBDIR" if kind == "lib" else "BINDIR", None)
    if recorded:
        dirs.append(recorded)
    dirs.append(os.path.join(_SRC_ROOT, "build", kind))
    # $(PREFIX)/lib/python3/dist-packages/kiln -> $(PREFIX)/lib or /bin
    prefix = os.path.abspath(os.path.join(_PKG, "..", "..", "..", ".."))
    dirs.append(os.path.join(prefix, kind))
    return dirs


def find_library(name):
    """Path of lib<name>.so, or the bare soname for the system loader."""
    soname = f"lib{name}.so"
    for d in _candidate_dirs("lib"):
        path = os.path.join(d, soname)
        if os.path.isfile(path):
            return path
    return soname


def find_program(name):
    """Path of a kiln program (e.g. 'kiln'); raises KilnError if none."""
    for d in _candidate_dirs("bin"):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise errors.KilnError(
        f"could not find the program '{name}': set KILN_BIN to the directory "
        f"holding it, or run `make install`", errors.ENOTFOUND)


_lock = threading.Lock()
_rt = None
_client = None

P = ctypes.c_void_p
I = ctypes.c_int
S = ctypes.c_char_p
E = ctypes.POINTER(Err)


def _proto(lib, name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


def _load(name):
    path = find_library(name)
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise errors.KilnError(
            f"could not load {path}: {e}; set KILN_LIB to the directory holding "
            f"lib{name}.so (build/lib after `make`), or run `make install`",
            errors.ENOTFOUND) from None


def rt():
    """libkilnrt, loaded and prototyped once."""
    global _rt
    with _lock:
        if _rt is not None:
            return _rt
        lib = _load("kilnrt")
        _proto(lib, "kiln_rt_new", P, E)
        _proto(lib, "kiln_rt_destroy", None, ctypes.POINTER(P))
        _proto(lib, "kiln_rt_shared", P, E)
        _proto(lib, "kiln_rt_num_cores", I, P)
        _proto(lib, "kiln_rt_core_cpu", I, P, I)
        _proto(lib, "kiln_rt_load_on", P, P, S, S, I, E)
        _proto(lib, "kiln_model_destroy", None, ctypes.POINTER(P))
        _proto(lib, "kiln_model_core", I, P)
        _proto(lib, "kiln_model_stage_count", I, P)
        _proto(lib, "kiln_model_stage_core", I, P, I)
        _proto(lib, "kiln_model_run", I, P, ctypes.POINTER(Tensor), I,
               ctypes.POINTER(Tensor), I, E)
        _proto(lib, "kiln_model_run_batched", I, ctypes.POINTER(P), I,
               ctypes.POINTER(Tensor), I, ctypes.POINTER(Tensor), I, E)
        _proto(lib, "kiln_model_batch_size", ctypes.c_int64, P, E)
        _proto(lib, "kiln_model_io_count", I, P, I)
        _proto(lib, "kiln_model_io", I, P, I, I, ctypes.POINTER(S),
               ctypes.POINTER(I), ctypes.c_int64 * KILN_MAX_RANK, E)
        _proto(lib, "kiln_model_io_structure", S, P)
        _proto(lib, "kiln_rt_tensor_sizeof", ctypes.c_size_t)
        _proto(lib, "kiln_rt_err_sizeof", ctypes.c_size_t)
        # The structs above are copies of C layouts: check them once.
        if (lib.kiln_rt_tensor_sizeof() != ctypes.sizeof(Tensor)
                or lib.kiln_rt_err_sizeof() != ctypes.sizeof(Err)):
            raise errors.KilnError(
                f"{find_library('kilnrt')} does not match this kiln package "
                f"(kiln_rt_tensor_t is {lib.kiln_rt_tensor_sizeof()} bytes, "
                f"expected {ctypes.sizeof(Tensor)})")
        _rt = lib
        return lib


def client():
    """libkilnclient, loaded and prototyped once."""
    global _client
    with _lock:
        if _client is not None:
            return _client
        lib = _load("kilnclient")
        _proto(lib, "kiln_capi_import_onnx", P, S, ctypes.c_size_t, E)
        _proto(lib, "kiln_capi_import_onnx_dir", P, S, ctypes.c_size_t, S, E)
        _proto(lib, "kiln_capi_graph_free", None, P)
        _proto(lib, "kiln_capi_graph_save", I, P, S, E)
        _proto(lib, "kiln_capi_graph_info", I, P, ctypes.c_char_p, ctypes.c_size_t, E)
        _proto(lib, "kiln_capi_graph_dump", I, P, S, E)
        _proto(lib, "kiln_capi_program_dump", I, S, S, E)
        _proto(lib, "kiln_capi_compile", I, P, S, S, ctypes.c_long, S, S,
               ctypes.c_char_p, ctypes.c_size_t, E)
        _proto(lib, "kiln_capi_compile_progress", I, P, S, S, ctypes.c_long, S, S,
               PROGRESS_FN, P, ctypes.c_char_p, ctypes.c_size_t, E)
        _proto(lib, "kiln_capi_config_dir", I, ctypes.c_char_p, ctypes.c_size_t, E)
        _client = lib
        return lib


def fs(path):
    """A path as bytes for a C string (None stays None)."""
    if path is None:
        return None
    return os.fsencode(os.fspath(path))


# kiln_capi_progress_fn: (const char *json, void *arg)
PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p)


def error_from(err, default=errors.KilnError, prefix=None):
    """The Python exception for a filled-in kiln_err_t."""
    msg = err.message or f"kiln error {err.code}"
    if prefix:
        msg = f"{prefix}: {msg}"
    cls = {
        errors.ESHAPE: errors.InputError,
        errors.EVERIFY: errors.VerifyError,
        errors.ECOMPILE: errors.CompileError,
        errors.EUNSUPPORTED: errors.UnsupportedOperatorError,
    }.get(err.code, default)
    return cls(msg, err.code)
