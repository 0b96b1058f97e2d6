"""kiln — the Python side of the kiln build farm.

    import kiln
    traced = kiln.trace(model, example_inputs)     # seeds 000 and 001
    traced(x)                                      # runs the compiled code
    traced.save("model.kar")
    loaded = kiln.load("model.kar")                # your keyring: your own key and
                                                   # the farms `kiln trust` pinned
    kiln.dynamic_batch(loaded)                     # any batch size
    dp = kiln.DataParallel(loaded)                 # a batch over every core

`kiln.trace` traces with torch.jit.trace, exports ONNX, compiles on the
farm (broker= or $KILN_BROKER) or locally, and returns a module that runs
on one of the runtime's execution cores, placed round-robin.  `kiln.farm`
starts a broker and workers on this machine.  The C libraries are found
through $KILN_LIB, the installed location, or build/lib in the source
tree.
"""

from .errors import (CompileError, InputError, KilnError, TraceCheckError,
                     UnsupportedOperatorError, VerifyError)
from .parallel import DataParallel, dynamic_batch
from ._runtime import num_cores, runtime
from .trace import TracedModule, load, save, trace
from . import _ext, torchscript
from .compile import config_dir

# torch.jit.load of a saved module that holds kiln models needs
# torch.classes.kiln.Model registered first: register it now (a dlopen).
# Without the library kiln still imports; _ext.load() says why later.
_ext.try_load()

__all__ = [
    "trace", "load", "save", "torchscript", "config_dir", "dynamic_batch", "DataParallel", "TracedModule",
    "num_cores", "runtime", "farm",
    "KilnError", "CompileError", "InputError", "TraceCheckError",
    "UnsupportedOperatorError", "VerifyError",
]


def __getattr__(name):
    # kiln.farm stays importable as an attribute without importing it (and
    # its subprocess machinery) eagerly.
    if name == "farm":
        import importlib
        return importlib.import_module(".farm", __name__)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
