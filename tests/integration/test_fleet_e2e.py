"""The inference host end to end, as an operator runs it: a torch model
compiled on a farm (a broker and two workers on loopback), fetched from the
farm's store with `kiln get`, released with `kiln release sign` under a
release key, served by `kiln-serve` with 2 replicas, and asked over HTTP
with Python's urllib (not kiln code): the answers equal torch's."""

import json
import os
import subprocess
import urllib.request

import numpy as np
import torch

from conftest import kiln_bin
from farm_helpers import Farm
from serve_helpers import Server


def _kiln(*args, timeout=120):
    proc = subprocess.run([kiln_bin("kiln"), *[str(a) for a in args]], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"kiln {' '.join(map(str, args))}: {proc.stderr}"
    return proc


def test_farm_build_get_release_serve_answers_like_torch(tmp_path):
    torch.manual_seed(11)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).eval()
    onnx_path = tmp_path / "net.onnx"
    torch.onnx.export(net, torch.rand(1, 3, 8, 8), str(onnx_path), input_names=["x"],
                      output_names=["y"], opset_version=17)

    farm = Farm(tmp_path / "farm")
    farm.start_broker()
    try:
        farm.start_worker("w1")
        farm.start_worker("w2")
        farm.wait_for_workers(2)
        built = farm.compile(str(onnx_path), str(tmp_path / "built.kar"))
        assert built.returncode == 0, f"{built.stderr}\n{farm.logs()}"
        digest = json.loads(built.stdout)["artifact"]

        # The inference host fetches it by content hash, not by file.
        repo = tmp_path / "repo" / "net"
        repo.mkdir(parents=True)
        _kiln("get", digest, "-o", repo / f"{digest}.kar", "--broker", farm.endpoint,
              "--keyring", farm.keyring)
    finally:
        farm.stop()

    # Who may deploy is not who may build: a release key of its own.
    _kiln("keygen", "--out", tmp_path / "release-key")
    release_keyring = tmp_path / "release-keyring"
    release_keyring.mkdir()
    (release_keyring / "release.pub").write_bytes(
        (tmp_path / "release-key" / "kiln.pub").read_bytes())
    _kiln("release", "sign", repo / f"{digest}.kar", "--model", "net", "--seq", "1",
          "--key", tmp_path / "release-key" / "kiln.key", "-o", repo / "release.json")

    state = tmp_path / "state"
    state.mkdir()
    with Server(kiln_bin("kiln-serve"), tmp_path / "repo", farm.keyring, release_keyring,
                state, tmp_path / "serve.log", "--replicas", "2") as server:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/v2/models/net", timeout=30) as r:
            meta = json.loads(r.read())
        assert meta["kiln"]["digest"] == digest and meta["kiln"]["seq"] == 1
        rng = np.random.default_rng(0)
        for _ in range(4):
            x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
            body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8],
                                           "datatype": "FP32",
                                           "data": x.ravel().tolist()}]}).encode()
            req = urllib.request.Request(f"{base}/v2/models/net/infer", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                doc = json.loads(r.read())
            out = doc["outputs"][0]
            y = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
            with torch.no_grad():
                want = net(torch.from_numpy(x)).numpy()
            assert np.max(np.abs(y - want)) <= 1e-4 * np.max(np.abs(want)), (y, want)
