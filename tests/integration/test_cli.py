"""The command line as CI and laptops use it (issue 16), with real
processes on loopback: the published exit statuses, `kiln batch --junit`
read back with xml.etree, the local fallback when the farm is down, and a
mistyped command's suggestion.  Every process is stopped by the Farm's
stop(); every wait is bounded."""

import io
import json
import os
import subprocess
import tarfile
import xml.etree.ElementTree as ET

import pytest

from conftest import SRC, kiln_bin, run
from farm_helpers import curve_farm, running_farm, tiny_model, write_jobs
from kiln.farm import free_port

MODEL = os.path.join(SRC, "tests", "data", "onnx", "mlp.onnx")

# The published exit statuses (client/kiln_cmds.h, docs/ci.md).
EXIT_USAGE, EXIT_UNREACHABLE, EXIT_JOBS, EXIT_VERIFY = 2, 3, 4, 5

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

OK_TC = "ok@1=sh -c 'cp {input} {output}'"
BAD_TC = ("bad@1=sh -c 'echo \"error: node boom (Conv): refused by the test\" >&2; "
          "echo \"last line of the log\" >&2; exit 3'")


@pytest.fixture
def farm(tmp_path):
    with running_farm(tmp_path / "farm") as f:
        yield f


def _provenance(path):
    with tarfile.open(path) as tar:
        return json.load(io.TextIOWrapper(tar.extractfile("provenance.json")))


def test_a_mistyped_command_suggests_the_nearest_one():
    proc = run(["kiln", "compil", "x.onnx"], timeout=30)
    assert proc.returncode == EXIT_USAGE
    assert "did you mean 'compile'?" in proc.stderr
    proc = run(["kiln", "stauts"], timeout=30)
    assert proc.returncode == EXIT_USAGE and "did you mean 'status'?" in proc.stderr
    # Nothing near: no suggestion, the list of commands.
    proc = run(["kiln", "frobnicate"], timeout=30)
    assert proc.returncode == EXIT_USAGE
    assert "did you mean" not in proc.stderr and "commands:" in proc.stderr
    # kiln --help lists the exit statuses.
    helped = run(["kiln", "--help"], timeout=30)
    assert helped.returncode == 0 and "farm could not be reached" in helped.stdout


def test_exit_statuses_usage_verification_and_unreachable(tmp_path, config_dir):
    assert run(["kiln", "compile", MODEL], timeout=30).returncode == EXIT_USAGE
    assert run(["kiln", "verify", "--bogus"], timeout=30).returncode == EXIT_USAGE
    # A local build, verified against the right and a wrong keyring, then damaged.
    out = tmp_path / "m.kar"
    run(["kiln", "compile", "--local", MODEL, "-o", out], check=True)
    own = config_dir / "keys"
    assert run(["kiln", "verify", out, "--keyring", own]).returncode == 0
    other = tmp_path / "other"
    run(["kiln", "keygen", "--out", other], check=True)
    (other / "kiln.key").unlink()
    refused = run(["kiln", "verify", out, "--keyring", other])
    assert refused.returncode == EXIT_VERIFY, refused.stderr
    data = bytearray(out.read_bytes())
    data[-3000] ^= 1
    bad = tmp_path / "bad.kar"
    bad.write_bytes(bytes(data))
    assert run(["kiln", "verify", bad, "--keyring", own]).returncode == EXIT_VERIFY
    # A file that is not there is a plain failure, not a verification.
    assert run(["kiln", "verify", tmp_path / "none.kar", "--keyring", own]).returncode == 1
    # Nobody listens on this port: the farm is unreachable.
    silent = f"tcp://127.0.0.1:{free_port()}"
    proc = run(["kiln", "compile", MODEL, "-o", tmp_path / "x.kar", "--broker", silent,
                "--fallback", "none", "--wait", "2"], timeout=60)
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    assert "no answer from the broker" in proc.stderr
    assert not (tmp_path / "x.kar").exists()
    status = run(["kiln", "status", "--broker", silent], timeout=60)
    assert status.returncode == EXIT_UNREACHABLE, status.stderr


def test_compile_fails_when_the_farm_is_down_unless_local_fallback_is_asked(farm, tmp_path,
                                                                   config_dir):
    farm.start_worker("w1")
    farm.wait_for_workers(1)
    first = farm.compile(MODEL, tmp_path / "farm.kar", "--fallback-after", "5")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["fallback"] is False
    farm.kill_broker()
    # The default: no fallback, the documented status and no file.
    for extra, env in (([], None), (["--fallback", "none"], None),
                       ([], {"KILN_FALLBACK": "none"}), (["--no-fallback"], None),
                       (["--fallback", "none"], {"KILN_FALLBACK": "local"})):
        argv = farm.compile_argv(MODEL, tmp_path / "none.kar", "--wait", "1", *extra)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, **(env or {})))
        assert proc.returncode == EXIT_UNREACHABLE, (extra, env, proc.stderr)
        assert "no answer from the broker" in proc.stderr
        assert "--fallback local" in proc.stderr          # the hint
        assert "compiling locally" not in proc.stderr
        assert not (tmp_path / "none.kar").exists()
    # Opted in: built here, said on stderr, in --json and in provenance.
    proc = farm.compile(MODEL, tmp_path / "local.kar", "--fallback", "local",
                        "--fallback-after", "0.5", timeout=60)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["fallback"] is True and res["worker"] is None and res["cached"] is False
    assert "compiling locally instead" in proc.stderr and farm.endpoint in proc.stderr
    prov = _provenance(tmp_path / "local.kar")
    assert prov["fallback"] is True and prov["unreachable_broker"] == farm.endpoint
    assert prov["builder"] == "local"
    # Signed with the user's key (not the farm's): the farm keyring refuses it.
    assert run(["kiln", "verify", tmp_path / "local.kar", "--keyring",
                config_dir / "keys"]).returncode == 0
    assert run(["kiln", "verify", tmp_path / "local.kar", "--keyring",
                farm.keyring]).returncode == EXIT_VERIFY
    # The environment opts in the same way.
    argv = farm.compile_argv(MODEL, tmp_path / "env.kar", "--fallback-after", "0.5")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, KILN_FALLBACK="local"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fallback"] is True
    assert (tmp_path / "env.kar").exists()


def test_batch_writes_junit_with_the_failure_log_and_exits_4(farm, tmp_path):
    farm.start_worker("w1", "--toolchain", OK_TC, "--toolchain", BAD_TC)
    farm.wait_for_workers(1)
    models = [tiny_model(tmp_path / f"m{i}.onnx", i) for i in range(3)]
    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      [{"model": models[0], "output": str(tmp_path / "a.kar"), "toolchain": "ok@1"},
                       {"model": models[1], "output": str(tmp_path / "b.kar"), "toolchain": "bad@1"},
                       {"model": models[2], "output": str(tmp_path / "c.kar"), "toolchain": "ok@1"}])
    report = tmp_path / "report.xml"
    proc = subprocess.run(farm.batch_argv(jobs, "--junit", report), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_JOBS, proc.stderr
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("tests") == "3" and suite.get("failures") == "1"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == set(models)
    failure = cases[models[1]].find("failure")
    assert failure is not None and failure.get("type") == "ECOMPILE"
    assert "node boom (Conv): refused by the test" in failure.text
    assert "last line of the log" in failure.text
    for m in (models[0], models[2]):
        case = cases[m]
        assert case.find("failure") is None and float(case.get("time")) > 0
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props["cached"] == "false" and len(props["artifact"]) == 64
        assert props["worker"] == "w1"
    # Again: the good ones come from the action cache, the bad one from the
    # failure cache, and the report says so.
    again = subprocess.run(farm.batch_argv(jobs, "--junit", report), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == EXIT_JOBS, again.stderr
    suite = ET.parse(report).getroot().find("testsuite")
    cached = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
              ["cached"] for c in suite.findall("testcase")}
    assert cached == {m: "true" for m in models}


def test_batch_exits_0_when_all_succeed_and_3_when_the_farm_is_unreachable(farm, tmp_path):
    farm.start_worker("w1", "--toolchain", OK_TC)
    farm.wait_for_workers(1)
    model = tiny_model(tmp_path / "m.onnx", 7)
    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      [{"model": model, "output": str(tmp_path / "a.kar"), "toolchain": "ok@1"}])
    ok = subprocess.run(farm.batch_argv(jobs), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    silent = f"tcp://127.0.0.1:{free_port()}"
    report = tmp_path / "down.xml"
    down = subprocess.run([kiln_bin("kiln"), "batch", "--jobs", str(jobs), "--broker", silent,
                           "--wait", "1", "--junit", str(report)],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == EXIT_UNREACHABLE, down.stderr
    # The report is still written: CI shows what did not run.
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("failures") == "1"
    assert suite.find("testcase/failure").get("type") == "EUNREACHABLE"


# --- the smaller things of issue 16 ---------------------------------------------

def test_a_fractional_wait_is_reported_as_given(farm, tmp_path):
    farm.start_worker("w1", "--toolchain", "slow@1=sh -c 'sleep 20; cp {input} {output}'")
    farm.wait_for_workers(1)
    model = tiny_model(tmp_path / "m.onnx", 3)
    proc = farm.compile(model, tmp_path / "x.kar", "--toolchain", "slow@1", "--wait", "0.3",
                        timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "gave up waiting after 0.3 s" in proc.stderr, proc.stderr
    assert run(["kiln", "compile", model, "-o", tmp_path / "y.kar", "--wait", "0"],
               timeout=30).returncode == EXIT_USAGE


def test_kiln_run_names_outputs_with_one_slash(tmp_path, config_dir):
    import numpy as np
    model = tiny_model(tmp_path / "m.onnx", 5)
    run(["kiln", "compile", "--local", model, "-o", tmp_path / "m.kar"], check=True)
    np.save(tmp_path / "x.npy", np.ones(4, dtype=np.float32))
    out = tmp_path / "out"
    proc = run(["kiln-run", tmp_path / "m.kar", "--keyring", config_dir / "keyring", "--input",
                f"x={tmp_path / 'x.npy'}", "--output-dir", f"{out}/"], check=True)
    assert proc.stdout.split() == [f"{out}/y.npy"], proc.stdout
    assert (out / "y.npy").exists()


def test_check_store_warns_about_a_live_broker_and_a_second_broker_is_refused(farm, tmp_path):
    check = subprocess.run([kiln_bin("kiln-broker"), "--check-store", "--state", farm.state],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"a broker (pid {farm.broker.pid}) is running on" in check.stderr
    repair = subprocess.run([kiln_bin("kiln-broker"), "--check-store", "--state", farm.state,
                             "--repair"], capture_output=True, text=True, timeout=60)
    assert repair.returncode == EXIT_USAGE and "stop it before --repair" in repair.stderr
    second = subprocess.run([kiln_bin("kiln-broker"), "--listen",
                             f"tcp://127.0.0.1:{free_port()}", "--state", farm.state, "--key",
                             os.path.join(farm.keydir, "kiln.key")],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert f"another kiln-broker (pid {farm.broker.pid}) uses the state directory" \
        in second.stderr
    farm.kill_broker()
    quiet = subprocess.run([kiln_bin("kiln-broker"), "--check-store", "--state", farm.state],
                           capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and "running on" not in quiet.stderr, quiet.stderr


def test_certificates_name_the_broker_and_workers_everywhere(tmp_path):
    # No --name: the certificate names the worker.
    with curve_farm(tmp_path, workers=("gpu-07",), clients=("ci",), broker="farm-broker-1",
                    name_workers=False) as farm:
        status = farm.status()
        assert status["broker"] == "farm-broker-1"
        assert [w["name"] for w in status["workers"]] == ["gpu-07"]
        assert "worker gpu-07:" in farm.log("gpu-07")
        assert "as farm-broker-1 (CurveZMQ)" in farm.log()
