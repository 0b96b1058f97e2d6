#!/usr/bin/env python3
"""make bench-large: a large model through the farm, memory against the
size of its weights (not a test: it prints numbers and asserts nothing
about time).

The model is an MLP whose weights are random (drawn with torch, one layer
at a time, so that generating it needs one layer of memory) and kept in
ONNX external data: one file per layer beside model.onnx, as torch writes
models over 2 GB.  Then, on a broker and one worker started here on
loopback:

  cold compile   `kiln compile` of the model: import, upload of every
                 weight, the worker's compile, the signed artifact back
  cache hit      the same `kiln compile` again (action cache)
  second upload  the weights uploaded again to the same broker (it holds
                 them all: only the hashing and one FIND round trip)
  upload         the weights uploaded to a fresh broker, as MiB/s beside
                 SHA-256 on one core and raw ZeroMQ, measured in the same
                 run (bench_farm sha / raw)
  sha256sum      of the weight files, the yardstick of the cache hit

and the peak RSS of each process: the client (`kiln compile`, VmHWM via
/usr/bin/time), the broker and the worker (VmHWM of the process itself,
read from /proc before it stops; the worker's compile children are
reported apart, from the worker's own rusage of its children), and
`kiln-run --dynamic-batch --replicas 2 --bench` on the artifact.

Usage: bench_large.py --bin BUILD/bin --bench-farm BUILD/bench/bench_farm
                      [--gib 6] [--dim 8192] [--workdir DIR [--reuse]] [--keep]
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_farm import free_port, wait_port  # noqa: E402


def gen_model(outdir, gib, dim):
    """y = relu(... relu(x @ W0) ... @ Wn-1), W_i [dim, dim] float32 random,
    each in its own external file; returns (model path, weight bytes)."""
    import numpy as np
    import onnx
    import torch
    from onnx import TensorProto, helper

    layer_bytes = dim * dim * 4
    layers = max(1, int(round(gib * (1 << 30) / layer_bytes)))
    os.makedirs(outdir, exist_ok=True)
    gen = torch.Generator().manual_seed(11)
    inits, nodes = [], []
    prev = "x"
    for i in range(layers):
        w = (torch.randn(dim, dim, generator=gen) / math.sqrt(dim)).numpy()
        fname = f"w{i}.bin"
        w.astype(np.float32).tofile(os.path.join(outdir, fname))
        del w
        t = TensorProto()
        t.name = f"W{i}"
        t.data_type = TensorProto.FLOAT
        t.dims.extend([dim, dim])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", fname), ("offset", "0"), ("length", str(layer_bytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
        out = "y" if i == layers - 1 else f"h{i}"
        mm = f"m{i}" if i < layers - 1 else "y"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [mm]))
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [mm], [out]))
        prev = out
    graph = helper.make_graph(
        nodes, "large_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = os.path.join(outdir, "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path, layers * layer_bytes


def vmhwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def timed(argv, env=None, timeout=7200):
    """Run argv under /usr/bin/time -v: (seconds, peak RSS KiB, completed)."""
    t0 = time.monotonic()
    proc = subprocess.run(["/usr/bin/time", "-v"] + argv, capture_output=True, text=True,
                          env=env, timeout=timeout)
    secs = time.monotonic() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return secs, int(m.group(1)) if m else -1, proc


class Farm:
    def __init__(self, bindir, workdir, worker_args=()):
        self.bindir = bindir
        self.workdir = workdir
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.state = os.path.join(workdir, "state")
        keydir = os.path.join(workdir, "farm-key")
        if not os.path.exists(os.path.join(keydir, "kiln.key")):
            subprocess.run([os.path.join(bindir, "kiln"), "keygen", "--out", keydir],
                           check=True, capture_output=True)
        self.keyring = os.path.join(workdir, "keyring")
        os.makedirs(self.keyring, exist_ok=True)
        shutil.copy(os.path.join(keydir, "kiln.pub"), os.path.join(self.keyring, "farm.pub"))
        self.blog = open(os.path.join(workdir, "broker.log"), "ab")
        self.broker = subprocess.Popen(
            [os.path.join(bindir, "kiln-broker"), "--listen", self.endpoint, "--state",
             self.state, "--key", os.path.join(keydir, "kiln.key")],
            stdout=self.blog, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, self.broker)
        self.worker = None
        self.worker_args = list(worker_args)

    def start_worker(self):
        self.wlog = open(os.path.join(self.workdir, "worker.log"), "ab")
        self.worker = subprocess.Popen(
            [os.path.join(self.bindir, "kiln-worker"), "--broker", self.endpoint, "--name",
             "w1", "--cache", os.path.join(self.workdir, "cache")] + self.worker_args,
            stdout=self.wlog, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, TMPDIR=self.workdir))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = subprocess.run([os.path.join(self.bindir, "kiln"), "status", "--broker",
                                 self.endpoint, "--json"], capture_output=True, text=True)
            if st.returncode == 0 and json.loads(st.stdout)["workers"]:
                return
            time.sleep(0.2)
        raise TimeoutError("the worker did not register within 120 s (see worker.log; "
                           "--workdir DIR --keep keeps it)")

    def peaks(self):
        out = {"broker": vmhwm_kib(self.broker.pid)}
        if self.worker:
            out["worker"] = vmhwm_kib(self.worker.pid)
            # The compile children the worker reaped: their peak as the
            # kernel keeps it for the worker (RUSAGE_CHILDREN).
            try:
                import resource  # noqa: F401
                with open(f"/proc/{self.worker.pid}/stat") as f:
                    pass
            except OSError:
                pass
        return out

    def stop(self):
        for p in (self.worker, self.broker):
            if p and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def mib(kib):
    return kib / 1024.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--bench-farm", required=True)
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the model already generated in --workdir")
    a = ap.parse_args()
    kiln = os.path.join(a.bin, "kiln")
    work = a.workdir or tempfile.mkdtemp(prefix="kiln-bench-large-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    rows = []
    farm = farm2 = None
    try:
        mdir = os.path.join(work, "model")
        t0 = time.monotonic()
        if a.reuse and os.path.exists(os.path.join(mdir, "model.onnx")):
            model = os.path.join(mdir, "model.onnx")
            wbytes = sum(os.path.getsize(os.path.join(mdir, f)) for f in os.listdir(mdir)
                         if f.endswith(".bin"))
        else:
            model, wbytes = gen_model(mdir, a.gib, a.dim)
        gib = wbytes / (1 << 30)
        print(f"model: {gib:.2f} GiB of float32 weights in {wbytes // (a.dim * a.dim * 4)} "
              f"external files, generated in {time.monotonic() - t0:.0f} s", flush=True)
        wfiles = sorted(os.path.join(mdir, f) for f in os.listdir(mdir) if f.endswith(".bin"))
        # files written less than 2 s before they are hashed are not kept in
        # the import cache (common/kiln_statcache.h): a user's model is older
        time.sleep(2.1)
        # the page cache warm for everybody: read once
        subprocess.run(["cat"] + wfiles, stdout=subprocess.DEVNULL, check=True)

        farm = Farm(a.bin, os.path.join(work, "farm"))
        farm.start_worker()
        env = dict(os.environ, KILN_CONFIG_DIR=os.path.join(work, "cfg"),
                   KILN_CACHE_DIR=os.path.join(work, "cache"))
        cold_s, client_kib, _ = timed([kiln, "compile", model, "-o",
                                       os.path.join(work, "a.kar"), "--broker",
                                       farm.endpoint, "--json"], env=env)
        print(f"cold compile {cold_s:.1f} s, client peak {mib(client_kib):.0f} MiB", flush=True)
        hit_s, hit_kib, hit = timed([kiln, "compile", model, "-o", os.path.join(work, "b.kar"),
                                     "--broker", farm.endpoint, "--json"], env=env)
        assert json.loads(hit.stdout)["cached"], hit.stdout
        print(f"cache hit {hit_s:.1f} s, client peak {mib(hit_kib):.0f} MiB", flush=True)
        os.unlink(os.path.join(work, "b.kar"))
        t0 = time.monotonic()
        subprocess.run(["sha256sum"] + wfiles, stdout=subprocess.DEVNULL, check=True)
        sha_s = time.monotonic() - t0
        peaks = farm.peaks()
        print(f"broker peak {mib(peaks['broker']):.0f} MiB, worker peak "
              f"{mib(peaks['worker']):.0f} MiB", flush=True)

        # kiln-run, 2 replicas
        import numpy as np
        x = os.path.join(work, "x.npy")
        np.save(x, np.random.default_rng(0).standard_normal((2, a.dim)).astype(np.float32))
        _, run_kib, rp = timed([os.path.join(a.bin, "kiln-run"), os.path.join(work, "a.kar"),
                                "--keyring", farm.keyring, "--input", x, "--dynamic-batch",
                                "--replicas", "2", "--bench", "3", "--json"])
        runinfo = json.loads(rp.stdout.strip().splitlines()[-1])
        run_peak = runinfo.get("peak_rss_kib", run_kib)
        print(f"kiln-run 2 replicas peak {mib(run_peak):.0f} MiB", flush=True)
        # room on disk for the second farm
        farm.stop()
        farm = None
        shutil.rmtree(os.path.join(work, "farm"), ignore_errors=True)
        os.unlink(os.path.join(work, "a.kar"))

        # upload: a fresh broker, this client's upload path (bench_large upload)
        up = None
        exe = a.bench_farm
        bl = os.path.join(os.path.dirname(exe), "bench_large")
        if os.path.exists(bl):
            farm2 = Farm(a.bin, os.path.join(work, "farm2"))
            _, up_kib, p = timed([bl, "upload", farm2.endpoint, model], env=env)
            up = json.loads(p.stdout.strip().splitlines()[-1])
            up["client_kib"] = up_kib
            farm2.stop()
            farm2 = None
        mb = max(64, min(2048, int(wbytes >> 20)))
        sha1 = json.loads(subprocess.run([exe, "sha", str(mb)], capture_output=True,
                                         text=True, check=True).stdout)
        raw = json.loads(subprocess.run([exe, "raw", str(mb)], capture_output=True,
                                        text=True, check=True).stdout)

        rows.append(("weights (float32, external data)", f"{gib:.2f} GiB", ""))
        rows.append(("client peak RSS (`kiln compile`, cold)",
                     f"{mib(client_kib):.0f} MiB = {client_kib * 1024 / wbytes:.2f} x weights",
                     "< 1 GiB"))
        rows.append(("client peak RSS (cache hit)", f"{mib(hit_kib):.0f} MiB", "< 1 GiB"))
        rows.append(("broker peak RSS", f"{mib(peaks['broker']):.0f} MiB", "< 512 MiB"))
        rows.append(("worker peak RSS", f"{mib(peaks['worker']):.0f} MiB", "< 512 MiB"))
        rows.append(("kiln-run, 2 replicas, peak RSS",
                     f"{mib(run_peak):.0f} MiB = {run_peak * 1024 / wbytes:.2f} x weights",
                     "< 1.1 x"))
        rows.append(("cold farm compile", f"{cold_s:.1f} s", ""))
        rows.append(("cache hit", f"{hit_s:.1f} s = {hit_s / sha_s:.2f} x sha256sum "
                     f"({sha_s:.1f} s)", "<= 2 x"))
        if up:
            rate = up["first_mib_per_s"]
            rows.append(("upload to a fresh broker",
                         f"{rate:.0f} MiB/s = {rate / sha1['mib_per_s']:.2f} x SHA-256 on one "
                         f"core ({sha1['mib_per_s']:.0f} MiB/s), {rate / raw['mib_per_s']:.2f} x "
                         f"raw ZeroMQ ({raw['mib_per_s']:.0f} MiB/s)", ">= 0.9 x SHA-256"))
            rows.append(("second upload of the same weights (import, then FIND)",
                         f"{up['import_s'] + up['second_s']:.1f} s (import {up['import_s']:.1f} s"
                         f" with {up['import_cache_hits']} of "
                         f"{up['import_cache_hits'] + up['import_cache_misses']} weight files "
                         f"known to the import cache, FIND {up['second_s']:.2f} s, "
                         f"{up['second_sent']} bytes sent)", ""))
        print()
        print("| measurement | result | target |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
    finally:
        for f in (farm, farm2):
            if f:
                f.stop()
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
