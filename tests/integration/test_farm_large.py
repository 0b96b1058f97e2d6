"""Issue 11: a model whose weights are larger than the broker's and the
worker's memory budget compiles through the farm, and its artifact makes
the round trip worker -> broker -> client in chunks.

The model keeps 192 MiB of float32 weights in ONNX external data (three
4096 x 4096 MatMuls, as torch writes large models).  The broker and the
worker run under RLIMIT_DATA of 160 MiB (prlimit): heap, anonymous maps and
thread stacks, everything but file mappings, so neither may hold the
weights, nor the artifact, in its own memory; the worker's compile child
inherits the limit.  Their peak resident sets are read from /proc at the
end.  The artifact's numbers are checked against numpy, and the cache hit
and `kiln get` give the same bytes.

The client's import cache (common/kiln_statcache.h): the cache hit hashes
none of the weight files again, and a weight file changed in place (same
size) is hashed again and gives the new graph digest.
"""

import hashlib
import json
import os
import subprocess
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import kiln_bin
from farm_helpers import Farm

DIM = 4096
LAYERS = 3
BUDGET = 160 << 20                 # RLIMIT_DATA of the broker and the worker
WEIGHT_BYTES = LAYERS * DIM * DIM * 4


def external_mlp(directory):
    """y = x @ W0 @ W1 @ W2 with each W in its own external file; returns
    (model path, the weights)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(7)
    ws, inits, nodes = [], [], []
    prev = "x"
    for i in range(LAYERS):
        w = (rng.standard_normal((DIM, DIM), dtype=np.float32) / np.float32(64.0))
        w.tofile(os.path.join(directory, f"w{i}.bin"))
        ws.append(w)
        t = TensorProto()
        t.name, t.data_type = f"W{i}", TensorProto.FLOAT
        t.dims.extend([DIM, DIM])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", f"w{i}.bin"), ("offset", "0"), ("length", str(w.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
        out = "y" if i == LAYERS - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes, "large", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = os.path.join(directory, "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path, ws


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture
def farm(tmp_path):
    f = Farm(tmp_path / "farm")
    f.wrap = ["prlimit", f"--data={BUDGET}"]
    f.start_broker()
    f.start_worker("w1")
    try:
        f.wait_for_workers(1)
        yield f
    finally:
        f.stop()


def inspect_digest(model, **env):
    proc = subprocess.run([kiln_bin("kiln"), "inspect", str(model)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[proc.stdout.split().index("graph") + 1]


def test_weights_larger_than_the_farms_memory_budget_compile_and_come_back_in_chunks(
        farm, tmp_path, monkeypatch):
    assert WEIGHT_BYTES > BUDGET
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    model, ws = external_mlp(str(tmp_path / "model"))
    # files written less than 2 s before they are hashed are not
    # remembered (they could change again within their timestamps' tick)
    time.sleep(2.2)
    out = tmp_path / "a.kar"
    proc = farm.compile(model, out, timeout=600)
    assert proc.returncode == 0, proc.stderr + farm.logs()
    first = json.loads(proc.stdout)
    assert first["cached"] is False
    assert first["import_cache"] == {"hits": 0, "misses": LAYERS}
    assert out.stat().st_size > WEIGHT_BYTES
    # the artifact went worker -> broker apart, in slices, then to us by GET
    farm.wait_for_log("collecting its artifact")
    assert "to be collected" in farm.log("w1")

    # what came back computes what numpy computes
    x = np.random.default_rng(1).standard_normal((1, DIM)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    run = subprocess.run([kiln_bin("kiln-run"), str(out), "--keyring", farm.keyring, "--input",
                          str(tmp_path / "x.npy"), "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    want = x.astype(np.float64)
    for w in ws:
        want = want @ w.astype(np.float64)
    got = np.load(tmp_path / "o" / "y.npy")
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())

    # a cache hit and `kiln get` give the same bytes, in chunks
    again = farm.compile(model, tmp_path / "b.kar", timeout=300)
    assert again.returncode == 0, again.stderr + farm.logs()
    second = json.loads(again.stdout)
    assert second["cached"] is True
    assert second["import_cache"] == {"hits": LAYERS, "misses": 0}   # nothing hashed again
    assert second["graph_digest"] == first["graph_digest"]
    assert sha(tmp_path / "b.kar") == sha(out)
    get = subprocess.run([kiln_bin("kiln"), "get", first["artifact"], "-o",
                          str(tmp_path / "c.kar"), "--broker", farm.endpoint],
                         capture_output=True, text=True, timeout=300)
    assert get.returncode == 0, get.stderr
    assert sha(tmp_path / "c.kar") == sha(out)
    # `kiln verify` maps the weights too: it passes within the same budget
    verify = subprocess.run(["prlimit", f"--data={BUDGET}", kiln_bin("kiln"), "verify",
                             str(tmp_path / "c.kar"), "--keyring", farm.keyring],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr

    # neither the broker nor the worker ever held the weights
    broker_peak = peak_rss(farm.broker.pid)
    worker_peak = peak_rss(farm.workers["w1"].pid)
    assert broker_peak < WEIGHT_BYTES / 2, (broker_peak, farm.logs())
    assert worker_peak < WEIGHT_BYTES / 2, (worker_peak, farm.logs())

    # a weight changed in place, same size: hashed again, a new digest
    with open(tmp_path / "model" / "w1.bin", "r+b") as f:
        f.seek(12345 * 4)
        f.write(np.float32(3.5).tobytes())
    changed = inspect_digest(model)
    assert changed != first["graph_digest"]
    assert changed == inspect_digest(model, KILN_IMPORT_CACHE="off")
    # only touched: hashed again (the digest stays)
    os.utime(tmp_path / "model" / "w0.bin")
    assert inspect_digest(model) == changed
