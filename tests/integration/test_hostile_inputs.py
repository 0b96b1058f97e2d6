"""Hostile inputs to kiln's own programs (issue 14, findings 6, 8, 9 and
10), each as the attacker would hand it over: real programs, a real
broker and worker on loopback, every process stopped by the Farm's
stop(), every wait bounded.

- a FIFO given as a path (verify, kiln-run, import, kiln-cc, inspect);
- compiler arguments a worker does not allow, and a symbolic link left
  where the toolchain's output goes;
- terminal escapes in a node name and in a compile log;
- bytes appended to an artifact, a setuid member, a symlinked keyring
  entry and a .pub of two PEM blocks, through `kiln verify` and kiln-run.
"""

import io
import os
import shutil
import tarfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import SRC, kiln_bin, run
from farm_helpers import running_farm, tiny_model

MLP = os.path.join(SRC, "tests", "data", "onnx", "mlp.onnx")
ESC = "\x1b]0;pwned\x07\x1b[31m"

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-cc", "kiln-run", "kiln-worker")),
    reason="build/bin lacks kiln's programs: run `make` first")


@pytest.fixture
def built(tmp_path):
    """mlp.onnx compiled and signed locally: (artifact, keyring, key dir)."""
    keys = tmp_path / "keys"
    run(["kiln", "keygen", "--out", keys], check=True)
    kgraph, kar = tmp_path / "mlp.kgraph", tmp_path / "mlp.kar"
    run(["kiln", "import", MLP, "-o", kgraph], check=True)
    run(["kiln-cc", kgraph, "-o", kar, "--key", keys / "kiln.key"], check=True)
    ring = tmp_path / "ring"
    ring.mkdir()
    shutil.copy(keys / "kiln.pub", ring / "me.pub")
    return kar, ring, keys


@pytest.fixture
def farm(tmp_path):
    with running_farm(tmp_path / "farm") as f:
        yield f


def test_a_fifo_is_refused_at_once_by_every_program(tmp_path, built):
    kar, ring, _ = built
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 4), np.float32))
    commands = [
        ["kiln", "verify", fifo, "--keyring", ring],
        ["kiln-run", fifo, "--keyring", ring, "--input", f"x={x}", "--output-dir", tmp_path],
        ["kiln-run", kar, "--keyring", ring, "--input", f"x={fifo}", "--output-dir", tmp_path],
        ["kiln", "import", fifo, "-o", tmp_path / "m.kgraph"],
        ["kiln-cc", fifo, "-o", tmp_path / "m.kar", "--unsigned"],
        ["kiln", "inspect", fifo],
    ]
    for argv in commands:
        # Before: each of these waited for a writer that never came.
        proc = run(argv, timeout=30)
        assert proc.returncode != 0, argv
        assert "not a regular file" in proc.stderr and "pipe" in proc.stderr, \
            (argv, proc.stderr)


def test_compiler_arguments_the_worker_does_not_allow_never_reach_the_toolchain(
        farm, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    # Unsandboxed, so that only the argument check stands between the
    # client and `cp -t DIR` (before, it copied the graph into DIR).
    farm.start_worker("w1", "--sandbox", "none",
                      "--toolchain", "cp@1=cp {input} {output} {args}",
                      "--toolchain", "cpv@1=cp {input} {output} {args:-v,--preserve=*}")
    farm.wait_for_workers(1)
    model = tiny_model(tmp_path / "m.onnx", 1)
    proc = farm.compile(model, tmp_path / "a.kar", "--toolchain", "cp@1",
                        "--compiler-args", f"-t {victim}")
    assert proc.returncode != 0, proc.stdout
    assert "compiler argument '-t' is not one that toolchain 'cp' allows" in proc.stderr, \
        proc.stderr
    assert os.listdir(victim) == []
    # The arguments the operator lists go through, one word each.
    proc = farm.compile(model, tmp_path / "b.kar", "--toolchain", "cpv@1",
                        "--compiler-args", "-v --preserve=mode")
    assert proc.returncode == 0, proc.stderr + farm.logs()
    proc = farm.compile(model, tmp_path / "c.kar", "--toolchain", "cpv@1",
                        "--compiler-args", f"--preserve={victim}")
    assert proc.returncode != 0 and f"'--preserve={victim}'" in proc.stderr, proc.stderr
    assert os.listdir(victim) == []


def test_a_symlink_at_output_is_not_followed(farm, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the worker's secret\n")
    farm.start_worker("w1", "--sandbox", "none",
                      "--toolchain", f"ln@1=ln -sf {secret} {{output}}")
    farm.wait_for_workers(1)
    model = tiny_model(tmp_path / "m.onnx", 2)
    out = tmp_path / "a.kar"
    proc = farm.compile(model, out, "--toolchain", "ln@1")
    # Before: the worker read through the link and shipped the file.
    assert proc.returncode != 0, proc.stdout
    assert "symbolic link" in proc.stderr, proc.stderr
    assert not out.exists()


def test_terminal_escapes_from_others_are_printed_escaped(farm, tmp_path):
    # A node name with escapes, in a model whose shapes do not agree.
    node = helper.make_node("Add", ["x", "w"], ["y"], name=f"evil{ESC}node")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "evil.onnx"
    onnx.save(model, str(path))
    proc = run(["kiln", "import", path, "-o", tmp_path / "evil.kgraph"], timeout=60)
    assert proc.returncode != 0
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, repr(proc.stderr)
    assert "evil\\x1b]0;pwned\\x07\\x1b[31mnode" in proc.stderr, proc.stderr

    # A compile log with escapes, from the farm (cached and served to the
    # next client too).
    farm.start_worker("w1", "--toolchain",
                      "loud@1=sh -c 'printf \"boom \\033]0;pwned\\007\\033[2J\\n\" >&2; exit 3'")
    farm.wait_for_workers(1)
    tiny = tiny_model(tmp_path / "t.onnx", 3)
    for attempt in range(2):
        proc = farm.compile(tiny, tmp_path / "t.kar", "--toolchain", "loud@1")
        assert proc.returncode != 0
        assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, repr(proc.stderr)
        assert "boom \\x1b]0;pwned\\x07\\x1b[2J" in proc.stderr, proc.stderr


def _tar_members(kar):
    with tarfile.open(kar) as tf:
        return [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]


def test_changed_archives_and_keyrings_are_refused_by_verify_and_run(tmp_path, built):
    kar, ring, keys = built
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 4), np.float32))

    def refused(path, keyring, needle):
        for argv in (["kiln", "verify", path, "--keyring", keyring],
                     ["kiln-run", path, "--keyring", keyring, "--input", f"x={x}",
                      "--output-dir", tmp_path / "out"]):
            proc = run(argv, timeout=60)
            assert proc.returncode != 0, (argv, proc.stdout)
            assert needle in proc.stderr, (argv, proc.stderr)

    # Bytes appended after the end of the tar (README: any byte changed
    # is refused).
    appended = tmp_path / "appended.kar"
    appended.write_bytes(kar.read_bytes() + b"trailing")
    refused(appended, ring, "follow the archive's end marker")

    # A member made setuid, as `tar xf` run as root would restore it.
    setuid = tmp_path / "setuid.kar"
    with tarfile.open(setuid, "w", format=tarfile.PAX_FORMAT) as out:
        for ti, data in _tar_members(kar):
            if ti.name == "weights.bin":
                ti.mode = 0o4755
            out.addfile(ti, io.BytesIO(data))
    refused(setuid, ring, "has mode 4755")

    # Copied member for member by Python's tarfile (records of 10240
    # bytes): still the same artifact.
    copy = tmp_path / "copy.kar"
    with tarfile.open(copy, "w", format=tarfile.PAX_FORMAT) as out:
        for ti, data in _tar_members(kar):
            out.addfile(ti, io.BytesIO(data))
    assert run(["kiln", "verify", copy, "--keyring", ring], timeout=60).returncode == 0

    # Another key signs; a keyring that links to it, or holds it as the
    # first of two PEM blocks, does not trust it.
    other = tmp_path / "other"
    run(["kiln", "keygen", "--out", other], check=True)
    theirs = tmp_path / "theirs.kar"
    run(["kiln-cc", tmp_path / "mlp.kgraph", "-o", theirs, "--key", other / "kiln.key"],
        check=True)
    linked = tmp_path / "linked"
    linked.mkdir()
    shutil.copy(keys / "kiln.pub", linked / "me.pub")
    os.symlink(other / "kiln.pub", linked / "other.pub")
    refused(theirs, linked, "not in keyring")
    double = tmp_path / "double"
    double.mkdir()
    (double / "both.pub").write_bytes((other / "kiln.pub").read_bytes()
                                      + (keys / "kiln.pub").read_bytes())
    refused(theirs, double, "not in keyring")
    proc = run(["kiln", "verify", theirs, "--keyring", double], timeout=60)
    assert "holds 2 PEM blocks" in proc.stderr, proc.stderr
