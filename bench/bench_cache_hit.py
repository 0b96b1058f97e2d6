#!/usr/bin/env python3
"""A farm cache hit against `sha256sum` of the weights, side by side.

Usage: bench_cache_hit.py [--mib N] [--rounds R] [--before BINDIR]

Compiles an MLP of N MiB of fp32 weights through a broker and one worker
(per binary set), then takes turns: `kiln compile` of the same model (an
action-cache hit whose weights the client's member cache holds), `kiln
get` of the artifact, and `sha256sum` of the weights file alone.  With
--before, a second farm runs the binaries in BINDIR and takes its turns
in the same rounds, so both sets see the same machine load.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import conftest  # noqa: E402
from farm_helpers import running_farm, big_model  # noqa: E402


def timed(argv, env=None):
    t = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    dt = time.monotonic() - t
    if p.returncode != 0:
        sys.exit(f"{argv[:2]} failed: {p.stderr[-2000:]}")
    return dt, p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="directory of the binaries to compare against")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="kiln-cache-hit-")
    os.environ["KILN_CACHE_DIR"] = os.path.join(d, "cache")
    sets = [("after", conftest.BIN)] + ([("before", os.path.abspath(a.before))]
                                         if a.before else [])
    try:
        model = big_model(os.path.join(d, "m.onnx"), a.mib, seed=5)
        weights = [model]                  # self-contained: the weights and a few bytes
        farms, stack = {}, []
        for name, bindir in sets:
            conftest.BIN = bindir
            cm = running_farm(os.path.join(d, "farm-" + name))
            f = cm.__enter__()
            stack.append(cm)
            f.start_worker("w1")
            f.wait_for_workers(1)
            t = time.monotonic()
            p = f.compile(model, os.path.join(d, name + ".kar"), "--json", timeout=1800)
            assert p.returncode == 0, p.stderr
            art = json.loads(p.stdout)["artifact"]
            print(f"{name}: cold compile {time.monotonic() - t:.1f} s", flush=True)
            farms[name] = (bindir, f, art)
        rows = {k: [] for k in ["sha256sum"] + [f"{n} {w}" for n, _ in sets
                                                for w in ("compile", "get")]}
        for r in range(a.rounds):
            rows["sha256sum"].append(timed(["sha256sum"] + weights)[0])
            for name, (bindir, f, art) in farms.items():
                kiln = os.path.join(bindir, "kiln")
                out = os.path.join(d, "hit.kar")
                dt, so = timed([kiln, "compile", model, "-o", out, "--broker", f.endpoint,
                                "--json"])
                j = json.loads(so)
                assert j["cached"] and j["download"]["reused_bytes"] > 0, j
                rows[f"{name} compile"].append(dt)
                os.unlink(out)
                dt, so = timed([kiln, "get", art, "-o", out, "--broker", f.endpoint, "--json"])
                assert json.loads(so)["reused_bytes"] > 0, so
                rows[f"{name} get"].append(dt)
                os.unlink(out)
        sha = sorted(rows["sha256sum"])[len(rows["sha256sum"]) // 2]
        print(f"weights {a.mib} MiB, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
        for k, v in rows.items():
            med = sorted(v)[len(v) // 2]
            print(f"{k:16s} median {med:6.2f} s = {med / sha:4.2f} x sha256sum   "
                  + " ".join(f"{x:.2f}" for x in v))
        for cm in reversed(stack):
            cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
