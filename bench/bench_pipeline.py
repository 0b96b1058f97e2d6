#!/usr/bin/python3
"""Pipelining (--pipeline-cores 2) against one core and against data
parallelism on the same two cores, on a stream of 32 inputs: resnet50
(torchvision, random weights, 1 × 3 × 224²) and a BERT-like encoder (token
and position embeddings, an attention mask every layer reads, 4 layers of
d_model 256, 8 heads, FFN 1024, 128 tokens, a pooler).  Prints a table;
asserts nothing about time.

    make bench-pipeline
    /usr/bin/python3 bench/bench_pipeline.py --models encoder --rounds 2

Each model is exported with torch.onnx.export (opset 14), imported, and
compiled twice with kiln-cc: as it is, and with --pipeline-cores 2.  The
two artifacts' outputs on the same input are compared first: they must
be identical (the stages run the same kernels on the same offsets).
Then the same batch of 32 (traced at batch 1) is timed with
`kiln-run --dynamic-batch --bench N --json`, which splits it into 32
micro-batches:

  1 core       the plain artifact, one replica, KILN_RT_NUM_CORES=1
  pipeline     the pipelined artifact on 2 cores: the micro-batches stream
               through its two stages, several in flight
  replicas     the plain artifact, 2 replicas on the 2 cores
               (`--replicas 2`, what kiln.DataParallel and dynamic
               batching do): each takes micro-batches from a shared counter

The configurations take turns for R rounds; the table shows the median
over rounds of rows/s (at each run's median latency) and the peak RSS of
kiln-run (VmHWM; the 32 inputs and outputs are in it alike for all).  With
KILN_RT_PROFILE=1 one more pipelined run prints each stage's measured time
beside the cost model's estimate, shown under the table.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, ".."))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
STREAM = 32


def _encoder_class():
    import torch
    import torch.nn as nn

    class Encoder(nn.Module):
        """BERT-like: embeddings, a padding mask read by every layer,
        post-norm encoder layers, a tanh pooler on the first token."""

        def __init__(self, vocab=8000, d=256, heads=8, ffn=1024, layers=4, tokens=128):
            super().__init__()
            self.heads = heads
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(1, tokens, d) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True,
                                           activation="gelu")
                for _ in range(layers))
            self.pool = nn.Linear(d, d)

        def forward(self, ids, mask):
            h = self.tok(ids) + self.pos
            bias = (1.0 - mask)[:, None, :] * -10000.0
            bias = bias.repeat_interleave(self.heads, 0).expand(-1, ids.shape[1], -1)
            for layer in self.layers:
                h = layer(h, src_mask=bias)
            return torch.tanh(self.pool(h[:, 0]))
    return Encoder


def build(name):
    """(model, example inputs as a tuple, input names), seeded."""
    import torch
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision
        return torchvision.models.resnet50().eval(), (torch.rand(1, 3, 224, 224),), ["x"]
    if name == "encoder":
        ids = torch.randint(0, 8000, (1, 128))
        mask = torch.ones(1, 128)
        mask[:, 100:] = 0
        return _encoder_class()().eval(), (ids, mask), ["ids", "mask"]
    raise SystemExit(f"unknown model {name}")


def run(args, env=None):
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


def prepare(name, workdir, key, keyring):
    import torch
    model, xs, names = build(name)
    onnx_path = os.path.join(workdir, f"{name}.onnx")
    for p in model.parameters():        # the plain path exports (no fast path)
        p.requires_grad_(True)
    torch.onnx.export(model, xs, onnx_path, input_names=names, output_names=["y"],
                      opset_version=14)
    kgraph = os.path.join(workdir, f"{name}.kgraph")
    run([os.path.join(BIN, "kiln"), "import", onnx_path, "-o", kgraph])
    kars = {}
    for kind, args in (("plain", "--optlevel 2"),
                       ("pipelined", "--optlevel 2 --pipeline-cores 2")):
        kars[kind] = os.path.join(workdir, f"{name}-{kind}.kar")
        run([os.path.join(BIN, "kiln-cc"), kgraph, "-o", kars[kind], "--key", key,
             "--compiler-args", args])
    one, stream = [], []
    for n, x in zip(names, xs):
        p1 = os.path.join(workdir, f"{name}-{n}-1.npy")
        np.save(p1, x.numpy())
        one.append(f"{n}={p1}")
        reps = [1] * x.dim()
        reps[0] = STREAM
        big = x.repeat(*reps).clone()
        if big.dtype == torch.float32 and n != "mask":
            big = torch.rand_like(big)
        elif n == "ids":
            big = torch.randint(0, 8000, big.shape)
        ps = os.path.join(workdir, f"{name}-{n}-{STREAM}.npy")
        np.save(ps, big.numpy())
        stream.append(f"{n}={ps}")
    outs = {}
    for kind, kar in kars.items():
        out = os.path.join(workdir, f"{name}-{kind}-out")
        args = [os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--output-dir", out]
        for i in stream:
            args += ["--input", i]
        run(args + ["--dynamic-batch"])
        outs[kind] = np.load(os.path.join(out, "y.npy"))
    with torch.no_grad():
        want = model(*[torch.from_numpy(np.load(s.split("=", 1)[1])) for s in stream]).numpy()
    same = bool(np.array_equal(outs["plain"], outs["pipelined"]))
    err = float(np.abs(outs["pipelined"] - want).max() / np.abs(want).max())
    man = json.loads(run([os.path.join(BIN, "kiln"), "inspect", kars["pipelined"]]).stdout)
    return kars, stream, {"same": same, "rel_err": err, "stages": man["pipeline"]["stages"]}


def bench(kar, stream, keyring, runs, replicas, cores, profile=False):
    env = dict(os.environ, KILN_RT_NUM_CORES=str(cores))
    if profile:
        env["KILN_RT_PROFILE"] = "1"
    args = [os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--dynamic-batch",
            "--replicas", str(replicas), "--bench", str(runs), "--json"]
    for i in stream:
        args += ["--input", i]
    proc = run(args, env=env)
    if profile:
        return proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


CONFIGS = [("1 core", "plain", 1, 1), ("pipeline, 2 stages", "pipelined", 1, 2),
           ("2 replicas", "plain", 2, 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,encoder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timed runs of the stream per turn")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-pipeline-") as work:
        keys = os.path.join(work, "keys")
        run([os.path.join(BIN, "kiln"), "keygen", "--out", keys])
        keyring = os.path.join(work, "keyring")
        os.makedirs(keyring)
        os.link(os.path.join(keys, "kiln.pub"), os.path.join(keyring, "k.pub"))
        for name in a.models.split(","):
            kars, stream, info = prepare(name, work, os.path.join(keys, "kiln.key"), keyring)
            print(f"{name}: pipelined output identical to the plain one: {info['same']}; "
                  f"max error against torch {info['rel_err']:.1e} of the largest output",
                  flush=True)
            samples = {c[0]: [] for c in CONFIGS}
            rss = {c[0]: [] for c in CONFIGS}
            for r in range(a.rounds):
                for label, kind, replicas, cores in CONFIGS:
                    res = bench(kars[kind], stream, keyring, a.runs, replicas, cores)
                    samples[label].append(res["rows_per_s"])
                    rss[label].append(res["peak_rss_kib"] / 1024)
                    print(f"  round {r}: {label}: {res['rows_per_s']:.2f} rows/s, "
                          f"peak RSS {res['peak_rss_kib'] / 1024:.0f} MiB", flush=True)
            prof = bench(kars["pipelined"], stream, keyring, 1, 1, 2, profile=True)
            measured = [float(m) for m in re.findall(r"cost model .*? = [\d.]+ ms estimated "
                                                     r"per run, ([\d.]+) ms measured", prof)]
            base = statistics.median(samples["1 core"])
            for label, kind, replicas, cores in CONFIGS:
                rows.append((name, label, statistics.median(samples[label]),
                             statistics.median(samples[label]) / base,
                             statistics.median(rss[label]), min(samples[label]),
                             max(samples[label])))
            st = info["stages"]
            print(f"  stages: " + "; ".join(
                f"ops {s['first_op']}..{s['first_op'] + s['ops'] - 1}, "
                f"{s['flops'] / 1e9:.2f} GFLOP, {s['weights_bytes'] / 2**20:.1f} MiB of "
                f"weights, estimate {s['cost_ns'] / 1e6:.1f} ms"
                + (f", measured {measured[i]:.1f} ms" if i < len(measured) else "")
                for i, s in enumerate(st)), flush=True)
    print()
    print(f"| model | configuration | rows/s (stream of {STREAM}) | × 1 core | "
          f"peak RSS (MiB) | rows/s spread |")
    print("|---|---|---|---|---|---|")
    for name, label, rps, ratio, mib, lo, hi in rows:
        print(f"| {name} | {label} | {rps:.2f} | {ratio:.2f} | {mib:.0f} | "
              f"{lo:.2f}–{hi:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
