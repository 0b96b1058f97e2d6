#!/usr/bin/env python3
"""bench_upload — the upload phase alone, side by side with its bounds.

Each round starts a fresh broker on loopback (its store on this disk),
uploads MIB MiB of in-memory blobs to it (`bench_farm upload`: the
client library's upload path, FIND, CHUNKs under credit), and in the same
round measures SHA-256 on one core over as many bytes (`bench_farm sha`)
and raw ZeroMQ through loopback TCP with the same 1 MiB messages
(`bench_farm raw`).  The three take turns round after round, so a machine
whose load drifts slows them alike; the table gives each one's median and
the ratios' medians, pair by pair.

Beside wall-clock rates it prints CPU seconds per GiB uploaded of the
broker (its /proc/PID/stat, read before it stops) and of the client (its
own rusage over the upload, all threads): on a machine shared with other work these move less than wall
time, and they say where the upload's cycles go.  Not a test: nothing here
passes or fails on time.

Usage: bench_upload.py --bin BUILD/bin --bench-farm BUILD/bench/bench_farm
                       [--mib 1024] [--blobs 4] [--rounds 3] [--broker-arg ARG ...]
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_farm import free_port, wait_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """User and system CPU seconds of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def run_json(cmd):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime)
    return json.loads(p.stdout.strip().splitlines()[-1]), cpu


def upload_round(a, work):
    state = os.path.join(work, "state")
    shutil.rmtree(state, ignore_errors=True)
    key = os.path.join(work, "key", "kiln.key")
    if not os.path.exists(key):
        subprocess.run([os.path.join(a.bin, "kiln"), "keygen", "--out",
                        os.path.dirname(key)], check=True, capture_output=True)
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    log = open(os.path.join(work, "broker.log"), "ab")
    broker = subprocess.Popen([os.path.join(a.bin, "kiln-broker"), "--listen", ep, "--state",
                               state, "--key", key] + a.broker_arg,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_port(port, broker)
        b0 = proc_cpu(broker.pid)
        up, _ = run_json([a.bench_farm, "upload", ep, str(a.mib), str(a.blobs)])
        b1 = proc_cpu(broker.pid)
        with open(f"/proc/{broker.pid}/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    finally:
        broker.terminate()
        broker.wait(timeout=30)
        log.close()
        shutil.rmtree(state, ignore_errors=True)
    if up["sent_bytes"] != a.mib << 20:
        raise SystemExit(f"bench_upload: sent {up['sent_bytes']} bytes, not {a.mib} MiB")
    return {"mib_per_s": up["mib_per_s"], "seconds": up["seconds"],
            "broker_user": b1[0] - b0[0], "broker_sys": b1[1] - b0[1],
            "client_user": up.get("user_s", 0.0), "client_sys": up.get("sys_s", 0.0), "broker_hwm_kib": hwm}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--bench-farm", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--blobs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--broker-arg", action="append", default=[])
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kiln-bench-upload-", dir=a.workdir)
    ups, shas, raws = [], [], []
    try:
        for i in range(a.rounds):
            ups.append(upload_round(a, work))
            shas.append(run_json([a.bench_farm, "sha", str(a.mib)])[0]["mib_per_s"])
            raws.append(run_json([a.bench_farm, "raw", str(a.mib)])[0]["mib_per_s"])
            u = ups[-1]
            print(f"round {i + 1}: upload {u['mib_per_s']:.0f} MiB/s, sha {shas[-1]:.0f}, "
                  f"raw {raws[-1]:.0f}; broker cpu {u['broker_user'] + u['broker_sys']:.2f} s, "
                  f"client cpu {u['client_user'] + u['client_sys']:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    gib = a.mib / 1024
    rate = med(u["mib_per_s"] for u in ups)
    print()
    print(f"{a.mib} MiB in {a.blobs} blobs, {a.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("| measurement | median |")
    print("|---|---|")
    print(f"| upload to a fresh broker | {rate:.0f} MiB/s |")
    print(f"| SHA-256 on one core | {med(shas):.0f} MiB/s |")
    print(f"| raw ZeroMQ, 1 MiB messages | {med(raws):.0f} MiB/s |")
    print(f"| upload / SHA-256 (pairwise) | "
          f"{med(u['mib_per_s'] / s for u, s in zip(ups, shas)):.2f} |")
    print(f"| upload / raw ZeroMQ (pairwise) | "
          f"{med(u['mib_per_s'] / r for u, r in zip(ups, raws)):.2f} |")
    for who in ("broker", "client"):
        print(f"| {who} CPU per GiB (user + sys) | "
              f"{med(u[who + '_user'] / gib for u in ups):.2f} + "
              f"{med(u[who + '_sys'] / gib for u in ups):.2f} s |")
    print(f"| SHA-256 alone, CPU per GiB | {1024 / med(shas):.2f} s |")
    print(f"| broker peak RSS | {max(u['broker_hwm_kib'] for u in ups) / 1024:.0f} MiB |")


if __name__ == "__main__":
    sys.exit(main())
