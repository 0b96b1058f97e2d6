"""The TorchScript extension: libkiln_torch (python/kiln/csrc/kiln_torch.cpp).

Loading it registers `torch.classes.kiln.Model` (a signed artifact run by
libkilnrt, on the same runtime and round-robin placement as kiln.load)
and the ops `torch.ops.kiln.run(model, inputs)`,
`torch.ops.kiln.set_keyring(dir)` and `torch.ops.kiln.keyring()`.
`torch.jit.load` of a module that holds a Model needs the class
registered first, so `import kiln` loads the library; when it is missing,
importing kiln still works and `load()` raises the reason when the class
is needed.

A saved module embeds its artifacts; torch.jit.load verifies each against
the process keyring: the directory given to `set_keyring`, else
$KILN_KEYRING, else CONFIG/keyring when it exists, else CONFIG/keys (as
kiln.compile.default_keyring()).
"""

import os
import threading

import torch

from . import _lib, errors

_lock = threading.Lock()
_loaded = None          # the library's path, once loaded


def load():
    """Load libkiln_torch into this process (once; later calls return at
    once).  Raises KilnError naming the library when it cannot be loaded."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return
        path = _lib.find_library("kiln_torch")
        try:
            torch.ops.load_library(path)
        except OSError as e:
            raise errors.KilnError(
                f"could not load the TorchScript extension {path}: {e}; set KILN_LIB "
                f"to the directory holding libkiln_torch.so (build/lib after `make`), "
                f"or run `make install`", errors.ENOTFOUND) from None
        _loaded = path


def try_load():
    """load(), for `import kiln`: a failure is not raised here; load()
    raises it when the extension is needed."""
    try:
        load()
    except errors.KilnError:
        pass


def set_keyring(path):
    """Verify the artifacts embedded in TorchScript modules loaded from now
    on against the keys in directory `path` (None: back to the default)."""
    load()
    torch.ops.kiln.set_keyring("" if path is None else os.fspath(path))


def keyring():
    """The directory embedded artifacts are verified against now."""
    load()
    return torch.ops.kiln.keyring()
