#!/usr/bin/python3
"""Generate the ONNX backend node-test data into a directory.

Debian's python3-onnx 1.12 ships the test-case generators but not the
generated data, and its generators still use the numpy aliases that numpy
1.24 removed (np.float, np.int, np.bool, np.object, ...).  This wrapper
puts those aliases back on the numpy module, then runs onnx's own
`backend-test-tools generate-data -o DIR`.  The result is DIR/node/test_*
(model.onnx + test_data_set_N/{input,output}_K.pb) and DIR/real/* (data.json
pointers to downloadable models, which kiln's harness does not use).

usage: gen_data.py OUTPUT_DIR [--op-type OP]

The data is written into a temporary directory next to OUTPUT_DIR and
renamed into place, so an interrupted run never leaves a half-generated
OUTPUT_DIR behind; an OUTPUT_DIR that exists is left as it is.
"""

import builtins
import os
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

# The aliases numpy 1.20 deprecated and 1.24 removed, each with what it
# meant then.  Only missing ones are set, so a numpy that still has them is
# left alone.
_ALIASES = {
    "float": builtins.float,
    "int": builtins.int,
    "bool": builtins.bool,
    "object": builtins.object,
    "complex": builtins.complex,
    "str": builtins.str,
    "long": builtins.int,
    "unicode": builtins.str,
}


def restore_numpy_aliases():
    for name, value in _ALIASES.items():
        if name not in np.__dict__:
            setattr(np, name, value)


def main(argv):
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--op-type"):
        sys.stderr.write(__doc__)
        return 2
    out = os.path.abspath(argv[1])
    op_type = argv[3] if len(argv) == 4 else None
    restore_numpy_aliases()
    warnings.simplefilter("ignore")

    from onnx.backend.test import cmd_tools

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=os.path.dirname(out))
    t0 = time.monotonic()
    saved_argv = sys.argv
    sys.argv = ["backend-test-tools", "generate-data", "-o", tmp]
    if op_type:
        sys.argv += ["-t", op_type]
    try:
        cmd_tools.main()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        sys.argv = saved_argv
    # Another run may have put its data in place meanwhile: the same
    # generator made it, so keep that one rather than pull it away from
    # under a reader.
    try:
        os.rename(tmp, out)
    except OSError:
        if not os.path.isdir(os.path.join(out, "node")):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    node_dir = os.path.join(out, "node")
    n = len([d for d in os.listdir(node_dir) if d.startswith("test_")]) \
        if os.path.isdir(node_dir) else 0
    print(f"gen_data: {n} node tests in {node_dir} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
