"""The ONNX conformance harness (tests/conformance/run_conformance.py)
checked on a handful of node tests whose outcome is known: one kiln
passes, one it must refuse cleanly (Loop), one whose expected output is
deliberately perturbed so that kiln's right answer must be classified
wrong, and crashes and hangs that are SIMULATED (a kiln-run wrapper that
kills itself with SIGSEGV, a worker told to die or to hang on one test)
because kiln has no honest crash to offer.  Every run is bounded by a
timeout and the harness stops its own workers.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import BIN, SRC

LIB = os.environ.get("KILN_LIB", os.path.join(SRC, "build", "lib"))
RUNNER = os.path.join(SRC, "tests", "conformance", "run_conformance.py")
GEN = os.path.join(SRC, "tests", "conformance", "gen_data.py")

PASSES = "test_relu"            # Relu: part of the foundation
REFUSED = "test_loop11"         # control flow: kiln has no Loop
RESHAPE = "test_reshape_reordered_all_dims"   # its 'shape' input is frozen


@pytest.fixture(scope="module")
def node_data(tmp_path_factory):
    """The generated node-test data: build/conformance's when `make
    conformance` made it already, else freshly generated (a few seconds)."""
    built = os.path.join(SRC, "build", "conformance", "data", "node")
    if os.path.isdir(os.path.join(built, PASSES)):
        return built
    out = str(tmp_path_factory.mktemp("onnxdata") / "data")
    p = subprocess.run([sys.executable, GEN, out], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return os.path.join(out, "node")


def _pick(node_data, dest, names):
    """A data directory holding only the named tests (copies)."""
    os.makedirs(dest, exist_ok=True)
    for n in names:
        shutil.copytree(os.path.join(node_data, n), os.path.join(dest, n))
    return str(dest)


def _perturb(test_dir):
    """Change one element of the expected output by far more than the
    tolerance."""
    import onnx
    from onnx import numpy_helper
    path = os.path.join(test_dir, "test_data_set_0", "output_0.pb")
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    a = numpy_helper.to_array(t).copy()
    a.flat[0] += 1.0
    with open(path, "wb") as f:
        f.write(numpy_helper.from_array(a, t.name).SerializeToString())


def _run(data, out, *extra, timeout=180):
    p = subprocess.run([sys.executable, RUNNER, "--data", data, "--out", str(out),
                        "--bin", BIN, "--lib", LIB, *extra],
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, KILN_SRC=SRC))
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    return p, lines[-1], {t["name"]: t for t in report["tests"]}


@pytest.mark.parametrize("mode", ["inproc", "cli"])
def test_harness_classifies_pass_refusal_and_wrong_answer(node_data, tmp_path, mode):
    data = _pick(node_data, tmp_path / "data", [PASSES, REFUSED])
    shutil.copytree(os.path.join(data, PASSES), os.path.join(data, "test_relu_perturbed"))
    _perturb(os.path.join(data, "test_relu_perturbed"))

    p, last, tests = _run(data, tmp_path / "out", "--mode", mode)

    assert last == "1 passed, 1 failed, 1 skipped", p.stdout + p.stderr
    assert p.returncode == 1
    assert tests[PASSES]["status"] == "passed"
    assert tests[REFUSED]["status"] == "unsupported"
    assert tests[REFUSED]["stage"] == "import"
    assert "Loop" in tests[REFUSED]["message"]
    wrong = tests["test_relu_perturbed"]
    assert wrong["status"] == "wrong" and wrong["stage"] == "compare"
    assert "1 of 60 elements differ" in wrong["message"]
    # The unsupported summary names the op; the text report has every test.
    assert any(line.strip().startswith("Loop") for line in p.stdout.splitlines())
    with open(tmp_path / "out" / "report.txt") as f:
        text = f.read()
    for name in (PASSES, REFUSED, "test_relu_perturbed"):
        assert name in text


def test_harness_exits_zero_when_nothing_fails(node_data, tmp_path):
    data = _pick(node_data, tmp_path / "data", [PASSES, REFUSED])
    p, last, _ = _run(data, tmp_path / "out")
    assert last == "1 passed, 0 failed, 1 skipped"
    assert p.returncode == 0


def test_harness_freezes_shape_inputs_unless_told_not_to(node_data, tmp_path):
    data = _pick(node_data, tmp_path / "data", [RESHAPE])
    _, _, frozen = _run(data, tmp_path / "a")
    _, _, plain = _run(data, tmp_path / "b", "--no-freeze")
    assert frozen[RESHAPE]["frozen_inputs"] == ["shape"]
    assert plain[RESHAPE]["frozen_inputs"] == []


def test_harness_survives_a_simulated_kiln_run_segfault(node_data, tmp_path):
    """SIMULATED crash: kiln-run is replaced by a script that kills itself
    with SIGSEGV.  The test is classified wrong, the rest still runs."""
    data = _pick(node_data, tmp_path / "data", [PASSES, REFUSED])
    wrapper = tmp_path / "kiln-run-segv"
    wrapper.write_text("#!/bin/sh\nkill -SEGV $$\n")
    wrapper.chmod(0o755)

    p, last, tests = _run(data, tmp_path / "out", "--mode", "cli", "--kiln-run", str(wrapper))

    assert last == "0 passed, 1 failed, 1 skipped", p.stdout + p.stderr
    assert p.returncode == 1
    assert tests[PASSES]["status"] == "wrong"
    assert tests[PASSES]["stage"] == "run"
    assert "killed by SIGSEGV" in tests[PASSES]["message"]
    assert tests[REFUSED]["status"] == "unsupported"


def test_harness_fails_a_right_answer_that_came_with_a_sanitizer_report(node_data, tmp_path):
    """SIMULATED sanitizer report: the real kiln-run computes the answer,
    then its wrapper prints an UndefinedBehaviorSanitizer line."""
    data = _pick(node_data, tmp_path / "data", [PASSES])
    wrapper = tmp_path / "kiln-run-ubsan"
    wrapper.write_text(f"#!/bin/sh\n{os.path.join(BIN, 'kiln-run')} \"$@\" || exit $?\n"
                       "echo 'runtime/kiln_kernels.c:1:1: runtime error: simulated' >&2\n")
    wrapper.chmod(0o755)

    p, last, tests = _run(data, tmp_path / "out", "--mode", "cli", "--kiln-run", str(wrapper))

    assert last == "0 passed, 1 failed, 0 skipped", p.stdout + p.stderr
    assert tests[PASSES]["status"] == "wrong"
    assert "runtime error: simulated" in tests[PASSES]["message"]


def test_harness_restarts_a_worker_that_dies_or_hangs(node_data, tmp_path):
    """SIMULATED crash and hang inside the in-process worker: one worker
    (-j 1), so the tests after each one run only if it was replaced."""
    names = [PASSES, REFUSED, "test_relu_copy", "test_relu_hangs"]
    data = _pick(node_data, tmp_path / "data", [PASSES, REFUSED])
    for n in names[2:]:
        shutil.copytree(os.path.join(data, PASSES), os.path.join(data, n))

    p, last, tests = _run(data, tmp_path / "out", "-j", "1", "--timeout", "3",
                          "--simulate-crash", "test_relu_copy",
                          "--simulate-hang", "test_relu_hangs", timeout=120)

    assert last == "1 passed, 2 failed, 1 skipped", p.stdout + p.stderr
    assert tests["test_relu_copy"]["stage"] == "crash"
    # "killed by SIGSEGV", or AddressSanitizer's SEGV report in a sanitizer build.
    assert "SEGV" in tests["test_relu_copy"]["message"]
    assert tests["test_relu_hangs"]["stage"] == "hang"
    assert tests[PASSES]["status"] == "passed"
    assert tests[REFUSED]["status"] == "unsupported"
    # No worker is left behind.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30)
    assert str(tmp_path) not in ps.stdout


def test_generated_expected_outputs_are_what_numpy_computes(node_data):
    """The data generator (numpy aliases put back) produced real data."""
    import onnx
    from onnx import numpy_helper
    d = os.path.join(node_data, PASSES, "test_data_set_0")
    arrays = []
    for n in ("input_0.pb", "output_0.pb"):
        t = onnx.TensorProto()
        with open(os.path.join(d, n), "rb") as f:
            t.ParseFromString(f.read())
        arrays.append(numpy_helper.to_array(t))
    np.testing.assert_array_equal(arrays[1], np.maximum(arrays[0], 0))
