"""Real models through the whole engine: torchvision's resnet18,
mobilenet_v2 and squeezenet1_1 (random weights; nothing is downloaded) and
a 4-layer torch.nn.TransformerEncoder (d_model 256, batch_first), exported
with torch.onnx.export at opset 14, imported with `kiln import`, compiled
with `kiln-cc` at --optlevel 0 (op by op, the reference) and 3 (every
optimisation) and run with `kiln-run`.  Each output must match torch eager,
computed in the same test, within 1e-4 of the output's largest magnitude.

Also the command-line tools around the engine: `kiln-run --bench` (its
report and its JSON), KILN_RT_PROFILE, KILN_RT_THREADS, KILN_RT_ISA, and
`kiln-cc --json`'s memory plan.  Each model is exported once per module.
"""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from conftest import kiln_bin, run

torchvision = pytest.importorskip("torchvision")

TOLERANCE = 1e-4


def _transformer():
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=4), (1, 64, 256)


MODELS = {
    "resnet18": lambda: (torchvision.models.resnet18(), (1, 3, 224, 224)),
    "mobilenet_v2": lambda: (torchvision.models.mobilenet_v2(), (1, 3, 224, 224)),
    "squeezenet1_1": lambda: (torchvision.models.squeezenet1_1(), (1, 3, 224, 224)),
    "transformer": _transformer,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A key made by stock openssl, its keyring, and a place for models."""
    d = tmp_path_factory.mktemp("models")
    key = d / "key.pem"
    ring = d / "keyring"
    ring.mkdir()
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout",
                    "-out", str(ring / "test.pub")], check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def exported(workdir):
    """name -> (kgraph path, input .npy path, torch eager output), made on
    first use and kept for the module."""
    cache = {}

    def get(name):
        if name in cache:
            return cache[name]
        torch.manual_seed(0)
        model, shape = MODELS[name]()
        model.eval()
        x = torch.rand(*shape)
        with torch.no_grad():
            want = model(x).numpy()
        onnx_path = workdir / f"{name}.onnx"
        # With autograd on, the transformer layers run their plain Python
        # path, which exports; under no_grad torch picks its fused
        # inference kernel, which ONNX has no operator for.  The weights
        # are the same either way.
        torch.onnx.export(model, (x,), str(onnx_path), input_names=["x"],
                          output_names=["y"], opset_version=14)
        kgraph = workdir / f"{name}.kgraph"
        proc = run(["kiln", "import", onnx_path, "-o", kgraph], timeout=300)
        assert proc.returncode == 0, proc.stderr
        xpath = workdir / f"{name}_x.npy"
        np.save(xpath, x.numpy())
        cache[name] = (kgraph, xpath, want)
        return cache[name]

    return get


def _compile(workdir, kgraph, optlevel):
    out = workdir / f"{kgraph.stem}.O{optlevel}.kar"
    if not out.exists():
        proc = run(["kiln-cc", kgraph, "-o", out, "--key", workdir / "key.pem",
                    "--json", "--compiler-args", f"--optlevel {optlevel}"], timeout=300)
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout)
        assert 0 < info["arena_bytes"] <= info["naive_bytes"]
    return out


def _run(workdir, kar, xpath, env=None, tag="out"):
    outdir = workdir / f"{kar.stem}.{tag}"
    proc = run(["kiln-run", kar, "--keyring", workdir / "keyring", "--input",
                f"x={xpath}", "--output-dir", outdir], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return np.load(outdir / "y.npy"), proc


def _assert_close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(np.abs(got.astype(np.float64) - want).max())
    scale = float(np.abs(want).max())
    assert scale > 0
    assert err <= TOLERANCE * scale, \
        f"{what}: max error {err:.3g} is more than {TOLERANCE:g} of {scale:.3g}"


@pytest.mark.parametrize("optlevel", [0, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_torch_eager(workdir, exported, name, optlevel):
    kgraph, xpath, want = exported(name)
    kar = _compile(workdir, kgraph, optlevel)
    got, _ = _run(workdir, kar, xpath)
    _assert_close(got, want, f"{name} at --optlevel {optlevel}")


def test_optimised_plan_is_smaller_than_the_naive_sum(workdir, exported):
    kgraph, _, _ = exported("resnet18")
    proc = run(["kiln-cc", kgraph, "-o", workdir / "plan.kar", "--unsigned", "--json",
                "--compiler-args", "--optlevel 3"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    # ResNet keeps a few activations alive at once: the plan is well under
    # one buffer per tensor of the same program ...
    assert info["arena_bytes"] * 2 < info["naive_bytes"]
    o0 = run(["kiln-cc", kgraph, "-o", workdir / "plan0.kar", "--unsigned", "--json",
              "--compiler-args", "--optlevel 0"], timeout=300)
    info0 = json.loads(o0.stdout)
    assert info0["arena_bytes"] == info0["naive_bytes"]     # -O0 shares nothing
    # ... and a small fraction of every intermediate of the graph, which
    # is what -O0 allocates
    assert info["arena_bytes"] * 10 < info0["naive_bytes"]


def test_bench_reports_latency_and_rss(workdir, exported):
    kgraph, xpath, want = exported("squeezenet1_1")
    kar = _compile(workdir, kgraph, 3)
    ring = workdir / "keyring"
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                "--bench", "5"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "5 runs after 1 warm-up" in proc.stdout
    assert "latency per inference: min" in proc.stdout and "p99" in proc.stdout
    assert "peak RSS:" in proc.stdout
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                "--bench", "4", "--json"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["runs"] == 4
    assert 0 < r["min_ms"] <= r["median_ms"] <= r["p99_ms"]
    assert r["peak_rss_kib"] > 0
    # --bench with --output-dir still writes the outputs, and they are right
    outdir = workdir / "bench_out"
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                "--bench", "2", "--output-dir", outdir], timeout=300)
    assert proc.returncode == 0, proc.stderr
    _assert_close(np.load(outdir / "y.npy"), want, "squeezenet1_1 after --bench")
    bad = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
               "--bench", "0"])
    assert bad.returncode != 0 and "--bench" in bad.stderr
    # the profile leaves out the first (cold) run once there is a second:
    # 1 warm-up and 4 timed runs are 4 runs profiled
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                "--bench", "4"], env={"KILN_RT_PROFILE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "kiln profile: 4 runs" in proc.stderr


def test_bench_stdin_times_a_round_per_line(workdir, exported):
    """--bench-stdin: ready once warmed up, then one JSON line of N times
    per line read, until stdin ends (bench_runtime.py's kiln worker)."""
    kgraph, xpath, _ = exported("squeezenet1_1")
    kar = _compile(workdir, kgraph, 3)
    ring = workdir / "keyring"
    proc = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                "--bench", "3", "--bench-stdin"], input="go\n" + "x" * 1000 + "\n",
               timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(v) for v in proc.stdout.splitlines()]
    assert lines[0] == {"ready": True} and len(lines) == 3
    for r in lines[1:]:
        assert len(r["times"]) == 3 and all(t > 0 for t in r["times"])
        assert r["cpu_ms"] > 0
    for extra in ([], ["--json"]):
        bad = run(["kiln-run", kar, "--keyring", ring, "--input", f"x={xpath}",
                   "--bench-stdin"] + (["--bench", "2"] if extra else []) + extra,
                  input="go\n")
        assert bad.returncode != 0
        assert "--bench-stdin goes with --bench" in bad.stderr or "required" in bad.stderr


def test_profile_threads_and_isa_settings_keep_results(workdir, exported):
    kgraph, xpath, want = exported("resnet18")
    kar = _compile(workdir, kgraph, 3)
    got, proc = _run(workdir, kar, xpath, env={"KILN_RT_PROFILE": "1"}, tag="prof")
    _assert_close(got, want, "resnet18 with KILN_RT_PROFILE")
    assert "kiln profile: 1 runs" in proc.stderr
    assert "conv2d" in proc.stderr and "GFLOP/s" in proc.stderr
    got2, _ = _run(workdir, kar, xpath, env={"KILN_RT_THREADS": "2"}, tag="t2")
    _assert_close(got2, want, "resnet18 with 2 intra-op threads")
    # The k sums run in the same order whatever the thread count.
    assert np.array_equal(got, got2)
    got3, _ = _run(workdir, kar, xpath, env={"KILN_RT_ISA": "avx2"}, tag="avx2")
    _assert_close(got3, want, "resnet18 on the AVX2 micro-kernel")
    bad = run(["kiln-run", kar, "--keyring", workdir / "keyring", "--input",
               f"x={xpath}", "--output-dir", workdir / "bad"],
              env={"KILN_RT_THREADS": "lots"})
    assert bad.returncode == 0          # a bad value warns and runs on one thread
    assert "KILN_RT_THREADS" in bad.stderr


def test_transformer_threads_give_the_same_bytes(workdir, exported):
    """Attention's per-head products (OpenBLAS, a run of heads a task), its
    softmax rows and the layer norms' rows go to the pool in pieces, each
    computed as it would be alone: 1, 2 and 3 threads give torch's values
    and the same bytes."""
    kgraph, xpath, want = exported("transformer")
    kar = _compile(workdir, kgraph, 3)
    outs = []
    for threads in ("1", "2", "3"):
        got, _ = _run(workdir, kar, xpath, env={"KILN_RT_THREADS": threads},
                      tag=f"threads{threads}")
        _assert_close(got, want, f"transformer with {threads} threads")
        outs.append(got)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
