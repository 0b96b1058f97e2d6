"""The foundation end to end, with real processes on loopback: ONNX from
torch -> kiln graph -> broker -> worker -> signed artifact -> verified run,
compared with torch's own output."""

import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import models
from conftest import kiln_bin, run


def compile_json(farm, model_path, out, *extra):
    proc = run(["kiln", "compile", model_path, "-o", out, "--broker", farm.endpoint,
                "--json", *extra], timeout=180)
    assert proc.returncode == 0, f"compile failed: {proc.stderr}\n{farm.logs()}"
    return json.loads(proc.stdout)


def run_artifact(kar, keyring, input_args, outdir):
    os.makedirs(outdir, exist_ok=True)
    proc = run(["kiln-run", kar, "--keyring", keyring, *input_args,
                "--output-dir", outdir], timeout=60)
    return proc


@pytest.mark.parametrize("name", ["foo", "seed_conv"])
def test_seed_example_compiles_on_farm_and_matches_torch(farm, tmp_path, name):
    module, inputs = {n: (m, i) for n, m, i in models.seed_models()}[name]
    onnx_path = tmp_path / f"{name}.onnx"
    names, expected = models.export(module, inputs, onnx_path)

    first = compile_json(farm, onnx_path, tmp_path / "a.kar")
    assert first["cached"] is False
    assert first["worker"] in ("worker-1", "worker-2")
    assert len(first["artifact"]) == 64

    ok = run(["kiln", "verify", tmp_path / "a.kar", "--keyring", farm.keyring])
    assert ok.returncode == 0, ok.stderr

    proc = run_artifact(tmp_path / "a.kar", farm.keyring,
                        models.save_inputs(inputs, names, tmp_path), tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    assert got.shape == expected.shape
    err = float(np.max(np.abs(got - expected)))
    assert err <= 1e-5, f"max abs error {err}"

    # The same request again is answered from the action cache.
    second = compile_json(farm, onnx_path, tmp_path / "b.kar")
    assert second["cached"] is True
    assert second["worker"] is None
    assert second["artifact"] == first["artifact"]
    assert second["action_key"] == first["action_key"]


def test_changed_compiler_args_are_a_different_action(farm, tmp_path):
    module, inputs = models.SeedConv(), (torch.rand(1, 1, 3, 3),)
    onnx_path = tmp_path / "m.onnx"
    models.export(module, inputs, onnx_path)
    a = compile_json(farm, onnx_path, tmp_path / "a.kar", "--compiler-args", "--optlevel 1")
    b = compile_json(farm, onnx_path, tmp_path / "b.kar", "--compiler-args", "--optlevel 0")
    assert a["action_key"] != b["action_key"]
    assert b["cached"] is False


def test_local_compile_without_broker_signs_with_users_key(tmp_path, config_dir):
    module, inputs = models.SmallCNN(), (torch.rand(1, 3, 16, 16),)
    onnx_path = tmp_path / "cnn.onnx"
    names, expected = models.export(module, inputs, onnx_path)
    env = {"KILN_BROKER": ""}
    proc = run(["kiln", "compile", onnx_path, "-o", tmp_path / "cnn.kar", "--json"], env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["cached"] is False and res["worker"] is None
    pub = config_dir / "keys" / "kiln.pub"
    assert pub.exists() and (config_dir / "keys" / "kiln.key").stat().st_mode & 0o077 == 0
    keyring = tmp_path / "keyring"
    keyring.mkdir()
    shutil.copy(pub, keyring / "me.pub")
    out = run_artifact(tmp_path / "cnn.kar", keyring,
                       models.save_inputs(inputs, names, tmp_path), tmp_path / "out")
    assert out.returncode == 0, out.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    assert float(np.max(np.abs(got - expected))) <= 1e-5


def _local_artifact(tmp_path, config_dir):
    module, inputs = models.SeedConv(), (torch.rand(1, 1, 3, 3),)
    onnx_path = tmp_path / "m.onnx"
    names, _ = models.export(module, inputs, onnx_path)
    kar = tmp_path / "m.kar"
    run(["kiln", "compile", onnx_path, "-o", kar, "--local"], check=True)
    keyring = tmp_path / "keyring"
    keyring.mkdir()
    shutil.copy(config_dir / "keys" / "kiln.pub", keyring / "me.pub")
    return kar, keyring, models.save_inputs(inputs, names, tmp_path)


def _flip_byte_in_member(kar, member, out):
    """Copy the tar at `kar` to `out` with one byte of `member`'s data flipped."""
    with tarfile.open(kar) as tf:
        info = tf.getmember(member)
        offset = info.offset_data
    data = bytearray(open(kar, "rb").read())
    data[offset + min(3, info.size - 1)] ^= 0x01
    open(out, "wb").write(bytes(data))


def test_flipped_program_byte_is_refused_by_verify_and_run(tmp_path, config_dir):
    kar, keyring, input_args = _local_artifact(tmp_path, config_dir)
    bad = tmp_path / "bad.kar"
    _flip_byte_in_member(kar, "program.kbin", bad)
    v = run(["kiln", "verify", bad, "--keyring", keyring])
    assert v.returncode != 0
    assert "program.kbin" in v.stderr
    r = run_artifact(bad, keyring, input_args, tmp_path / "out")
    assert r.returncode != 0
    assert "program.kbin" in r.stderr
    assert not (tmp_path / "out" / "output.npy").exists()


def test_signature_by_key_not_in_keyring_is_refused(tmp_path, config_dir):
    kar, keyring, input_args = _local_artifact(tmp_path, config_dir)
    other = tmp_path / "other"
    run(["kiln", "keygen", "--out", other], check=True)
    foreign = tmp_path / "foreign-keyring"
    foreign.mkdir()
    shutil.copy(other / "kiln.pub", foreign / "other.pub")
    v = run(["kiln", "verify", kar, "--keyring", foreign])
    assert v.returncode != 0
    assert "keyring" in v.stderr
    r = run_artifact(kar, foreign, input_args, tmp_path / "out")
    assert r.returncode != 0
    # The right keyring accepts the very same file.
    assert run(["kiln", "verify", kar, "--keyring", keyring]).returncode == 0


def test_stock_tar_lists_and_stock_openssl_verifies(tmp_path, config_dir):
    kar, keyring, _ = _local_artifact(tmp_path, config_dir)
    listing = subprocess.run(["tar", "tf", str(kar)], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
    for member in ("manifest.json", "manifest.sig", "signature.json", "program.kbin",
                   "weights.bin"):
        assert member in listing
    x = tmp_path / "x"
    x.mkdir()
    subprocess.run(["tar", "xf", str(kar), "-C", str(x)], check=True, timeout=30)
    cmd = ["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", str(keyring / "me.pub"),
           "-rawin", "-in", str(x / "manifest.json"), "-sigfile", str(x / "manifest.sig")]
    assert subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    # The content hash is the SHA-256 of manifest.json.
    import hashlib
    digest = hashlib.sha256((x / "manifest.json").read_bytes()).hexdigest()
    manifest = json.loads((x / "manifest.json").read_text())
    assert manifest["graph_digest"] != digest
    inspect = run(["kiln", "compile", tmp_path / "m.onnx", "-o", tmp_path / "again.kar",
                   "--local", "--json"], check=True)
    assert json.loads(inspect.stdout)["artifact"] == digest
    # And stock openssl refuses a tampered manifest.
    m = (x / "manifest.json").read_bytes().replace(b"float32", b"float64", 1)
    (x / "manifest.json").write_bytes(m)
    assert subprocess.run(cmd, capture_output=True, timeout=30).returncode != 0


def _save_onnx(graph, path, opset=13):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.save(model, str(path))


def test_unknown_op_is_named_with_its_count(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    # Ops a deterministic compiler has no reason to take (random draws)
    # or that kiln does not have; Sinh and Cosh were here before kiln had them.
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Bernoulli", ["a"], ["b"]),
             helper.make_node("Bernoulli", ["b"], ["c"]),
             helper.make_node("Det", ["c"], ["y"])]
    _save_onnx(helper.make_graph(nodes, "g", [x], [y]), tmp_path / "u.onnx")
    proc = run(["kiln", "import", tmp_path / "u.onnx", "-o", tmp_path / "u.kgraph"])
    assert proc.returncode != 0
    assert "Bernoulli (2)" in proc.stderr and "Det (1)" in proc.stderr
    assert "Relu" not in proc.stderr
    assert not (tmp_path / "u.kgraph").exists()


def test_shape_mismatch_names_the_node(tmp_path):
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="the_add")]
    _save_onnx(helper.make_graph(nodes, "g", [a, b], [y]), tmp_path / "s.onnx")
    proc = run(["kiln", "compile", tmp_path / "s.onnx", "-o", tmp_path / "s.kar", "--local"])
    assert proc.returncode != 0
    assert "the_add" in proc.stderr and "Add" in proc.stderr
    assert not (tmp_path / "s.kar").exists()


def test_wrong_input_shape_is_refused_naming_the_input(tmp_path, config_dir):
    kar, keyring, _ = _local_artifact(tmp_path, config_dir)
    np.save(tmp_path / "wrong.npy", np.zeros((1, 1, 4, 4), dtype=np.float32))
    r = run_artifact(kar, keyring, ["--input", f"input0={tmp_path / 'wrong.npy'}"],
                     tmp_path / "out")
    assert r.returncode != 0
    assert "input0" in r.stderr and "[1, 1, 3, 3]" in r.stderr


def test_model_with_external_data_imports_compiles_and_matches_numpy(tmp_path, config_dir):
    """A model saved by onnx with its weights in a separate file, as torch
    and onnx save models past 2 GB, imports from its own directory, is the
    same graph as the model saved in one file, and runs to numpy's answer;
    without the weight file it is refused naming the tensor and the file."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                 torch.nn.Linear(64, 8))
    x = torch.rand(4, 32)
    inline = tmp_path / "inline.onnx"
    names, _ = models.export(module, (x,), inline)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    onnx.save_model(onnx.load(str(inline)), str(model_dir / "m.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.weights", size_threshold=0)
    saved = onnx.load(str(model_dir / "m.onnx"), load_external_data=False)
    external = [t.name for t in saved.graph.initializer
                if t.data_location == TensorProto.EXTERNAL]
    assert len(external) == 4, "every weight and bias should be in m.weights"
    assert (model_dir / "m.weights").stat().st_size >= (32 * 64 + 64 * 8) * 4

    # Imported by a relative path from another directory: locations are
    # relative to the model's directory, not to the working directory.
    a = run(["kiln", "import", "model/m.onnx", "-o", "ext.kgraph"], cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    b = run(["kiln", "import", inline, "-o", tmp_path / "inline.kgraph"])
    assert b.returncode == 0, b.stderr
    assert a.stdout.strip() == b.stdout.strip(), "the graph digest depends on where weights are"

    kar = tmp_path / "m.kar"
    run(["kiln", "compile", model_dir / "m.onnx", "-o", kar, "--local"], check=True)
    keyring = tmp_path / "keyring"
    keyring.mkdir()
    shutil.copy(config_dir / "keys" / "kiln.pub", keyring / "me.pub")
    proc = run_artifact(kar, keyring, models.save_inputs((x,), names, tmp_path),
                        tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    w1, b1 = module[0].weight.detach().numpy(), module[0].bias.detach().numpy()
    w2, b2 = module[2].weight.detach().numpy(), module[2].bias.detach().numpy()
    want = np.maximum(x.numpy() @ w1.T + b1, 0) @ w2.T + b2
    assert got.shape == want.shape
    assert float(np.max(np.abs(got - want))) <= 1e-4

    # The .onnx without its weight file.
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(model_dir / "m.onnx", lone / "m.onnx")
    r = run(["kiln", "import", lone / "m.onnx", "-o", tmp_path / "lone.kgraph"])
    assert r.returncode != 0
    assert f"weight '{external[0]}'" in r.stderr and "'m.weights' not found" in r.stderr
    assert not (tmp_path / "lone.kgraph").exists()


def test_large_external_weights_import_in_bounded_memory_at_any_offset(tmp_path, config_dir):
    """`kiln import -o` of a model whose 96 MiB weight lives in external
    data writes the .kgraph without holding the weight in memory (peak RSS
    under half of it), and a weight at an offset that is not a multiple of
    its element size (legal in ONNX) is read, not mapped misaligned: the
    compiled model matches numpy."""
    from onnx import external_data_helper, numpy_helper
    rng = np.random.default_rng(0)
    k, n, rows = 4096, 6144, 64
    w = rng.standard_normal((k, n), dtype=np.float32)
    b = rng.standard_normal((rows, n), dtype=np.float32)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "w.bin").write_bytes(w.tobytes())
    (model_dir / "b.bin").write_bytes(b"\x01\x02\x03" + b.tobytes())
    inits = []
    for name, arr, loc, off in (("w", w, "w.bin", 0), ("b", b, "b.bin", 3)):
        t = numpy_helper.from_array(arr, name)
        external_data_helper.set_external_data(t, loc, offset=off, length=arr.nbytes)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        inits.append(t)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
                    str(model_dir / "m.onnx"))

    # Peak RSS as a small Python (no torch) sees its child's: a child of
    # this test's process would count the test's own pages it forked with.
    probe = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    r = subprocess.run(["/usr/bin/python3", "-c", probe, kiln_bin("kiln"), "import",
                        str(model_dir / "m.onnx"), "-o", str(tmp_path / "m.kgraph")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1]) * 1024
    assert peak < w.nbytes // 2, f"kiln import -o peaked at {peak >> 20} MiB"
    assert (tmp_path / "m.kgraph").stat().st_size > w.nbytes + b.nbytes

    kar = tmp_path / "m.kar"
    run(["kiln", "compile", tmp_path / "m.kgraph", "-o", kar, "--local"], timeout=300,
        check=True)
    keyring = tmp_path / "keyring"
    keyring.mkdir()
    shutil.copy(config_dir / "keys" / "kiln.pub", keyring / "me.pub")
    x = rng.standard_normal((1, k), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    r = run_artifact(kar, keyring, ["--input", f"x={tmp_path / 'x.npy'}"], tmp_path / "out")
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "out" / "y.npy")
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    assert float(np.max(np.abs(got - want))) <= 1e-4 * float(np.max(np.abs(want)))
