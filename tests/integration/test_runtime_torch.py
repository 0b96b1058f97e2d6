"""The builtin compiler and the runtime against PyTorch, end to end with
the real programs: torch model -> ONNX -> `kiln import` -> `kiln-cc`
(signed with a key made by stock openssl) -> `kiln-run` on .npy inputs,
compared with eager torch.  Also the command-line contracts of kiln-cc and
kiln-run: --json, determinism, refusals with a message naming the culprit;
and replicas of a model sharing one mapping of its weights (peak RSS).
"""

import json
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from conftest import kiln_bin, run


def _kiln_import_available():
    if not os.access(kiln_bin("kiln"), os.X_OK):
        return False
    proc = subprocess.run([kiln_bin("kiln"), "import", "--help"],
                          capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and "import" in proc.stdout


pytestmark = pytest.mark.skipif(
    not _kiln_import_available(),
    reason="`kiln import` (client/cmd_import.c + graph/kiln_onnx.c) is not built")


# --- models that exercise every op the builtin compiler supports ----------

class Conv1dNet(nn.Module):
    """1-D convolutions: strides, dilations, pads, groups, a 1x1."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2)
        self.c2 = nn.Conv1d(6, 6, 1)
        self.fc = nn.Linear(6 * 10, 5)

    def forward(self, x):
        y = self.c2(F.relu(self.c1(x)))
        return self.fc(torch.flatten(y, 1))


class PoolNet(nn.Module):
    """Grouped dilated strided conv, max pooling with pads and ceil_mode,
    broadcast arithmetic with constants, global average pool, reshape."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=(2, 1), padding=2, dilation=2, groups=3)
        self.scale = nn.Parameter(torch.rand(6, 1, 1) + 0.5)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        y = F.max_pool2d(self.conv(x), 3, stride=2, padding=1, ceil_mode=True)
        y = (y * self.scale + 1.0) / 3.0 - y
        y = F.adaptive_avg_pool2d(F.relu(y), 1)
        return self.fc(y.reshape(y.shape[0], -1))


class MatMulNet(nn.Module):
    """Batched and broadcast matrix products, Linear on 3-D input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8, 5) - 0.5)
        self.v = nn.Parameter(torch.rand(2, 5, 3) - 0.5)
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        y = torch.matmul(torch.matmul(x, self.w), self.v)
        return self.lin(y).reshape(2, -1)


def _cases():
    torch.manual_seed(1)
    return [
        ("small_cnn", models.SmallCNN(), (torch.rand(2, 3, 32, 32),)),
        ("mlp", models.MLP(), (torch.rand(4, 32),)),
        ("seed_conv", models.SeedConv(), (torch.rand(1, 1, 3, 3),)),
        ("foo", models.Foo(), (torch.rand(3), torch.rand(3))),
        ("conv1d", Conv1dNet(), (torch.rand(2, 4, 20),)),
        ("pool", PoolNet(), (torch.rand(2, 3, 17, 15),)),
        ("matmul", MatMulNet(), (torch.rand(2, 4, 8),)),
    ]


CASES = {name: (module, inputs) for name, module, inputs in _cases()}


# --- helpers ----------------------------------------------------------------

@pytest.fixture
def keys(tmp_path):
    """An Ed25519 key made by stock openssl, and a keyring holding it."""
    key = tmp_path / "signer.pem"
    ring = tmp_path / "keyring"
    ring.mkdir()
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout",
                    "-out", str(ring / "signer.pem")], check=True, capture_output=True)
    return key, ring


def _import(module, inputs, tmp_path, name):
    onnx_path = tmp_path / f"{name}.onnx"
    names, expected = models.export(module, inputs, onnx_path)
    kgraph = tmp_path / f"{name}.kgraph"
    proc = run(["kiln", "import", onnx_path, "-o", kgraph])
    assert proc.returncode == 0, proc.stderr
    return kgraph, names, expected, proc.stdout.strip()


def _compile(kgraph, out, key, *extra):
    proc = run(["kiln-cc", kgraph, "-o", out, "--key", key, "--json", *extra])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _run(kar, ring, input_args, outdir):
    return run(["kiln-run", kar, "--keyring", ring, *input_args, "--output-dir", outdir])


# --- tests ------------------------------------------------------------------

@pytest.mark.parametrize("optlevel", [0, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_model_matches_torch(tmp_path, keys, name, optlevel):
    key, ring = keys
    module, inputs = CASES[name]
    kgraph, names, expected, digest = _import(module, inputs, tmp_path, name)
    info = _compile(kgraph, tmp_path / "m.kar", key, "--compiler-args",
                    f"--optlevel {optlevel}")
    assert info["graph_digest"] == digest
    assert info["arena_bytes"] <= info["naive_bytes"]
    if optlevel == 0:
        assert info["arena_bytes"] == info["naive_bytes"]

    proc = _run(tmp_path / "m.kar", ring, models.save_inputs(inputs, names, tmp_path),
                tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    assert got.dtype == np.float32
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_compile_is_byte_for_byte_deterministic(tmp_path, keys):
    key, _ = keys
    module, inputs = CASES["small_cnn"]
    kgraph, _, _, _ = _import(module, inputs, tmp_path, "cnn")
    a = _compile(kgraph, tmp_path / "a.kar", key)
    b = _compile(kgraph, tmp_path / "b.kar", key)
    assert a == b
    assert (tmp_path / "a.kar").read_bytes() == (tmp_path / "b.kar").read_bytes()
    # The content hash is the same unsigned: it covers the manifest only.
    proc = run(["kiln-cc", kgraph, "-o", tmp_path / "u.kar", "--unsigned"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == a["artifact"]
    # The memory planner shares the arena between intermediate tensors.
    assert a["arena_bytes"] < a["naive_bytes"]


def test_kiln_cc_usage_and_errors(tmp_path, keys):
    key, _ = keys
    module, inputs = CASES["mlp"]
    kgraph, _, _, _ = _import(module, inputs, tmp_path, "mlp")
    h = run(["kiln-cc", "-h"])
    assert h.returncode == 0 and "usage: kiln-cc" in h.stdout
    cases = [
        (["kiln-cc", kgraph, "-o", tmp_path / "x.kar"], "--unsigned"),
        (["kiln-cc", kgraph, "-o", tmp_path / "x.kar", "--unsigned", "--key", key],
         "exactly one"),
        (["kiln-cc", kgraph, "-o", tmp_path / "x.kar", "--unsigned",
          "--compiler-args", "--turbo"], "'--turbo'"),
        (["kiln-cc", kgraph, "-o", tmp_path / "x.kar", "--unsigned",
          "--compiler-args", "--optlevel 5"], "'5'"),
        (["kiln-cc", tmp_path / "missing.kgraph", "-o", tmp_path / "x.kar", "--unsigned"],
         "missing.kgraph"),
        (["kiln-cc", kgraph, "-o", tmp_path / "x.kar", "--key", tmp_path / "nokey.pem"],
         "nokey.pem"),
    ]
    for argv, want in cases:
        proc = run(argv)
        assert proc.returncode == 1, argv
        assert proc.stderr.startswith("kiln-cc: ") or "kiln-cc: " in proc.stderr
        assert want in proc.stderr, (argv, proc.stderr)
    assert not (tmp_path / "x.kar").exists()


def test_kiln_run_refusals_name_the_culprit(tmp_path, keys):
    key, ring = keys
    module, inputs = CASES["foo"]
    kgraph, names, _, _ = _import(module, inputs, tmp_path, "foo")
    _compile(kgraph, tmp_path / "m.kar", key)
    good = models.save_inputs(inputs, names, tmp_path)
    np.save(tmp_path / "wrong.npy", np.zeros(4, dtype=np.float32))
    np.save(tmp_path / "f64.npy", np.zeros(3, dtype=np.float64))
    out = tmp_path / "out"
    cases = [
        (["--input", f"input0={tmp_path / 'wrong.npy'}", good[2], good[3]],
         ["input0", "[3]", "[4]"]),
        (["--input", f"input0={tmp_path / 'f64.npy'}", good[2], good[3]],
         ["input0", "float64"]),
        ([good[0], good[1]], ["input1", "missing"]),
        ([good[0], good[1], good[0], good[1]], ["input0", "twice"]),
        (["--input", f"nope={tmp_path / 'wrong.npy'}", good[2], good[3]], ["nope"]),
        (["--input", f"input0={tmp_path / 'absent.npy'}", good[2], good[3]],
         ["absent.npy"]),
    ]
    for args, wants in cases:
        proc = _run(tmp_path / "m.kar", ring, args, out)
        assert proc.returncode != 0, args
        for want in wants:
            assert want in proc.stderr, (args, proc.stderr)
        assert proc.stderr.startswith("kiln-run: ")
    # A keyring without the signer.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _run(tmp_path / "m.kar", empty, good, out)
    assert proc.returncode != 0
    assert not (out / "output.npy").exists()
    # An unsigned artifact is never run.
    run(["kiln-cc", kgraph, "-o", tmp_path / "u.kar", "--unsigned"], check=True)
    proc = _run(tmp_path / "u.kar", ring, good, out)
    assert proc.returncode != 0 and "sign" in proc.stderr


def test_kiln_run_single_input_without_name_and_unsafe_output_names(tmp_path, keys):
    import onnx
    from onnx import TensorProto, helper
    key, ring = keys
    # A graph whose output name is not a safe file name.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("../evil/out:0", TensorProto.FLOAT, [2, 3])
    node = helper.make_node("Relu", ["x"], ["../evil/out:0"], name="relu")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, tmp_path / "relu.onnx")
    run(["kiln", "import", tmp_path / "relu.onnx", "-o", tmp_path / "relu.kgraph"],
        check=True)
    _compile(tmp_path / "relu.kgraph", tmp_path / "r.kar", key)
    data = np.array([[-1, 2, -3], [4, -5, 6]], dtype=np.float32)
    np.save(tmp_path / "x.npy", data)
    out = tmp_path / "out"
    proc = _run(tmp_path / "r.kar", ring, ["--input", tmp_path / "x.npy"], out)
    assert proc.returncode == 0, proc.stderr
    written = os.listdir(out)
    assert written == ["_._evil_out_0.npy"]
    np.testing.assert_array_equal(np.load(out / written[0]), np.maximum(data, 0))
    assert not (tmp_path / "evil").exists()


class WideMLP(nn.Module):
    """64 MiB of float32 weights: enough that a second copy would show in
    the peak RSS above everything else kiln-run holds."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def test_replicas_share_the_weights_mapped_or_read_and_match_torch(tmp_path, keys):
    key, ring = keys
    torch.manual_seed(3)
    module = WideMLP().eval()
    kgraph, names, _, _ = _import(module, (torch.rand(1, 2048),), tmp_path, "wide")
    info = _compile(kgraph, tmp_path / "m.kar", key)
    x = torch.rand(4, 2048)
    np.save(tmp_path / "x4.npy", x.numpy())
    with torch.no_grad():
        want = module(x).numpy()
    weights = sum(p.numel() * 4 for p in module.parameters())

    def bench(replicas, outdir, mmap):
        proc = run(["kiln-run", tmp_path / "m.kar", "--keyring", ring, "--input",
                    f"{names[0]}={tmp_path / 'x4.npy'}", "--dynamic-batch",
                    "--replicas", str(replicas), "--bench", "2", "--json",
                    "--output-dir", outdir], timeout=300,
                   env={"KILN_RT_MMAP": mmap} if mmap else None)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[0])

    # Mapped (KILN_RT_MMAP=1), and as the default holds a file this
    # small: read into memory on huge pages, one copy all the same.
    for mmap in ("1", None):
        tag = mmap or "default"
        one = bench(1, tmp_path / f"one_{tag}", mmap)
        two = bench(2, tmp_path / f"two_{tag}", mmap)
        assert one["weights_mapped"] == two["weights_mapped"] == (mmap == "1"), info
        assert two["replicas_sharing_weights"] == 2
        # The second replica adds its arena and workspace, not the weights
        # again (before the weights were shared it added all of them: 2x
        # in all).
        extra = (two["peak_rss_kib"] - one["peak_rss_kib"]) * 1024
        assert extra < weights // 4, (tag, one, two, weights)
        assert two["peak_rss_kib"] * 1024 < 1.5 * weights + 256 * 2**20, (tag, two, weights)
        got_one = np.load(tmp_path / f"one_{tag}" / "output.npy")
        got_two = np.load(tmp_path / f"two_{tag}" / "output.npy")
        np.testing.assert_array_equal(got_one, got_two)
        np.testing.assert_allclose(got_two, want, rtol=1e-4, atol=1e-4)
