#!/usr/bin/env python3
"""make bench-farm: the farm's benchmarks, printed as a table (not tests:
nothing here passes or fails on time).

Each figure is measured on farms started here on loopback (broker and
workers as real processes; every process is stopped at the end):

  cache hit      round trip of a compile served from the action cache,
                 from the C client library (bench_farm hits): p50 / p99
  dispatch       N distinct jobs in one batch on a worker whose toolchain
                 does no work (`@noop`, in the worker, no child process),
                 and on one that runs a real child (`cp {input} {output}`)
  scaling        128 jobs of a toolchain that sleeps 0.2 s on 1, 2, 4 and 8
                 workers of 2 slots: ideal makespan / measured
  upload         1 GiB of weights (16 blobs) uploaded to the broker, which
                 checks every byte's SHA-256 and stores it durably; as a
                 ratio to raw ZeroMQ loopback throughput measured in the
                 same run (best of 3 each); then the same weights again.
                 Also SHA-256 on one core: the broker must hash every
                 byte, so no checked upload beats cores x that rate

Usage: bench_farm.py --bin BUILD/bin --bench BUILD/bench/bench_farm [--quick]
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the broker exited")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the broker did not listen")


class Farm:
    def __init__(self, bindir, workdir, broker_args=()):
        self.bindir = bindir
        self.workdir = workdir
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.procs = []
        key = os.path.join(workdir, "key")
        if not os.path.exists(os.path.join(key, "kiln.key")):
            subprocess.run([os.path.join(bindir, "kiln"), "keygen", "--out", key], check=True,
                           capture_output=True, timeout=30)
        state = self.state = tempfile.mkdtemp(prefix="state-", dir=workdir)
        log = open(os.path.join(workdir, f"broker-{self.port}.log"), "ab")
        self.broker = subprocess.Popen(
            [os.path.join(bindir, "kiln-broker"), "--listen", self.endpoint, "--state", state,
             "--key", os.path.join(key, "kiln.key"), *broker_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(self.broker)
        wait_port(self.port, self.broker)

    def worker(self, name, *args):
        log = open(os.path.join(self.workdir, f"{name}-{self.port}.log"), "ab")
        env = dict(os.environ, TMPDIR=self.workdir)
        proc = subprocess.Popen([os.path.join(self.bindir, "kiln-worker"), "--broker",
                                 self.endpoint, "--name", name, *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_workers(self, n, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run([os.path.join(self.bindir, "kiln"), "status", "--broker",
                                  self.endpoint, "--json"], capture_output=True, text=True,
                                 timeout=30)
            if out.returncode == 0 and len(json.loads(out.stdout)["workers"]) >= n:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{n} workers did not register")

    def stop(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=10)


def bench(exe, *args, timeout=900):
    out = subprocess.run([exe, *[str(a) for a in args]], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bench_farm {' '.join(map(str, args))}: {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    a = ap.parse_args()
    exe = a.bench
    quick = a.quick
    work = tempfile.mkdtemp(prefix="kiln-bench-farm-")
    rows = []
    farms = []

    def farm(*broker_args):
        f = Farm(a.bin, work, broker_args)
        farms.append(f)
        return f

    try:
        print(f"kiln bench-farm on {os.cpu_count()} cores; work in {work}", flush=True)

        # Cache hits.
        f = farm()
        f.worker("w1")
        f.wait_workers(1)
        hits = bench(exe, "hits", f.endpoint, 500 if quick else 5000)
        rows.append(("cache-hit round trip, C client, loopback",
                     f"p50 {hits['p50_ms']:.2f} ms, p99 {hits['p99_ms']:.2f} ms",
                     "p50 < 2 ms"))
        print(f"  cache hits: {hits}", flush=True)
        f.stop()

        # Dispatch throughput.
        f = farm()
        f.worker("noop1", "--slots", "256", "--no-builtin", "--toolchain", "noop=@noop")
        f.wait_workers(1)
        n = 1000 if quick else 10000
        noop = bench(exe, "batch", f.endpoint, n, "noop")
        f.stop()
        f = farm()
        f.worker("cp1", "--slots", "8", "--no-builtin", "--toolchain", "cp=cp {input} {output}")
        f.wait_workers(1)
        cp = bench(exe, "batch", f.endpoint, 200 if quick else 1000, "cp")
        f.stop()
        rows.append(("dispatch, no-op toolchain (in the worker)",
                     f"{noop['jobs_per_s']:.0f} jobs/s ({noop['n']} jobs)", ">= 2,000 jobs/s"))
        rows.append(("dispatch, `cp` toolchain (a child per job)",
                     f"{cp['jobs_per_s']:.0f} jobs/s ({cp['n']} jobs)", "-"))
        print(f"  dispatch: {noop}\n            {cp}", flush=True)

        # Scaling.
        sleep_tc = "sleepy=sh -c 'sleep 0.2; cp {input} {output}'"
        effs = []
        for workers in ([1, 8] if quick else [1, 2, 4, 8]):
            f = farm()
            for i in range(workers):
                f.worker(f"w{i}", "--slots", "2", "--no-builtin", "--toolchain", sleep_tc)
            f.wait_workers(workers)
            r = bench(exe, "batch", f.endpoint, 128, "sleepy")
            f.stop()
            slots = 2 * workers
            ideal = -(-128 // slots) * 0.2
            eff = ideal / r["seconds"]
            effs.append(eff)
            rows.append((f"scaling, 128 x 0.2 s jobs, {workers} worker{'s' if workers > 1 else ''}"
                         " x 2 slots",
                         f"{r['seconds']:.2f} s (ideal {ideal:.2f} s): efficiency {eff:.2f}",
                         ">= 0.9"))
            print(f"  scaling {workers} workers: {r['seconds']:.2f} s, ideal {ideal:.2f} s, "
                  f"efficiency {eff:.2f}", flush=True)

        # Upload vs raw ZeroMQ, best of 3 each, interleaved; and SHA-256 on
        # one core, which bounds what any checked upload can reach here.
        mib = 256 if quick else 1024
        raw_best, up_best, sha_best, second = 0.0, 0.0, 0.0, None
        for _ in range(3):
            raw = bench(exe, "raw", mib)
            raw_best = max(raw_best, raw["mib_per_s"])
            sha = bench(exe, "sha", mib)
            sha_best = max(sha_best, sha["mib_per_s"])
            f = farm()
            up = bench(exe, "upload", f.endpoint, mib, 16)
            f.stop()
            shutil.rmtree(f.state, ignore_errors=True)
            up_best = max(up_best, up["mib_per_s"])
            second = up
            print(f"  raw {raw['mib_per_s']:.0f} MiB/s, SHA-256 {sha['mib_per_s']:.0f} MiB/s "
                  f"per core, upload {up['mib_per_s']:.0f} MiB/s", flush=True)
        cores = os.cpu_count() or 1
        rows.append((f"upload {mib} MiB of weights (16 blobs), checked and stored",
                     f"{up_best:.0f} MiB/s = {up_best / raw_best:.2f} x raw ZeroMQ "
                     f"({raw_best:.0f} MiB/s)", ">= 0.7"))
        rows.append((f"bound: SHA-256 of every byte on all {cores} cores, nothing else",
                     f"{sha_best:.0f} MiB/s per core: at most "
                     f"{min(1.0, cores * sha_best / raw_best):.2f} x raw ZeroMQ", ""))
        rows.append(("upload of the same weights again",
                     f"{second['second_sent_bytes']} weight bytes sent, "
                     f"{second['second_seconds'] * 1000:.1f} ms", "no weight bytes"))
    finally:
        for f in farms:
            f.stop()
        shutil.rmtree(work, ignore_errors=True)

    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    print()
    print(f"| {'measurement'.ljust(w)} | {'result'.ljust(v)} | target |")
    print(f"|{'-' * (w + 2)}|{'-' * (v + 2)}|--------|")
    for r in rows:
        print(f"| {r[0].ljust(w)} | {r[1].ljust(v)} | {r[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
