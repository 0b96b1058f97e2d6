#!/usr/bin/python3
"""kiln against PyTorch and ONNX Runtime on the CPU, side by side in one
run, at batch 1 with 1 and 2 threads: torchvision classifiers (random
weights), a 4-layer TransformerEncoder (d_model 256, 8 heads, batch_first,
128 tokens), a BERT-base-sized encoder (12 x 768, 12 heads, token ids of
128) and vit_b_16.  Prints a table of median latencies (wall clock) and
CPU time per run (user + system of every thread of the engine's process),
the ratios kiln / torch and kiln / ORT on both, with their geometric
means; asserts nothing about time.  On a machine shared with other work
the CPU time is the comparable figure: at 1 thread it is the latency a
quiet machine would show, while the wall clock also counts the time the
engine waited for a CPU.

    make bench-runtime                   # what the README's table comes from
    /usr/bin/python3 bench/bench_runtime.py --models resnet50 --threads 1 --rounds 2

On a host whose speed moves from second to second (a shared VM), `--stat
min --rounds 7` takes each engine's lowest round instead of the median of
the rounds (a loaded host only ever adds time, to either engine); and
`--no-torch` leaves torch out of the timing (it is still the reference
every output is checked against), which saves most of the run.

kiln: the model is exported with torch.onnx.export (opset 14), imported,
compiled with `kiln-cc --optlevel 3` and timed by one long-lived
`kiln-run --bench N --bench-stdin` with KILN_RT_THREADS=T (the artifact
verified, loaded and warmed up once, as ONNX Runtime's session is).
torch: torch.jit.freeze of torch.jit.trace, timed in a process of its
own started with OMP_NUM_THREADS, MKL_NUM_THREADS and
OPENBLAS_NUM_THREADS at T and torch.set_num_threads(T) (torch's BLAS,
OpenBLAS on Debian, otherwise starts a thread per core whatever
set_num_threads says).  ONNX Runtime: the CPU build from the npm registry
(onnxruntime-node, installed by `make bench-deps` into build/bench-deps
with --ignore-scripts), through its Node.js binding (bench/ort_worker.js),
on the same ONNX file and input, graph optimisation level "all", T
intra-op threads, sequential execution; the binding adds a few
microseconds a run, nothing at these latencies.  Every engine sees the
same input.  At 1 thread every engine's worker runs on the same CPU
(`taskset`: kiln's runtime pins its thread to a CPU, and on a small VM
one CPU can be busier than another for minutes).  Timings on a shared
machine are noisy: each measurement is
the median of N runs (CPU time: their mean), the engines take turns for R
rounds on each model (their order reversed every other round), and the
table shows the median of the rounds.  Short turns and many rounds
(the default: 5 runs, 15 rounds) put the engines side by side in each
of the host's slow and fast spells, where turns of 20 runs let a spell of
a few seconds fall on one engine's turn in every round.
The output of each is checked against torch eager first; kiln's at
`--optlevel 0` and `3`, which must both be within 1e-4 of the output's
largest magnitude (the script exits 1 otherwise, after the table).

Also printed: each model's compile time (kiln-cc, wall clock, including
writing and signing the artifact) and the memory plan (the arena against
one buffer per intermediate, kiln-cc --json).
"""

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_large import vmhwm_kib   # (the script's directory is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, ".."))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
# The issue-15 set (the default); on request resnet18 and the torchvision
# classifiers outside the set that README's second table times.
MODELS = ["resnet50", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0",
          "convnext_tiny", "regnet_y_400mf", "densenet121", "transformer", "bert_base",
          "vit_b_16"]
EXTRA = ["resnet18", "squeezenet1_1", "googlenet", "inception_v3", "regnet_x_400mf",
         "shufflenet_v2_x1_0", "mnasnet1_0", "resnext50_32x4d"]
TOLERANCE = 1e-4
# Before each turn: an engine's idle threads spin for a while after its
# last run (ONNX Runtime's for over 30 ms at 2 threads: mobilenet_v3_large
# took kiln 8.9 ms a run straight after ONNX Runtime's turn, 5.4 after a
# pause of 0.2 s), which would take the CPUs of the engine whose turn it is.
PAUSE_S = 0.2
ORT_DIR = os.environ.get("KILN_ORT_DIR", os.path.join(SRC, "build", "bench-deps",
                                                      "node_modules"))


def build_model(name):
    """(model in eval mode, example input), seeded."""
    import torch
    torch.manual_seed(0)
    if name == "transformer":
        layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, batch_first=True)
        model, x = torch.nn.TransformerEncoder(layer, num_layers=4), torch.rand(1, 128, 256)
    elif name == "bert_base":
        model = BertBase()
        x = torch.randint(0, 30522, (1, 128), dtype=torch.int64)
    else:
        import torchvision
        model, x = getattr(torchvision.models, name)(), torch.rand(1, 3, 224, 224)
        # Zero-initialised heads (vit's) would make every output 0.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 1 and float(p.abs().max()) == 0.0:
                    p.normal_(0, 0.02)
    model.eval()
    return model, x


def _bert_base_class():
    import torch

    class BertBase(torch.nn.Module):
        """A BERT-base-sized encoder: token and position embeddings on
        int64 ids, 12 layers of d_model 768, 12 heads, FFN 3072."""

        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(30522, 768)
            self.pos = torch.nn.Embedding(512, 768)
            self.norm = torch.nn.LayerNorm(768)
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True,
                                                     activation="gelu")
            self.enc = torch.nn.TransformerEncoder(layer, 12)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            return self.enc(self.norm(self.tok(ids) + self.pos(pos)))
    return BertBase


def BertBase():
    return _bert_base_class()()


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
            c0 = time.process_time()
            for _ in range(iters):
                t0 = time.perf_counter()
                frozen(x)
                times.append((time.perf_counter() - t0) * 1e3)
            cpu_ms = (time.process_time() - c0) * 1e3 / iters
            print(json.dumps({"times": times, "cpu_ms": cpu_ms}), flush=True)


def pin(threads):
    """The command prefix that puts a 1-thread worker on one CPU, the same
    for every engine: kiln's runtime pins its model's thread to a CPU of
    its own (the first it may use), while another engine's thread may run
    on any, and on a small shared VM one CPU can be busier than another
    for minutes (the harness, interrupts), which then falls on one engine
    only.  At more threads each engine has every CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads != 1 or len(cpus) < 2 or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(cpus[-1])]


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
    for p in model.parameters():
        p.requires_grad_(True)
    torch.onnx.export(model, (x,), onnx_path, input_names=["x"], output_names=["y"],
                      opset_version=14)
    kgraph = os.path.join(workdir, f"{name}.kgraph")
    run([os.path.join(BIN, "kiln"), "import", onnx_path, "-o", kgraph])
    xpath = os.path.join(workdir, f"{name}_x.npy")
    np.save(xpath, x.numpy())
    errs = {}
    for level in (0, 3):
        kar = os.path.join(workdir, f"{name}_O{level}.kar")
        t0 = time.perf_counter()
        proc = run([os.path.join(BIN, "kiln-cc"), kgraph, "-o", kar, "--key", key, "--json",
                    "--compiler-args", f"--optlevel {level}"])
        compile_s = time.perf_counter() - t0
        info = json.loads(proc.stdout)
        out = os.path.join(workdir, f"{name}_O{level}_out")
        run([os.path.join(BIN, "kiln-run"), kar, "--keyring", keyring, "--input",
             f"x={xpath}", "--output-dir", out])
        got = np.load(os.path.join(out, "y.npy"))
        errs[level] = float(np.abs(got - want).max() / np.abs(want).max())
        if level == 0:
            os.unlink(kar)  # -O0 keeps every intermediate: not what is timed
    err = max(errs.values())
    x.numpy().tofile(xpath + ".bin")
    return kar, xpath, {"compile_s": compile_s, "arena": info["arena_bytes"],
                        "naive": info["naive_bytes"], "rel_err": err, "errs": errs,
                        "onnx": onnx_path,
                        "want": want, "dtype": str(x.dtype).replace("torch.", ""),
                        "shape": "x".join(str(d) for d in x.shape)}


def ort_available():
    return (shutil.which("node") is not None
            and os.path.isdir(os.path.join(ORT_DIR, "onnxruntime-node")))


def ort_start(rep, xpath, threads, iters):
    """The ONNX Runtime worker for one model (bench/ort_worker.js), ready,
    and its output's max error against torch eager."""
    env = thread_env(threads)
    env["NODE_PATH"] = ORT_DIR
    proc = subprocess.Popen(pin(threads) + ["node", os.path.join(HERE, "ort_worker.js"),
                                            rep["onnx"], str(threads), str(iters), "x",
                                            rep["dtype"], rep["shape"], xpath + ".bin"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        proc.kill()
        raise SystemExit(f"ONNX Runtime could not run {rep['onnx']}")
    got = np.fromfile(xpath + ".bin.ort.bin", dtype=np.float32).reshape(rep["want"].shape)
    err = float(np.abs(got - rep["want"]).max() / np.abs(rep["want"]).max())
    return proc, err


def kiln_start(kar, xpath, keyring, threads, iters):
    """kiln's worker for one model: `kiln-run --bench ITERS --bench-stdin`,
    loaded and warmed up, ready for rounds as ONNX Runtime's worker is."""
    env = thread_env(threads)
    env["KILN_RT_THREADS"] = str(threads)
    proc = subprocess.Popen(pin(threads) + [os.path.join(BIN, "kiln-run"), kar, "--keyring",
                                            keyring, "--input", f"x={xpath}", "--bench",
                                            str(iters), "--bench-stdin"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        proc.kill()
        raise SystemExit(f"kiln-run could not run {kar}")
    return proc


def _go(proc):
    """One measurement from a worker (torch, ORT or kiln): (the runs' wall
    ms, CPU ms a run)."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a benchmark worker ({proc.args[0]}) ended early")
    r = json.loads(line)
    return r["times"], r["cpu_ms"]


def _gm(vals):
    return math.exp(statistics.mean(math.log(v) for v in vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS + EXTRA)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--iters", type=int, default=5, help="runs per measurement")
    ap.add_argument("--rounds", type=int, default=15,
                    help="rounds of the engines taking turns, per model and thread count")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="over the rounds, each engine's median or its lowest (a host "
                         "whose speed moves from second to second only ever adds time)")
    ap.add_argument("--no-torch", action="store_true",
                    help="time kiln and ONNX Runtime only (torch is checked, not timed)")
    ap.add_argument("--torch-worker", nargs=3, metavar=("MODEL", "THREADS", "ITERS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker[0], int(args.torch_worker[1]),
                     int(args.torch_worker[2]))
        return
    if not 1 <= args.iters <= 10000 or not 1 <= args.rounds <= 100 \
            or not all(1 <= t <= 256 for t in args.threads):
        raise SystemExit("--iters 1..10000, --rounds 1..100, --threads 1..256")

    work = tempfile.mkdtemp(prefix="kiln-bench-")
    # its exports and artifacts take 2-3 GB (vit_b_16's and bert_base's at
    # -O0 and -O3): gone when the script ends, however it ends
    atexit.register(shutil.rmtree, work, True)
    key = os.path.join(work, "key.pem")
    keyring = os.path.join(work, "keyring")
    os.mkdir(keyring)
    run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", key])
    run(["openssl", "pkey", "-in", key, "-pubout", "-out", os.path.join(keyring, "k.pub")])
    use_ort = ort_available()
    load = os.getloadavg()[0]
    print(f"kiln vs torch {__import__('torch').__version__}"
          f"{' and ONNX Runtime (onnxruntime-node)' if use_ort else ''}, batch 1, CPUs: "
          f"{os.cpu_count()}, load average {load:.1f}; median of {args.iters} runs "
          f"(CPU time: mean), {args.rounds} rounds of the engines taking turns; "
          f"ratio < 1 means kiln is faster", flush=True)
    if not use_ort:
        print(f"  ONNX Runtime not found in {ORT_DIR} (make bench-deps installs it): "
              f"its column is left out", flush=True)

    rows, prep, wrong = [], {}, []
    for name in args.models:
        kar, xpath, rep = prepare(name, work, key, keyring)
        prep[name] = rep
        bad = [lv for lv, e in rep["errs"].items() if not e <= TOLERANCE]
        if bad:
            wrong.append(name)
        print(f"  {name}: compiled in {rep['compile_s']:.2f} s; arena "
              f"{rep['arena'] / 2**20:.1f} MiB against {rep['naive'] / 2**20:.1f} MiB "
              f"naive; max error vs torch eager {rep['errs'][0]:.1e} at -O0, "
              f"{rep['errs'][3]:.1e} at -O3 of the output's largest magnitude"
              f"{' -- OVER ' + str(TOLERANCE) if bad else ''}", flush=True)
        for threads in args.threads:
            worker = None if args.no_torch else subprocess.Popen(
                pin(threads) + [sys.executable, os.path.abspath(__file__), "--torch-worker",
                                name, str(threads), str(args.iters)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=thread_env(threads))
            ort = kiln = None
            try:
                assert worker is None or json.loads(worker.stdout.readline()).get("ready")
                if use_ort:
                    ort, ort_err = ort_start(rep, xpath, threads, args.iters)
                    if threads == args.threads[0]:
                        print(f"  {name}: ONNX Runtime's max error vs torch eager "
                              f"{ort_err:.1e}", flush=True)
                kiln = kiln_start(kar, xpath, keyring, threads, args.iters)
                m = {k: [] for k in ("t", "tc", "o", "oc", "k", "kc")}
                ktimes = []
                engines = [(p, a, b) for p, a, b in ((worker, "t", "tc"), (ort, "o", "oc"),
                                                      (kiln, "k", "kc")) if p is not None]
                for r in range(args.rounds):
                    # the engines' order reversed every other round: whichever
                    # goes first in a round is not always the same one
                    for proc, wall, cpu in (engines if r % 2 == 0 else engines[::-1]):
                        time.sleep(PAUSE_S)
                        times, cpu_ms = _go(proc)
                        m[wall].append(statistics.median(times))
                        m[cpu].append(cpu_ms)
                        if proc is kiln:
                            ktimes += times[1:]     # (a turn's first run: after the pause)
                rss = vmhwm_kib(kiln.pid)
            finally:
                for proc in (worker, ort, kiln):
                    if proc is not None:
                        proc.stdin.close()
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
            pick = min if args.stat == "min" else statistics.median
            med = {k: pick(v) if v else None for k, v in m.items()}
            med["rss"] = rss
            ktimes.sort()
            med["kp99"] = ktimes[max(0, -(-len(ktimes) * 99 // 100) - 1)] if ktimes else med["k"]
            rows.append((name, threads, med))
            o, oc, kc, t, tc = med["o"], med["oc"], med["kc"], med["t"], med["tc"]
            print(f"  {name} x{threads}: wall{f' torch {t:.2f},' if t else ''}"
                  f"{f' ORT {o:.2f},' if o else ''} kiln {med['k']:.2f} ms; CPU"
                  f"{f' torch {tc:.2f},' if t else ''}{f' ORT {oc:.2f},' if o else ''} "
                  f"kiln {kc:.2f} ms;{f' kiln/torch {kc / tc:.2f}' if t else ''}"
                  f"{f' kiln/ORT {kc / oc:.2f}' if o else ''} (CPU)", flush=True)

    print()
    print(f"(each engine's {args.stat} over {args.rounds} rounds)")
    print("| model | threads | torch ms | ORT ms | kiln ms | torch CPU ms | ORT CPU ms "
          "| kiln CPU ms | kiln / torch (CPU) | kiln / ORT (CPU) | kiln / ORT (wall) "
          "| kiln p99 ms | kiln peak RSS MiB | arena / naive MiB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, threads, m in rows:
        rep = prep[name]
        o, oc, kc = m["o"], m["oc"], m["kc"]
        f = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        ratio = f"**{kc / oc:.2f}**" if o else "-"
        t, tc = m["t"], m["tc"]
        print(f"| {name} | {threads} | {f(t)} | {f(o)} | {m['k']:.2f} | {f(tc)} "
              f"| {f(oc)} | {kc:.2f} | {f(kc / tc if t else None)} | {ratio} "
              f"| {f(m['k'] / o if o else None)} | {m['kp99']:.2f} | {m['rss'] / 1024:.0f} "
              f"| {rep['arena'] / 2**20:.1f} / {rep['naive'] / 2**20:.1f} "
              f"| {rep['compile_s']:.2f} |")
    for threads in args.threads:
        sel = [m for _, t, m in rows if t == threads]
        line = f"geometric mean at {threads} thread{'s' if threads > 1 else ''}:"
        if all(m["t"] for m in sel):
            line += (f" kiln / torch {_gm(m['kc'] / m['tc'] for m in sel):.2f} CPU, "
                     f"{_gm(m['k'] / m['t'] for m in sel):.2f} wall;")
        if all(m["o"] for m in sel):
            line += (f" kiln / ORT {_gm(m['kc'] / m['oc'] for m in sel):.2f} CPU, "
                     f"{_gm(m['k'] / m['o'] for m in sel):.2f} wall")
        print(line)
    if wrong:
        print(f"kiln's output is more than {TOLERANCE} of its magnitude away from torch's: "
              f"{', '.join(wrong)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
