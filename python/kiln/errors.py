"""The exceptions kiln raises.

Every error from kiln's C libraries carries a code (common/kiln_error.h)
and a message naming the thing at fault; `KilnError` keeps both.  The
subclasses let a caller catch what it can act on.  A compile that runs
past `compiler_timeout` raises the standard `subprocess.TimeoutExpired`,
as seed 000 says, not a kiln error.
"""

import re

# Codes from common/kiln_error.h (published codes never change).
EINVAL = 1
ENOMEM = 2
EIO = 3
EFORMAT = 4
ELIMIT = 5
EUNSUPPORTED = 6
ESHAPE = 7
EVERIFY = 8
ETIMEOUT = 11
ECOMPILE = 12
ENOTFOUND = 13
EREMOTE = 14
ECANCELED = 16
EUNREACHABLE = 17
EBUSY = 18


def escape(text):
    """`text` with every control character but newline and tab (C0, DEL,
    C1) and every byte that was not UTF-8 written as \\xNN, as kiln's C
    side prints what came from someone else (a worker's log, a node name):
    an error message never drives the reader's terminal."""
    out = []
    for ch in str(text):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:                 # an undecodable byte
            out.append("\\x%02x" % (o - 0xDC00))
        elif (o < 0x20 and ch not in "\n\t") or o == 0x7F or 0x80 <= o <= 0x9F:
            out.append("\\x%02x" % o)
        else:
            out.append(ch)
    return "".join(out)


class KilnError(RuntimeError):
    """An error reported by kiln; `code` is the KILN_E* number (0 when
    the error was found in Python).  The message is escaped (`escape`)."""

    def __init__(self, message, code=0):
        super().__init__(escape(message))
        self.code = code


class UnsupportedOperatorError(KilnError):
    """The model uses operators kiln cannot compile, or cannot be taken in
    at all; `ops` lists the operators (name -> count), `reasons` says in
    words why the model was refused (one line per cause: an op, a shape, a
    dtype, an export failure), so a tool can read either."""

    def __init__(self, message, code=EUNSUPPORTED, ops=None, reasons=None):
        super().__init__(message, code)
        if ops is None:
            # An op kiln knows, refused in one setting: "node 'name' (Op): ..."
            m = re.search(r"node (?:'[^']*'|#\d+) \(([A-Za-z_][\w.:]*)\): ", str(message))
            ops = {m.group(1): 1} if m else {}
        self.ops = dict(ops)
        self.reasons = list(reasons) if reasons else [message]


class CompileError(KilnError):
    """The compiler (local or on the farm) failed."""


class VerifyError(KilnError):
    """An artifact failed verification: unsigned, signed by a key not in
    the keyring, or a member whose digest does not match."""


class InputError(KilnError, ValueError):
    """An input of the wrong shape, dtype, device or count.  A ValueError
    too, as seed 001 specifies for dynamic batching."""


class TraceCheckError(KilnError):
    """check_trace found the compiled module disagreeing with the original;
    `output` is the output index, `max_error` the largest difference."""

    def __init__(self, message, output=None, max_error=None):
        super().__init__(message)
        self.output = output
        self.max_error = max_error
