"""kiln's TorchScript side: the custom class `torch.classes.kiln.Model`
and op `kiln::run` (python/kiln/csrc/kiln_torch.cpp, built by `make` into
libkiln_torch.so against Debian's libtorch), through which a kiln module
becomes a torch.jit.ScriptModule.

A saved module embeds each artifact's bytes; torch.jit.load verifies every
one against the process keyring (kiln.torchscript.set_keyring, else
$KILN_KEYRING, ~/.config/kiln/keyring, your own key) before it is loaded,
so a changed byte fails the load.
"""

import warnings

import torch

from . import _ext, errors


def available():
    """True when the extension library could be loaded."""
    try:
        _ext.load()
        return True
    except errors.KilnError:
        return False


def require():
    """Load the extension or raise KilnError saying why."""
    _ext.load()


def new_model(path, keyring):
    """A kiln.Model for the (already verified) artifact at `path`."""
    return torch.classes.kiln.Model(str(path), str(keyring), -1)


def set_keyring(keyring):
    """The keyring torch.jit.load checks embedded artifacts against, for
    this process."""
    require()
    _ext.set_keyring(keyring)


def trace_module(module, flat_inputs):
    """torch.jit.trace of `module` on `flat_inputs`: its kiln parts become
    kiln::run calls, the rest TorchScript."""
    require()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(module, tuple(flat_inputs), strict=False, check_trace=False)


def load(path, keyring):
    """torch.jit.load of a saved kiln module, every embedded artifact
    verified against `keyring`."""
    set_keyring(keyring)
    try:
        return torch.jit.load(str(path))
    except RuntimeError as e:
        text = str(e)
        if "kiln" in text and ("verif" in text or "signature" in text or "digest" in text):
            first = next((l for l in text.splitlines() if "kiln" in l), text)
            raise errors.VerifyError(first.strip(), errors.EVERIFY) from None
        raise
