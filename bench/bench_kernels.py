#!/usr/bin/env python3
"""kiln's kernels against oneDNN, XNNPACK, BLIS and OpenBLAS, one op at a time.

The shapes are convolutions and matrix products from the models of
`make bench-runtime`: depthwise 3x3/5x5 (mobilenet, efficientnet), the 7x7
depthwise of convnext, pointwise 1x1 and 3x3 products (resnet50,
mobilenet), the stem, and the linear layers of BERT-base and vit_b_16.
For each shape, torch makes the weights, bias and input and the reference
output; kiln runs the op as a one-node model (`kiln-cc --optlevel 3`,
`kiln-run --bench`), the libraries through bench/bench_kernels.c on the
same data in the layout each prefers (converted before timing: oneDNN's
blocked layouts, XNNPACK's NHWC), batch 1, one thread.  What is timed is
the op alone: kiln's per-op profile (KILN_RT_PROFILE), not the copies of
the model's input and output around it; the library's primitive.  Runners
take turns each round; a runner's time is the lowest over the rounds of
its mean per run (a loaded machine only ever adds time).  Every output is checked against torch (exit
1 beyond 1e-4 of the output's magnitude).  Prints the docs/engine.md table.
Asserts nothing about time.

    make bench-kernels
    /usr/bin/python3 bench/bench_kernels.py --only dw3 --rounds 3
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("KILN_BIN", os.path.join(HERE, "..", "build", "bin"))

# name, what, conv: (C, H, W, O, KH, KW, stride, pad, groups) / gemm: (M, K, N)
SHAPES = [
    ("dw3 32x112x112", "mobilenet_v2", "conv", (32, 112, 112, 32, 3, 3, 1, 1, 32)),
    ("dw3 144x56x56", "mobilenet_v2", "conv", (144, 56, 56, 144, 3, 3, 1, 1, 144)),
    ("dw3 s2 144x56x56", "mobilenet_v2", "conv", (144, 56, 56, 144, 3, 3, 2, 1, 144)),
    ("dw3 576x14x14", "mobilenet_v2", "conv", (576, 14, 14, 576, 3, 3, 1, 1, 576)),
    ("dw5 240x28x28", "efficientnet_b0", "conv", (240, 28, 28, 240, 5, 5, 1, 2, 240)),
    ("dw5 672x14x14", "efficientnet_b0", "conv", (672, 14, 14, 672, 5, 5, 1, 2, 672)),
    ("dw7 96x56x56", "convnext_tiny", "conv", (96, 56, 56, 96, 7, 7, 1, 3, 96)),
    ("dw7 384x14x14", "convnext_tiny", "conv", (384, 14, 14, 384, 7, 7, 1, 3, 384)),
    ("pw 32>16 112x112", "mobilenet_v2", "conv", (32, 112, 112, 16, 1, 1, 1, 0, 1)),
    ("pw 144>24 56x56", "mobilenet_v2", "conv", (144, 56, 56, 24, 1, 1, 1, 0, 1)),
    ("pw 96>576 14x14", "mobilenet_v2", "conv", (96, 14, 14, 576, 1, 1, 1, 0, 1)),
    ("pw 256>64 56x56", "resnet50", "conv", (256, 56, 56, 64, 1, 1, 1, 0, 1)),
    ("pw 1024>256 14x14", "resnet50", "conv", (1024, 14, 14, 256, 1, 1, 1, 0, 1)),
    ("pw 512>2048 7x7", "resnet50", "conv", (512, 7, 7, 2048, 1, 1, 1, 0, 1)),
    ("c3 64 56x56", "resnet50", "conv", (64, 56, 56, 64, 3, 3, 1, 1, 1)),
    ("c3 256 14x14", "resnet50", "conv", (256, 14, 14, 256, 3, 3, 1, 1, 1)),
    ("stem 7x7 s2 3>64", "resnet50", "conv", (3, 224, 224, 64, 7, 7, 2, 3, 1)),
    ("gemm 128x768x768", "BERT-base", "gemm", (128, 768, 768)),
    ("gemm 128x768x3072", "BERT-base", "gemm", (128, 768, 3072)),
    ("gemm 128x3072x768", "BERT-base", "gemm", (128, 3072, 768)),
    ("gemm 197x768x2304", "vit_b_16", "gemm", (197, 768, 2304)),
]

CONV_LIBS = ["onednn", "onednn-nchw", "xnnpack"]
GEMM_LIBS = ["onednn", "xnnpack", "blis", "openblas"]


def run(args, **kw):
    proc = subprocess.run(args, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


def one_thread_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS",
                "KILN_RT_THREADS"):
        env[var] = "1"
    return env


def prepare(kind, dims, workdir, key, keyring):
    """Weights, input and torch's output in workdir; the one-op artifact."""
    import torch
    torch.manual_seed(0)
    if kind == "conv":
        c, h, w, o, kh, kw, stride, pad, groups = dims
        mod = torch.nn.Conv2d(c, o, (kh, kw), stride, pad, groups=groups)
        x = torch.randn(1, c, h, w)
    else:
        m, k, n = dims
        mod = torch.nn.Linear(k, n)
        x = torch.randn(m, k)
    with torch.no_grad():
        want = mod(x).numpy()
    for name, t in (("x", x), ("w", mod.weight), ("b", mod.bias)):
        t.detach().numpy().astype(np.float32).tofile(os.path.join(workdir, f"{name}.bin"))
    onnx_path = os.path.join(workdir, "op.onnx")
    torch.onnx.export(mod, (x,), onnx_path, input_names=["x"], output_names=["y"],
                      opset_version=14)
    kgraph = os.path.join(workdir, "op.kgraph")
    kar = os.path.join(workdir, "op.kar")
    run([os.path.join(BIN, "kiln"), "import", onnx_path, "-o", kgraph])
    run([os.path.join(BIN, "kiln-cc"), kgraph, "-o", kar, "--key", key,
         "--compiler-args", "--optlevel 3"])
    xpath = os.path.join(workdir, "x.npy")
    np.save(xpath, x.numpy())
    out = os.path.join(workdir, "kiln_out")
    run([os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--input", f"x={xpath}",
         "--output-dir", out])
    np.load(os.path.join(out, "y.npy")).astype(np.float32).tofile(
        os.path.join(workdir, "kiln.out.bin"))
    return kar, xpath, want


def rel_err(path, want):
    got = np.fromfile(path, dtype=np.float32)
    if got.size != want.size:
        return float("inf")
    return float(np.abs(got - want.ravel()).max() / max(np.abs(want).max(), 1e-30))


def time_kiln(kar, xpath, keyring, iters):
    """The op's own time: kiln's profile (KILN_RT_PROFILE) times each op,
    not the copies of inputs and outputs around a run of the model."""
    env = one_thread_env()
    env["KILN_RT_PROFILE"] = "1"
    proc = run([os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--input",
                f"x={xpath}", "--bench", str(iters), "--json"], env=env)
    m = re.search(r"kiln profile: \d+ runs, ([0-9.]+) ms per run in 1 ops", proc.stderr)
    if not m:
        raise SystemExit(f"{kar}: no one-op profile from kiln-run:\n{proc.stderr}")
    return float(m.group(1))


def time_lib(tool, lib, kind, dims, workdir, iters, blis):
    env = one_thread_env()
    if blis:
        env["BENCH_BLIS_LIB"] = blis
    proc = run([tool, lib, kind] + [str(d) for d in dims] + [workdir, str(iters)], env=env)
    return json.loads(proc.stdout)["mean_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tool", default=os.path.join(HERE, "..", "build", "bench", "bench_kernels"))
    ap.add_argument("--blis", default=None, help="BLIS's libblis.so.4 (serial build)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", nargs="*", default=None, help="shape name prefixes")
    args = ap.parse_args()
    if not (1 <= args.rounds <= 50 and 1 <= args.iters <= 10000):
        raise SystemExit("--rounds 1..50, --iters 1..10000")
    shapes = [s for s in SHAPES
              if not args.only or any(s[0].startswith(p) for p in args.only)]
    bad = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernels-") as tmp:
        keydir = os.path.join(tmp, "key")
        keyring = os.path.join(tmp, "keys")
        os.makedirs(keyring)
        run([os.path.join(BIN, "kiln"), "keygen", "--out", keydir])
        key = os.path.join(keydir, "kiln.key")
        shutil.copy(os.path.join(keydir, "kiln.pub"), keyring)
        for name, model, kind, dims in shapes:
            workdir = os.path.join(tmp, name.replace(" ", "_").replace(">", "-"))
            os.makedirs(workdir)
            kar, xpath, want = prepare(kind, dims, workdir, key, keyring)
            libs = CONV_LIBS if kind == "conv" else GEMM_LIBS
            if "blis" in libs and not args.blis:
                libs = [lib for lib in libs if lib != "blis"]
            runners = ["kiln"] + libs
            times = {r: [] for r in runners}
            for rnd in range(args.rounds):
                order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
                for r in order:
                    if r == "kiln":
                        t = time_kiln(kar, xpath, keyring, args.iters)
                    else:
                        t = time_lib(args.tool, r, kind, dims, workdir, args.iters, args.blis)
                    times[r].append(t)
            errs = {r: rel_err(os.path.join(workdir, f"{r}.out.bin"), want) for r in runners}
            for r, e in errs.items():
                if not e <= 1e-4:
                    bad.append(f"{name} {r}: max error {e:.2e} of the output's magnitude")
            best_of = {r: min(times[r]) for r in runners}
            rows.append((name, model, runners, best_of))
            line = "  ".join(f"{r} {best_of[r]:.3f}" for r in runners)
            print(f"{name} ({model}) ms: {line}", flush=True)

    print()
    print("| op | model | kiln ms | oneDNN ms | oneDNN NCHW ms | XNNPACK ms | BLIS ms "
          "| OpenBLAS ms | kiln / best library |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model, runners, med in rows:
        def cell(lib):
            return f"{med[lib]:.3f}" if lib in med else "–"
        libs = [r for r in runners if r != "kiln"]
        best = min(libs, key=lambda r: med[r])
        print(f"| {name} | {model} | {cell('kiln')} | {cell('onednn')} "
              f"| {cell('onednn-nchw')} | {cell('xnnpack')} "
              f"| {cell('blis')} | {cell('openblas')} | {med['kiln'] / med[best]:.2f} ({best}) |")
    print("\nms per run of the op alone, one thread, batch 1: the lowest over the rounds of "
          "each round's mean (kiln: its per-op profile; the libraries: the primitive's run).")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
