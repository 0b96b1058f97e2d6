#!/usr/bin/python3
"""kiln against ONNX Runtime op by op: where a model's time goes in each
engine, from each engine's own profiler, the engines taking turns.

    /usr/bin/python3 bench/bench_ops_ort.py --models resnet50 --threads 1 --rounds 5

Each model is exported and compiled as bench/bench_runtime.py does it
(`-O3`).  Each round runs kiln-run with KILN_RT_PROFILE=all (every op's
time per run) and then ONNX Runtime with its profiler on
(bench/ort_worker.js with a profile prefix, the session otherwise as
bench_runtime.py's); an op's figure is its lowest per-run time over the
rounds, so that a host whose speed moves from second to second (a shared VM) compares
the engines at their best.  The two engines fuse differently (ONNX
Runtime adds layout reorders, kiln fuses residuals and activations into
the products), so ops are matched by kind and output shape, not one to
one: convolutions by (channels, height, width) whatever the layout
(NCHW, channels-last or ONNX Runtime's NCHWc, whose blocks of 16 pad the
channels: both sides' channels are rounded up to 16), the rest by kind.  The
table lists those groups with their op counts and summed times, the
largest differences first.  Profiling adds its own cost to both (a clock
read per op in kiln, an event per node in ONNX Runtime): the sums are
for comparing ops, not the latencies `make bench-runtime` measures.
Needs ONNX Runtime (`make bench-deps`).
"""

import argparse
import atexit
import collections
import glob
import json
import os
import re
import shutil
import tempfile

import bench_runtime as B

# Both engines' op names to one: kiln's kernels (program-format.md) and
# the ONNX Runtime nodes that do the same work.
# (Gemm and MatMul are one kind: each engine turns some of one into the
# other, MatMul and Add into ONNX Runtime's Gemm.)
KIND = {"Conv": "conv", "FusedConv": "conv", "conv2d": "conv", "Gemm": "matmul",
        "gemm": "matmul", "MatMul": "matmul", "FusedMatMul": "matmul", "matmul": "matmul",
        "Mul": "mul", "Add": "add", "Softmax": "softmax", "MaxPool": "maxpool2d",
        "AveragePool": "avgpool2d", "GlobalAveragePool": "global_avgpool",
        "LayerNormalization": "layer_norm", "SkipLayerNormalization": "layer_norm",
        "Gelu": "gelu", "Sigmoid": "sigmoid", "HardSigmoid": "hard_sigmoid",
        "Transpose": "strided", "Concat": "concat"}


def chw(shape):
    """(channels rounded up to 16, height, width) of an NCHW or NCHWc (5-D)
    output, () else: ONNX Runtime's blocked layout pads the channels to
    its blocks of 16 (72 become 80)."""
    if len(shape) == 5:
        return ((shape[1] * shape[4] + 15) // 16 * 16, shape[2], shape[3])
    if len(shape) == 4:
        return ((shape[1] + 15) // 16 * 16, shape[2], shape[3])
    return ()


def key_of(kind, shape, cl=False):
    k = KIND.get(kind, kind)
    if k == "conv":
        s = tuple(shape)
        if len(s) == 4 and cl:          # kiln's channels-last [n, h, w, c]
            s = (s[0], s[3], s[1], s[2])
        return (k, chw(s))
    return (k, ())


def kiln_ops(kar, xpath, keyring, threads, iters):
    """{op index: (kind, output shape, ms a run)} from KILN_RT_PROFILE=all."""
    env = dict(B.thread_env(threads), KILN_RT_THREADS=str(threads), KILN_RT_PROFILE="all")
    proc = B.run([os.path.join(B.BIN, "kiln-run"), kar, "--keyring", keyring, "--input",
                  f"x={xpath}", "--bench", str(iters)], env=env)
    ops = {}
    for line in proc.stderr.splitlines():
        m = re.match(r"\s+(\d+) (\S+)\s+([\d.]+) ms.*-> \[([\d, ]*)\]", line)
        if m:
            shape = [int(v) for v in m.group(4).split(",") if v.strip()]
            ops[int(m.group(1))] = (m.group(2), shape, float(m.group(3)))
    return ops


def ort_ops(rep, xpath, threads, iters, workdir):
    """{node name: (op type, output shape, ms a run)} from ORT's profiler."""
    prefix = os.path.join(workdir, "ortprof")
    for f in glob.glob(prefix + "*.json"):
        os.unlink(f)
    env = dict(B.thread_env(threads), NODE_PATH=B.ORT_DIR)
    B.run(["node", os.path.join(B.HERE, "ort_worker.js"), rep["onnx"], str(threads),
           str(iters), "x", rep["dtype"], rep["shape"], xpath + ".bin", prefix], env=env)
    files = glob.glob(prefix + "*.json")
    if not files:
        raise SystemExit("ONNX Runtime wrote no profile")
    total, runs, info = collections.defaultdict(float), collections.Counter(), {}
    with open(max(files, key=os.path.getmtime)) as f:
        events = json.load(f)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        shape = []
        try:
            shape = list(list(args["output_type_shape"][0].values())[0])
        except (KeyError, IndexError, AttributeError, TypeError):
            pass
        info[e["name"]] = (args.get("op_name", "?"), shape)
        total[e["name"]] += e["dur"] / 1000.0
        runs[e["name"]] += 1
    return {n: (info[n][0], info[n][1], total[n] / runs[n]) for n in total}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50"],
                    choices=B.MODELS + B.EXTRA)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="profiled runs a round")
    ap.add_argument("--top", type=int, default=15, help="groups listed a model")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 100 or not 1 <= args.iters <= 10000 \
            or not 1 <= args.threads <= 256:
        raise SystemExit("--rounds 1..100, --iters 1..10000, --threads 1..256")
    if not B.ort_available():
        raise SystemExit(f"ONNX Runtime not found in {B.ORT_DIR}: make bench-deps")
    work = tempfile.mkdtemp(prefix="kiln-ops-")
    atexit.register(shutil.rmtree, work, True)      # (exports and artifacts: GBs)
    key, keyring = os.path.join(work, "key.pem"), os.path.join(work, "keyring")
    os.mkdir(keyring)
    B.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", key])
    B.run(["openssl", "pkey", "-in", key, "-pubout", "-out", os.path.join(keyring, "k.pub")])
    for name in args.models:
        kar, xpath, rep = B.prepare(name, work, key, keyring)
        kbest, obest = {}, {}
        for _ in range(args.rounds):
            for i, (kind, shape, ms) in kiln_ops(kar, xpath, keyring, args.threads,
                                                 args.iters).items():
                kbest[i] = (kind, shape, min(ms, kbest.get(i, (0, 0, ms))[2]))
            for n, (kind, shape, ms) in ort_ops(rep, xpath, args.threads, args.iters,
                                                work).items():
                obest[n] = (kind, shape, min(ms, obest.get(n, (0, 0, ms))[2]))
        groups = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
        for kind, shape, ms in kbest.values():
            # kiln prints a channels-last output as [n, h, w, c]; the bench's
            # images are square, so h == w tells it from [n, c, h, w]
            cl = len(shape) == 4 and shape[1] == shape[2] and shape[3] != shape[1]
            g = groups[key_of(kind, shape, cl)]
            g[0] += 1
            g[1] += ms
        for kind, shape, ms in obest.values():
            g = groups[key_of(kind, shape)]
            g[2] += 1
            g[3] += ms
        ksum = sum(v[2] for v in kbest.values())
        osum = sum(v[2] for v in obest.values())
        print(f"{name}, {args.threads} thread(s), lowest of {args.rounds} rounds of "
              f"{args.iters} profiled runs: kiln {ksum:.2f} ms in {len(kbest)} ops, "
              f"ONNX Runtime {osum:.2f} ms in {len(obest)} nodes (kiln / ORT "
              f"{ksum / osum:.2f})")
        print("| op kind, output (C to 16, H, W) | kiln ops | kiln ms | ORT nodes | ORT ms "
              "| kiln - ORT ms |")
        print("|---|---|---|---|---|---|")
        for k, g in sorted(groups.items(), key=lambda kv: -abs(kv[1][1] - kv[1][3]))[:args.top]:
            label = f"{k[0]} {k[1]}" if k[1] else k[0]
            print(f"| {label} | {g[0]} | {g[1]:.3f} | {g[2]} | {g[3]:.3f} | "
                  f"{g[1] - g[3]:+.3f} |")
        print(flush=True)


if __name__ == "__main__":
    main()
