#!/usr/bin/python3
"""kiln against PyTorch on the CPU, side by side in one run: resnet18,
resnet50, mobilenet_v2 (torchvision, random weights) and a 4-layer
TransformerEncoder (d_model 256, 8 heads, batch_first, 128 tokens) at
batch 1, with 1 and 2 threads.  Prints a table of median latencies and
the ratio kiln / torch; asserts nothing about time.

    make bench-runtime                   # what the README's table comes from
    /usr/bin/python3 bench/bench_runtime.py --models resnet18 --threads 1 --rounds 2

kiln: the model is exported with torch.onnx.export (opset 14), imported,
compiled with `kiln-cc --optlevel 3` and timed by `kiln-run --bench N`
with KILN_RT_THREADS=T.  torch: torch.jit.freeze of torch.jit.trace, timed
in a process of its own started with OMP_NUM_THREADS, MKL_NUM_THREADS and
OPENBLAS_NUM_THREADS at T and torch.set_num_threads(T) (torch's BLAS,
OpenBLAS on Debian, otherwise starts a thread per core whatever
set_num_threads says).  Both see the same input.  Timings on a shared
machine are noisy: each measurement is the median of N runs, kiln and
torch take turns for R rounds, and the table shows the median of the
rounds.  The output of each is checked against torch eager first.

Also printed: each model's compile time (kiln-cc, wall clock, including
writing and signing the artifact) and the memory plan (the arena against
one buffer per intermediate, kiln-cc --json).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, ".."))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
MODELS = ["resnet18", "resnet50", "mobilenet_v2", "transformer"]


def build_model(name):
    """(model in eval mode, example input), seeded."""
    import torch
    torch.manual_seed(0)
    if name == "transformer":
        layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, batch_first=True)
        model, shape = torch.nn.TransformerEncoder(layer, num_layers=4), (1, 128, 256)
    else:
        import torchvision
        model, shape = getattr(torchvision.models, name)(), (1, 3, 224, 224)
    model.eval()
    return model, torch.rand(*shape)


def torch_worker(name, threads, iters):
    """Child process: trace and freeze the model, then on each line of
    stdin time `iters` runs and print their latencies (ms) as JSON."""
    import torch
    torch.set_num_threads(threads)
    model, x = build_model(name)
    with torch.no_grad():
        frozen = torch.jit.freeze(torch.jit.trace(model, x))
        for _ in range(3):
            frozen(x)
        print(json.dumps({"ready": True}), flush=True)
        for _ in sys.stdin:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                frozen(x)
                times.append((time.perf_counter() - t0) * 1e3)
            print(json.dumps({"times": times}), flush=True)


def thread_env(threads):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def run(args, **kw):
    proc = subprocess.run(args, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


def prepare(name, workdir, key, keyring):
    """Export, import and compile; returns the artifact, the input and the
    compile report."""
    import torch
    model, x = build_model(name)
    with torch.no_grad():
        want = model(x).numpy()
    onnx_path = os.path.join(workdir, f"{name}.onnx")
    # autograd on: the transformer's plain path exports (see test_models.py)
    torch.onnx.export(model, (x,), onnx_path, input_names=["x"], output_names=["y"],
                      opset_version=14)
    kgraph = os.path.join(workdir, f"{name}.kgraph")
    run([os.path.join(BIN, "kiln"), "import", onnx_path, "-o", kgraph])
    kar = os.path.join(workdir, f"{name}.kar")
    t0 = time.perf_counter()
    proc = run([os.path.join(BIN, "kiln-cc"), kgraph, "-o", kar, "--key", key, "--json",
                "--compiler-args", "--optlevel 3"])
    compile_s = time.perf_counter() - t0
    info = json.loads(proc.stdout)
    xpath = os.path.join(workdir, f"{name}_x.npy")
    np.save(xpath, x.numpy())
    out = os.path.join(workdir, f"{name}_out")
    run([os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--input",
         f"x={xpath}", "--output-dir", out])
    got = np.load(os.path.join(out, "y.npy"))
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return kar, xpath, {"compile_s": compile_s, "arena": info["arena_bytes"],
                        "naive": info["naive_bytes"], "rel_err": err}


def kiln_bench(kar, xpath, keyring, threads, iters):
    env = thread_env(threads)
    env["KILN_RT_THREADS"] = str(threads)
    proc = run([os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--input",
                f"x={xpath}", "--bench", str(iters), "--json"], env=env)
    return json.loads(proc.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--iters", type=int, default=20, help="runs per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="alternations kiln/torch")
    ap.add_argument("--torch-worker", nargs=3, metavar=("MODEL", "THREADS", "ITERS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker[0], int(args.torch_worker[1]),
                     int(args.torch_worker[2]))
        return

    work = tempfile.mkdtemp(prefix="kiln-bench-")
    key = os.path.join(work, "key.pem")
    keyring = os.path.join(work, "keyring")
    os.mkdir(keyring)
    run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", key])
    run(["openssl", "pkey", "-in", key, "-pubout", "-out", os.path.join(keyring, "k.pub")])
    print(f"kiln vs torch {__import__('torch').__version__}, batch 1, CPUs: "
          f"{os.cpu_count()}, median of {args.iters} runs, {args.rounds} rounds "
          f"alternating; ratio < 1 means kiln is faster", flush=True)

    rows, prep = [], {}
    for name in args.models:
        kar, xpath, rep = prepare(name, work, key, keyring)
        prep[name] = rep
        print(f"  {name}: compiled in {rep['compile_s']:.2f} s; arena "
              f"{rep['arena'] / 2**20:.1f} MiB against {rep['naive'] / 2**20:.1f} MiB "
              f"naive; max error vs torch eager {rep['rel_err']:.1e} of the output's "
              f"largest magnitude", flush=True)
        for threads in args.threads:
            worker = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--torch-worker", name,
                 str(threads), str(args.iters)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=thread_env(threads))
            assert json.loads(worker.stdout.readline()).get("ready")
            tmed, kmed, kp99, rss = [], [], [], 0
            for _ in range(args.rounds):
                worker.stdin.write("go\n")
                worker.stdin.flush()
                tmed.append(statistics.median(json.loads(worker.stdout.readline())["times"]))
                k = kiln_bench(kar, xpath, keyring, threads, args.iters)
                kmed.append(k["median_ms"])
                kp99.append(k["p99_ms"])
                rss = max(rss, k["peak_rss_kib"])
            worker.stdin.close()
            worker.wait()
            t, kk = statistics.median(tmed), statistics.median(kmed)
            rows.append((name, threads, t, kk, kk / t, statistics.median(kp99), rss))
            print(f"  {name} x{threads}: torch {t:.2f} ms, kiln {kk:.2f} ms, "
                  f"ratio {kk / t:.2f}", flush=True)

    print()
    print("| model | threads | torch (ms) | kiln (ms) | kiln / torch | kiln p99 (ms) "
          "| kiln peak RSS (MiB) | arena / naive (MiB) | compile (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, threads, t, k, r, p99, rss in rows:
        rep = prep[name]
        print(f"| {name} | {threads} | {t:.2f} | {k:.2f} | **{r:.2f}** | {p99:.2f} "
              f"| {rss / 1024:.0f} | {rep['arena'] / 2**20:.1f} / "
              f"{rep['naive'] / 2**20:.1f} | {rep['compile_s']:.2f} |")


if __name__ == "__main__":
    main()
