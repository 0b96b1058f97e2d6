"""kiln-serve with real processes on loopback (docs/serving.md): models
compiled with `kiln compile --local` and signed by a farm key, released
with `kiln release sign` and a separate release key, served over KServe
v2 HTTP and driven with Python's http.client only.  Outputs against
torch's; hot swaps and every kind of refused release while clients send
without pause; bad requests, overload, batching and /metrics."""

import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import SRC, kiln_bin, run
from serve_helpers import Server, infer_outputs, infer_request, metric

MODEL = "cnn"
SHAPE = (1, 3, 8, 8)


class Net(nn.Module):
    """A small CNN: [1, 3, 8, 8] -> [1, 10]; its weights come from the seed."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return self.body(x)


class Half(nn.Module):
    """float16 in and out: y = 2x + 1 on [2, 8]."""

    def forward(self, x):
        return x * 2 + 1


class Slow(nn.Module):
    """Several 64-channel 3x3 convolutions at 64x64: tens of milliseconds a
    run, for overload."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        layers = [nn.Conv2d(1, 64, 3, padding=1), nn.ReLU()]
        for _ in range(5):
            layers += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(64, 4))

    def forward(self, x):
        return self.body(x)


def _export(module, shape, path, dtype=torch.float32):
    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, (torch.zeros(shape, dtype=dtype),), str(path),
                          input_names=["x"], output_names=["y"], opset_version=13)


def _torch(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _close(got, want):
    """Within 1e-4 of the output's magnitude."""
    return got.shape == want.shape and \
        float(np.max(np.abs(got - want))) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))


class Farm:
    """Keys made with `kiln keygen` (a farm key, a release key, a key
    nobody trusts), public halves copied into keyrings, and artifacts
    compiled locally: four CNNs with different weights, one signed by the
    untrusted key, the slow model."""

    def __init__(self, root):
        self.root = root
        self.env = {"KILN_CONFIG_DIR": str(root / "config"), "KILN_BROKER": ""}
        for name in ("farm", "release", "other"):
            run(["kiln", "keygen", "--out", root / name], check=True)
        self.farm_ring = root / "farm-keyring"
        self.release_ring = root / "release-keyring"
        for ring, key in ((self.farm_ring, "farm"), (self.release_ring, "release")):
            ring.mkdir()
            shutil.copy(root / key / "kiln.pub", ring / f"{key}.pub")
        self.nets, self.kar, self.digest = {}, {}, {}
        for name, seed in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
            self.nets[name] = Net(seed).eval()
            self._compile(name, self.nets[name], SHAPE, "farm")
        self.nets["e"] = Net(4).eval()
        self._compile("e", self.nets["e"], SHAPE, "other")
        self.nets["slow"] = Slow().eval()
        self._compile("slow", self.nets["slow"], (1, 1, 64, 64), "farm")
        self.nets["half"] = Half().eval()
        self._compile("half", self.nets["half"], (2, 8), "farm", torch.float16)

    def _compile(self, name, module, shape, key, dtype=torch.float32):
        onnx_path = self.root / f"{name}.onnx"
        _export(module, shape, onnx_path, dtype)
        kar = self.root / f"{name}.kar"
        proc = run(["kiln", "compile", onnx_path, "-o", kar, "--local", "--key",
                    self.root / key / "kiln.key", "--json"], env=self.env, check=True,
                   timeout=300)
        self.kar[name] = kar
        self.digest[name] = json.loads(proc.stdout)["artifact"]

    def place(self, repo, name, model=MODEL, kar=None):
        """Copy artifact `name` into repo/<model>/<digest>.kar."""
        d = repo / model
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(kar or self.kar[name], d / f"{self.digest[name]}.kar")

    def release(self, repo, name, seq, model=MODEL, key="release", expires=None,
                record_model=None):
        """Sign a release of artifact `name` straight into
        repo/<model>/release.json (kiln writes it atomically)."""
        (repo / model).mkdir(parents=True, exist_ok=True)
        args = ["kiln", "release", "sign", self.kar[name], "--model", record_model or model,
                "--seq", seq, "--key", self.root / key / "kiln.key", "-o",
                repo / model / "release.json"]
        if expires:
            args += ["--expires", expires]
        run(args, env=self.env, check=True)

    def rebuilt(self, name, out_name, **manifest_changes):
        """Artifact `name` with fields of its manifest changed and signed
        again by the farm key (stock openssl), as a farm building for
        another host would: registered as `out_name`."""
        with tarfile.open(self.kar[name]) as tf:
            members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
        data = dict((ti.name, blob) for ti, blob in members)
        manifest = json.loads(data["manifest.json"])
        manifest.update(manifest_changes)
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        work = self.root / f"{out_name}.work"
        work.mkdir()
        (work / "manifest.json").write_bytes(text)
        subprocess.run(["openssl", "pkeyutl", "-sign", "-inkey", str(self.root / "farm" / "kiln.key"),
                        "-rawin", "-in", str(work / "manifest.json"), "-out",
                        str(work / "manifest.sig")], check=True, timeout=30, capture_output=True)
        data["manifest.json"] = text
        data["manifest.sig"] = (work / "manifest.sig").read_bytes()
        kar = self.root / f"{out_name}.kar"
        with tarfile.open(kar, "w", format=tarfile.PAX_FORMAT) as tf:
            for ti, _ in members:
                ti.size = len(data[ti.name])
                tf.addfile(ti, io.BytesIO(data[ti.name]))
        self.kar[out_name] = kar
        self.digest[out_name] = hashlib.sha256(text).hexdigest()
        return kar

    def tampered(self, name):
        """Artifact `name` with one byte of its weights changed."""
        with tarfile.open(self.kar[name]) as tf:
            member = tf.getmember("weights.bin")
            offset = member.offset_data + member.size // 2
        blob = bytearray(self.kar[name].read_bytes())
        blob[offset] ^= 0x01
        out = self.root / f"{name}-tampered.kar"
        out.write_bytes(bytes(blob))
        return out


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    return Farm(tmp_path_factory.mktemp("serve"))


def _server(farm, tmp_path, repo, *extra, name="serve"):
    return Server(kiln_bin("kiln-serve"), repo, farm.farm_ring, farm.release_ring,
                  tmp_path / "state", tmp_path / f"{name}.log", *extra)


def _infer(server, x, conn=None, model=MODEL, **kw):
    body, headers = infer_request({"x": x}, **kw)
    status, rheaders, data = server.request("POST", f"/v2/models/{model}/infer", body, headers,
                                            conn=conn)
    if status != 200:
        return status, json.loads(data), None
    doc, outs = infer_outputs(rheaders, data)
    return status, doc, outs["y"]


class Load:
    """Clients sending the same input without pause, each on its own
    keep-alive connection, recording (sent, received, status, output)."""

    def __init__(self, server, x, threads=4, limit_s=300.0):
        self.server, self.x = server, x
        self.results, self.errors = [], []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.deadline = time.monotonic() + limit_s
        self.threads = [threading.Thread(target=self._client, daemon=True)
                        for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _client(self):
        conn = self.server.connect()
        try:
            while not self.stop_event.is_set() and time.monotonic() < self.deadline:
                sent = time.monotonic()
                try:
                    status, doc, y = _infer(self.server, self.x, conn=conn)
                except Exception as e:  # a dropped connection is a failure
                    with self.lock:
                        self.errors.append(repr(e))
                    conn.close()
                    conn = self.server.connect()
                    continue
                with self.lock:
                    self.results.append((sent, time.monotonic(), status, y, doc))
        finally:
            conn.close()

    def count(self):
        with self.lock:
            return len(self.results)

    def wait_for(self, n, timeout=60.0):
        """Wait until n more responses have arrived."""
        target = self.count() + n
        deadline = time.monotonic() + timeout
        while self.count() < target:
            assert time.monotonic() < deadline, f"the load got {self.count()} of {target}"
            assert all(t.is_alive() for t in self.threads), "a client thread died"
            time.sleep(0.01)

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(60)

    def failures(self):
        return self.errors + [f"{r[2]}: {r[4]}" for r in self.results if r[2] != 200]


def _wait_for(pred, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _repo(farm, tmp_path, name="a", seq=1):
    repo = tmp_path / "repo"
    farm.place(repo, name)
    farm.release(repo, name, seq)
    return repo


# --- serving --------------------------------------------------------------

def test_serve_answers_like_torch_with_two_replicas(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    with _server(farm, tmp_path, repo, "--replicas", "2") as server:
        assert server.get_json("/v2/health/live") == (200, {"live": True})
        assert server.get_json("/v2/health/ready") == (200, {"ready": True})
        assert server.get_json(f"/v2/models/{MODEL}/ready") == (200, {"ready": True})
        status, meta = server.get_json("/v2")
        assert status == 200 and meta["name"] == "kiln-serve"
        assert "binary_tensor_data" in meta["extensions"]

        doc = server.metadata(MODEL)
        assert doc["name"] == MODEL and doc["versions"] == ["1"] and doc["platform"] == "kiln"
        assert doc["inputs"] == [{"name": "x", "datatype": "FP32", "shape": list(SHAPE)}]
        assert doc["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 10]}]
        kiln = doc["kiln"]
        assert kiln["digest"] == farm.digest["a"] and kiln["seq"] == 1
        assert kiln["state"] == "READY" and kiln["last_refusal"] is None
        assert kiln["replicas"] == 2
        if (os.cpu_count() or 1) >= 2:
            assert sorted(kiln["cores"]) == [0, 1], "the replicas are on different cores"

        rng = np.random.default_rng(0)
        conn = server.connect()
        for i, kw in enumerate([{}, {"nested": True}, {"binary": True},
                                {"binary": True, "binary_output": True},
                                {"request_id": "req-7"}]):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            status, doc, y = _infer(server, x, conn=conn, **kw)
            assert status == 200, doc
            want = _torch(farm.nets["a"], x)
            assert _close(y, want), (kw, float(np.max(np.abs(y - want))))
            assert doc["model_name"] == MODEL and doc["model_version"] == "1"
            if "request_id" in kw:
                assert doc["id"] == "req-7"
        conn.close()

        # The versioned URL answers for the version serving, 404 for others.
        x = rng.standard_normal(SHAPE).astype(np.float32)
        body, headers = infer_request({"x": x})
        assert server.request("POST", f"/v2/models/{MODEL}/versions/1/infer", body,
                              headers)[0] == 200
        status, _, data = server.request("POST", f"/v2/models/{MODEL}/versions/9/infer", body,
                                         headers)
        assert status == 404 and "serves version 1" in json.loads(data)["error"]

        # Requests from two clients at once keep both replicas' cores busy.
        def client():
            c = server.connect()
            for _ in range(40):
                assert _infer(server, x, conn=c)[0] == 200
            c.close()
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        m = server.metrics()
        busy = [v for n, ls, v in m["samples"] if n == "kiln_serve_core_busy_seconds_total"]
        if (os.cpu_count() or 1) >= 2:
            assert len(busy) >= 2 and busy[0] > 0 and busy[1] > 0, busy
        # Busy time is the union of the runs' intervals: never past wall time.
        started = metric(m, "kiln_serve_start_time_seconds")
        assert all(b <= time.time() - started + 0.1 for b in busy), (busy, started)
        assert metric(m, "kiln_serve_inference_requests_total", model=MODEL) >= 87
        assert server.stop() == 0, server.log()


def test_hot_swap_under_load_drops_no_request(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    want = {v: _torch(farm.nets[v], x) for v in "abc"}
    assert not _close(want["a"], want["b"]) and not _close(want["b"], want["c"])
    with _server(farm, tmp_path, repo, "--replicas", "2") as server:
        load = Load(server, x, threads=4)
        try:
            load.wait_for(20)
            # A higher seq with other weights, picked up by the repository API.
            farm.place(repo, "b")
            farm.release(repo, "b", 2)
            status, _, data = server.request("POST", f"/v2/repository/models/{MODEL}/load")
            assert status == 200, data
            swap1 = time.monotonic()
            load.wait_for(40)
            # And another, picked up by SIGHUP.
            farm.place(repo, "c")
            farm.release(repo, "c", 3)
            server.signal(signal.SIGHUP)
            _wait_for(lambda: server.metadata(MODEL)["kiln"]["seq"] == 3, "seq 3 to serve")
            swap2 = time.monotonic()
            load.wait_for(40)
        finally:
            load.stop()
        assert load.failures() == []
        for sent, received, status, y, doc in load.results:
            if received < swap1:
                assert _close(y, want["a"]) or _close(y, want["b"])
            elif sent > swap1 and received < swap2:
                assert _close(y, want["b"]) or _close(y, want["c"]), "after the first swap"
            elif sent > swap2:
                assert _close(y, want["c"]), "after the second swap every answer is seq 3's"
                assert doc["model_version"] == "3"
        # (of the 40 answers after it, at most one per client was sent before)
        assert sum(1 for r in load.results if r[0] > swap2) >= 36
        m = server.metrics()
        assert metric(m, "kiln_serve_model_loads_total", model=MODEL) == 3
        assert metric(m, "kiln_serve_model_loaded_info", model=MODEL, digest=farm.digest["c"],
                      seq=3) == 1
        assert metric(m, "kiln_serve_model_loaded_info", model=MODEL) == 1
        # The old versions were unloaded once their last requests were done.
        server.stop()
        assert server.log().count("serving release seq") == 3


def _refusal_cases(farm, repo):
    """(name, how to put the release in place, expected reason, text in the
    reason's message); the server serves seq 5 of artifact a meanwhile."""
    def good(name, seq, **kw):
        def setup():
            farm.place(repo, name)
            farm.release(repo, name, seq, **kw)
        return setup

    def expired():
        farm.place(repo, "b")
        farm.release(repo, "b", 6, expires="1s")
        time.sleep(1.2)

    def missing():
        farm.release(repo, "d", 6)
        path = repo / MODEL / f"{farm.digest['d']}.kar"
        if path.exists():
            path.unlink()

    def tampered():
        farm.place(repo, "c", kar=farm.tampered("c"))
        farm.release(repo, "c", 6)

    def other_target():
        farm.rebuilt("b", "b-riscv", target="cpu-riscv64")
        farm.place(repo, "b-riscv")
        farm.release(repo, "b-riscv", 6)

    def other_abi():
        farm.rebuilt("b", "b-abi2", runtime_abi=2)
        farm.place(repo, "b-abi2")
        farm.release(repo, "b-abi2", 6)

    def malformed():
        (repo / MODEL / "release.json").write_text('{"algorithm":"ed25519"}\n')

    return [
        ("lower seq", good("b", 4), "rollback", "refusing a rollback"),
        ("same seq, other artifact", good("b", 5), "rollback", "another artifact"),
        ("expired", expired, "expired", "expired at"),
        ("signed by an untrusted key", good("b", 6, key="other"), "signature",
         "not in release keyring"),
        # (the farm key did not sign artifact e, so `kiln release sign` lets it)
        ("signed by the farm key", good("e", 6, key="farm"), "signature",
         "not in release keyring"),
        ("missing artifact", missing, "missing_artifact", "is not there"),
        ("tampered artifact", tampered, "artifact", ""),
        ("artifact from an untrusted farm", good("e", 6), "artifact", ""),
        ("another target", other_target, "target", "cpu-riscv64"),
        ("another runtime ABI", other_abi, "abi", "runtime ABI 2"),
        ("record for another model", good("b", 6, record_model="other"), "model",
         "model 'other'"),
        ("malformed record", malformed, "malformed", ""),
    ]


def test_refused_releases_keep_the_old_version_serving(farm, tmp_path):
    repo = _repo(farm, tmp_path, "a", 5)
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    want_a = _torch(farm.nets["a"], x)
    with _server(farm, tmp_path, repo, "--replicas", "2") as server:
        load = Load(server, x, threads=4)
        try:
            load.wait_for(10)
            for i, (case, setup, reason, text) in enumerate(_refusal_cases(farm, repo)):
                before = metric(server.metrics(), "kiln_serve_release_refusals_total",
                                model=MODEL, reason=reason)
                setup()
                if i % 2 == 0:
                    status, _, data = server.request("POST",
                                                     f"/v2/repository/models/{MODEL}/load")
                    assert status == 400, (case, status, data)
                    assert f"refused ({reason})" in json.loads(data)["error"], (case, data)
                else:
                    server.signal(signal.SIGHUP)
                    _wait_for(lambda: metric(server.metrics(),
                                             "kiln_serve_release_refusals_total", model=MODEL,
                                             reason=reason) > before, f"{case} refused")
                kiln = server.metadata(MODEL)["kiln"]
                refusal = kiln["last_refusal"]
                assert refusal["reason"] == reason, (case, refusal)
                assert text in refusal["message"], (case, refusal)
                assert kiln["seq"] == 5 and kiln["digest"] == farm.digest["a"], case
                assert metric(server.metrics(), "kiln_serve_release_refusals_total",
                              model=MODEL, reason=reason) == before + 1, case
                assert server.get_json("/v2/health/ready")[0] == 200, case
                load.wait_for(5)
            # After all that, a good release still swaps in.
            farm.place(repo, "b")
            farm.release(repo, "b", 6)
            assert server.request("POST", f"/v2/repository/models/{MODEL}/load")[0] == 200
            swapped = time.monotonic()
            load.wait_for(10)
        finally:
            load.stop()
        assert load.failures() == []
        want_b = _torch(farm.nets["b"], x)
        for sent, received, status, y, doc in load.results:
            if received < swapped:
                assert _close(y, want_a) or _close(y, want_b)
            elif sent > swapped:
                assert _close(y, want_b)
        log = server.log()
        assert log.count("refused release") + log.count("refused its release") == 12
    # The state remembers seq 6 across restarts: seq 5 is a rollback now.
    farm.release(repo, "a", 5)
    with _server(farm, tmp_path, repo, name="restart") as server:
        assert server.get_json("/v2/health/ready") == (400, {"ready": False})
        assert server.get_json(f"/v2/models/{MODEL}/ready") == (400, {"ready": False})
        doc = server.metadata(MODEL)
        assert doc["kiln"]["state"] == "UNAVAILABLE"
        assert doc["kiln"]["last_refusal"]["reason"] == "rollback"
        status, body, _ = _infer(server, x)
        assert status == 503 and "no version loaded" in body["error"]


# --- requests the server refuses -------------------------------------------

def test_bad_requests_get_400_and_the_server_keeps_serving(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    x = np.zeros(SHAPE, np.float32)
    path = f"/v2/models/{MODEL}/infer"
    with _server(farm, tmp_path, repo, "--max-body", "64K") as server:
        def post(body, headers=None, p=path):
            status, _, data = server.request("POST", p, body, headers or {})
            return status, json.loads(data)["error"]

        good = {"name": "x", "shape": list(SHAPE), "datatype": "FP32",
                "data": [0.0] * int(np.prod(SHAPE))}
        cases = [
            (b"{not json", "malformed JSON"),
            (b"[1, 2]", "not a JSON object"),
            ({"inputs": {}}, "\"inputs\" must be an array"),
            ({"inputs": [dict(good, shape=[1, 3, 8, 9])]}, "shape [1, 3, 8, 9]"),
            ({"inputs": [dict(good, shape=[1, 3, 8])]}, "shape [1, 3, 8]"),
            ({"inputs": [dict(good, datatype="INT64")]}, "datatype INT64, the model takes FP32"),
            ({"inputs": [dict(good, datatype="FP99")]}, "datatype FP99"),
            ({"inputs": [dict(good, data=[0.0] * 10)]}, "holds 10 elements"),
            ({"inputs": [dict(good, data=[0.0] * 1000)]}, "more than the 192 elements"),
            ({"inputs": [dict(good, data=["a"] * 192)]}, "not a number"),
            ({"inputs": [dict(good, name="z")]}, "no input 'z'"),
            ({"inputs": []}, "input 'x' is missing"),
            ({"inputs": [good, good]}, "2 elements, the model takes 1"),
            ({"inputs": [good], "outputs": [{"name": "nope"}]}, "no output 'nope'"),
            ({"input": [good]}, "unknown field 'input'"),
            ({"inputs": [dict(good, parameters={"binary_data_size": 768})]}, "both"),
        ]
        for body, text in cases:
            status, error = post(body)
            assert status == 400 and text in error, (body if len(str(body)) < 200 else text,
                                                     status, error)
        # The binary extension's header must fit the body.
        status, error = post(json.dumps({"inputs": [good]}),
                             {"Inference-Header-Content-Length": "999999"})
        assert status == 400 and "Inference-Header-Content-Length" in error
        # Binary data that does not match the shape.
        body, headers = infer_request({"x": np.zeros((1, 3, 8, 7), np.float32)}, binary=True)
        status, error = post(body, headers)
        assert status == 400 and "shape" in error
        header = json.dumps({"inputs": [{"name": "x", "shape": list(SHAPE), "datatype": "FP32",
                                         "parameters": {"binary_data_size": 768}}]}).encode()
        status, error = post(header + b"\0" * 100, {"Inference-Header-Content-Length":
                                                    str(len(header))})
        assert status == 400 and "body ends" in error
        # Unknown model, unknown endpoint, wrong method, body over the limit.
        status, error = post(json.dumps({"inputs": [good]}), p="/v2/models/nope/infer")
        assert status == 404 and "unknown model 'nope'" in error
        status, _, data = server.request("GET", "/v2/models/nope")
        assert status == 404
        status, _, data = server.request("GET", "/v3/what")
        assert status == 404 and "error" in json.loads(data)
        status, headers, data = server.request("GET", path)
        assert status == 405 and headers["allow"] == "POST"
        status, error = post(b"[" + b"0.0," * 40000 + b"0]")
        assert status == 413 and "--max-body" in error
        # Clients that speak no HTTP at all, or hang up half-way.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"\x00\xffGARBAGE\r\n\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 5000\r\n\r\n{\"inputs\": [")

        # Still serving, and the failures were counted.
        x = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
        status, doc, y = _infer(server, x)
        assert status == 200 and _close(y, _torch(farm.nets["a"], x))
        m = server.metrics()
        assert metric(m, "kiln_serve_inference_failures_total", model=MODEL,
                      reason="bad_request") == len(cases) + 3
        assert metric(m, "kiln_serve_inference_failures_total", model=MODEL,
                      reason="too_large") == 1
        assert metric(m, "kiln_serve_http_requests_total", endpoint="infer", code=404) == 1
        assert server.stop() == 0


def test_overload_answers_503_and_recovers(farm, tmp_path):
    repo = tmp_path / "repo"
    farm.place(repo, "slow", model="slow")
    farm.release(repo, "slow", 1, model="slow")
    x = np.random.default_rng(4).standard_normal((1, 1, 64, 64)).astype(np.float32)
    want = _torch(farm.nets["slow"], x)
    with _server(farm, tmp_path, repo, "--max-queue", "1") as server:
        start = threading.Barrier(12)
        results, lock = [], threading.Lock()

        def client():
            conn = server.connect()
            start.wait(30)
            for _ in range(4):
                r = _infer(server, x, conn=conn, model="slow", binary=True)
                with lock:
                    results.append(r)
            conn.close()
        threads = [threading.Thread(target=client) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == 48
        overloaded = [doc for status, doc, _ in results if status == 503]
        assert overloaded, "12 clients against a queue of 1 must overflow it"
        assert all("overloaded" in doc["error"] for doc in overloaded)
        for status, doc, y in results:
            assert status in (200, 503), doc
            if status == 200:
                assert _close(y, want)
        status, doc, y = _infer(server, x, model="slow")
        assert status == 200 and _close(y, want)
        m = server.metrics()
        assert metric(m, "kiln_serve_inference_failures_total", model="slow",
                      reason="overloaded") == len(overloaded)
        assert metric(m, "kiln_serve_queue_depth", model="slow") == 0


def test_concurrent_requests_are_batched_and_split_back(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    rng = np.random.default_rng(5)
    with _server(farm, tmp_path, repo, "--max-batch", "8", "--batch-delay-us", "100000") as server:
        meta = server.metadata(MODEL)
        assert meta["inputs"][0]["shape"] == [-1, 3, 8, 8]
        assert meta["kiln"]["max_batch"] == 8 and meta["kiln"]["compiled_batch"] == 1
        xs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(8)]
        start = threading.Barrier(8)
        got = [None] * 8

        def client(i):
            conn = server.connect()
            start.wait(30)
            got[i] = _infer(server, xs[i], conn=conn)
            conn.close()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(8):
            status, doc, y = got[i]
            assert status == 200, doc
            assert _close(y, _torch(farm.nets["a"], xs[i])), f"request {i} got another's rows"
        m = server.metrics()
        runs = metric(m, "kiln_serve_batch_requests_count", model=MODEL)
        requests = metric(m, "kiln_serve_batch_requests_sum", model=MODEL)
        assert requests == 8 and runs < requests, "some requests shared a run"
        # One request may carry several rows, up to --max-batch.
        x3 = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
        status, doc, y = _infer(server, x3)
        assert status == 200 and y.shape == (3, 10)
        assert _close(y, _torch(farm.nets["a"], x3))
        status, doc, _ = _infer(server, rng.standard_normal((9, 3, 8, 8)).astype(np.float32))
        assert status == 400 and "N 1..8" in doc["error"]


def test_metrics_are_prometheus_text_with_every_family(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    with _server(farm, tmp_path, repo) as server:
        _infer(server, np.zeros(SHAPE, np.float32))
        m = server.metrics()
        for family, kind in [("kiln_serve_http_requests_total", "counter"),
                             ("kiln_serve_inference_requests_total", "counter"),
                             ("kiln_serve_inference_failures_total", "counter"),
                             ("kiln_serve_inference_latency_seconds", "histogram"),
                             ("kiln_serve_queue_depth", "gauge"),
                             ("kiln_serve_batch_requests", "histogram"),
                             ("kiln_serve_core_busy_seconds_total", "counter"),
                             ("kiln_serve_model_ready", "gauge"),
                             ("kiln_serve_model_loaded_info", "gauge"),
                             ("kiln_serve_model_loads_total", "counter"),
                             ("kiln_serve_release_refusals_total", "counter")]:
            assert m["types"].get(family) == kind, family
        assert metric(m, "kiln_serve_model_loaded_info", model=MODEL,
                      digest=farm.digest["a"], seq=1) == 1
        buckets = [v for n, ls, v in m["samples"]
                   if n == "kiln_serve_inference_latency_seconds_bucket"]
        assert buckets == sorted(buckets) and buckets[-1] == 1
        assert metric(m, "kiln_serve_inference_latency_seconds_count", model=MODEL) == 1
        # docs/serving.md names every refusal reason and failure kind.
        doc = open(os.path.join(SRC, "docs", "serving.md")).read()
        for n, labels, _ in m["samples"]:
            if n == "kiln_serve_release_refusals_total":
                assert f"`{labels['reason']}`" in doc, labels["reason"]
            if n == "kiln_serve_inference_failures_total":
                assert f"`{labels['reason']}`" in doc, labels["reason"]
        for family in m["types"]:
            assert family in doc, family


def test_sighup_adds_a_model_and_the_repository_api_lists_unloads_and_loads_it(farm, tmp_path):
    repo = _repo(farm, tmp_path)
    with _server(farm, tmp_path, repo) as server:
        assert server.get_json("/v2/models/slow")[0] == 404
        farm.place(repo, "slow", model="slow")
        farm.release(repo, "slow", 1, model="slow")
        server.signal(signal.SIGHUP)
        _wait_for(lambda: server.get_json("/v2/models/slow/ready")[0] == 200, "slow loaded")
        status, _, data = server.request("POST", "/v2/repository/index")
        assert status == 200
        assert json.loads(data) == [{"name": MODEL, "state": "READY", "version": "1"},
                                    {"name": "slow", "state": "READY", "version": "1"}]
        assert server.get_json("/v2/health/ready") == (200, {"ready": True})
        # A directory with no release.json is not a model; load says so.
        (repo / "empty").mkdir()
        status, _, data = server.request("POST", "/v2/repository/models/empty/load")
        assert status == 404 and "no model 'empty'" in json.loads(data)["error"]
        x = np.random.default_rng(6).standard_normal((1, 1, 64, 64)).astype(np.float32)
        status, doc, y = _infer(server, x, model="slow")
        assert status == 200 and _close(y, _torch(farm.nets["slow"], x))
        # Unloaded on request: unavailable (503, try again) until loaded again.
        status, _, data = server.request("POST", "/v2/repository/models/slow/unload")
        assert status == 200, data
        assert server.get_json("/v2/models/slow/ready")[0] == 400
        assert server.get_json("/v2/health/ready")[0] == 400
        status, headers, data = server.request("POST", "/v2/models/slow/infer",
                                               *infer_request({"x": x}))
        assert status == 503 and headers["retry-after"] == "1"
        assert server.request("POST", "/v2/repository/models/slow/load")[0] == 200
        status, doc, y = _infer(server, x, model="slow")
        assert status == 200 and _close(y, _torch(farm.nets["slow"], x))


def test_fp16_tensors_travel_as_json_numbers_and_as_binary(farm, tmp_path):
    repo = tmp_path / "repo"
    farm.place(repo, "half", model="half")
    farm.release(repo, "half", 1, model="half")
    x = (np.random.default_rng(7).standard_normal((2, 8)) * 100).astype(np.float16)
    want = _torch(farm.nets["half"], x)
    assert want.dtype == np.float16
    with _server(farm, tmp_path, repo) as server:
        doc = server.metadata("half")
        # Traced at batch 2: a request may carry 1 or 2 rows.
        assert doc["inputs"] == [{"name": "x", "datatype": "FP16", "shape": [-1, 8]}]
        assert doc["kiln"]["compiled_batch"] == 2
        for kw in ({}, {"binary": True, "binary_output": True}):
            status, doc, y = _infer(server, x, model="half", **kw)
            assert status == 200, doc
            assert y.dtype == np.float16 and np.array_equal(y, want), (kw, y, want)
            status, doc, y = _infer(server, x[1:], model="half", **kw)
            assert status == 200 and np.array_equal(y, want[1:]), (kw, doc)
