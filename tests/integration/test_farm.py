"""The farm itself, with real processes on loopback: a broker and workers
compile through `kiln compile --broker`, cache, share one build between
clients, report compile failures with their log, survive a worker dying
mid-job and a broker restart.  Every process is stopped by the fixtures'
finalizers; every wait is bounded."""

import json
import os
import signal
import subprocess
import tarfile
import time

import pytest

from conftest import BIN, SRC, kiln_bin, run
from kiln.farm import LocalFarm, free_port

MODEL = os.path.join(SRC, "tests", "data", "onnx", "mlp.onnx")
OTHER_MODEL = os.path.join(SRC, "tests", "data", "onnx", "conv.onnx")

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker", "kiln-cc")),
    reason="build/bin lacks kiln, kiln-broker, kiln-worker or kiln-cc: run `make` first")


@pytest.fixture
def farm(tmp_path):
    """A broker with no workers yet; tests add the workers they need."""
    f = LocalFarm(BIN, workers=0, workdir=str(tmp_path / "farm"))
    f.start()
    try:
        yield f
    finally:
        f.stop()


def start_worker(farm, name, *args):
    """Start a kiln-worker that the farm's stop() will kill.  Its job
    workdirs go under the farm's directory, so that one killed with SIGKILL
    leaves nothing in /tmp."""
    log = open(os.path.join(farm.workdir, name + ".log"), "ab")
    env = dict(os.environ, TMPDIR=farm.workdir)
    proc = subprocess.Popen([kiln_bin("kiln-worker"), "--broker", farm.endpoint,
                             "--name", name, *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    farm.workers.append(proc)
    return proc


def broker_log(farm):
    with open(os.path.join(farm.workdir, "broker.log"), "rb") as f:
        return f.read().decode(errors="replace")


def wait_for_log(farm, text, count=1, timeout=20.0):
    """Wait until `text` appears `count` times in the broker's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker_log(farm).count(text) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"'{text}' x{count} not in the broker log within {timeout}s\n"
                         f"{farm.logs()}")


def compile_args(farm, model, out, *extra, timeout_s=120):
    """`kiln compile` arguments (without the program) for the farm."""
    return ["compile", str(model), "-o", str(out), "--broker", farm.endpoint, "--json",
            "--timeout", str(timeout_s), *extra]


def start_compile(farm, model, out):
    """`kiln compile` in the background; the caller waits for it."""
    return subprocess.Popen([kiln_bin("kiln")] + compile_args(farm, model, out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compile_json(farm, model, out, *extra):
    proc = run(["kiln"] + compile_args(farm, model, out, *extra), timeout=180)
    assert proc.returncode == 0, f"compile failed: {proc.stderr}\n{farm.logs()}"
    return json.loads(proc.stdout)


def fake_cc(tmp_path, name, body):
    """A compiler stand-in (python, one process) for --cc."""
    path = tmp_path / name
    path.write_text("#!/usr/bin/python3\nimport os, sys, time\n" + body)
    path.chmod(0o755)
    return str(path)


def test_two_workers_build_once_then_serve_from_the_action_cache(farm, tmp_path):
    start_worker(farm, "worker-1")
    start_worker(farm, "worker-2")
    wait_for_log(farm, " ready: ", count=2)
    kgraph = tmp_path / "mlp.kgraph"
    run(["kiln", "import", MODEL, "-o", kgraph], check=True)

    first = compile_json(farm, kgraph, tmp_path / "a.kar")
    assert first["cached"] is False
    assert first["worker"] in ("worker-1", "worker-2")
    assert len(first["artifact"]) == 64 and len(first["action_key"]) == 64
    verify = run(["kiln", "verify", tmp_path / "a.kar", "--keyring", farm.keyring])
    assert verify.returncode == 0, verify.stderr
    with tarfile.open(tmp_path / "a.kar") as tf:
        provenance = json.load(tf.extractfile("provenance.json"))
    assert provenance["builder"] == first["worker"]
    assert provenance["broker"] and provenance["built_at"]
    # The other worker built it too, and agreed (the cross-check).
    assert provenance["checked_by"] == [{"worker-1": "worker-2", "worker-2": "worker-1"}
                                        [first["worker"]]]
    assert provenance["cross_check"]["checked"] is True

    second = compile_json(farm, kgraph, tmp_path / "b.kar")
    assert second["cached"] is True
    assert second["worker"] is None
    assert second["artifact"] == first["artifact"]
    assert second["action_key"] == first["action_key"]
    assert (tmp_path / "b.kar").read_bytes() == (tmp_path / "a.kar").read_bytes()
    # The store holds it under its content hash, the action cache names it.
    ac = os.path.join(farm.state, "ac", first["action_key"])
    assert open(ac).read().strip() == first["artifact"]
    assert os.path.exists(os.path.join(farm.state, "cas", "sha256", first["artifact"][:2],
                                       first["artifact"]))
    assert broker_log(farm).count("queued") == 1


def test_identical_concurrent_requests_share_one_build(farm, tmp_path):
    slow = fake_cc(tmp_path, "slow-cc",
                   f"time.sleep(1.5)\nos.execv({kiln_bin('kiln-cc')!r}, "
                   f"[{kiln_bin('kiln-cc')!r}] + sys.argv[1:])\n")
    start_worker(farm, "worker-1", "--cc", slow)
    start_worker(farm, "worker-2", "--cc", slow)
    wait_for_log(farm, " ready: ", count=2)
    procs = []
    try:
        for i in range(3):
            procs.append(start_compile(farm, MODEL, tmp_path / f"{i}.kar"))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"{err}\n{farm.logs()}"
            results.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert len({r["artifact"] for r in results}) == 1
    assert broker_log(farm).count("built by") == 1


def test_compile_failure_comes_back_with_the_compiler_log(farm, tmp_path):
    broken = fake_cc(tmp_path, "broken-cc",
                     "sys.stderr.write(\"error: node 'boom' (Conv): refused by the test\\n\")\n"
                     "sys.exit(3)\n")
    start_worker(farm, "worker-1", "--cc", broken)
    wait_for_log(farm, " ready: ")
    proc = run(["kiln"] + compile_args(farm, MODEL, tmp_path / "x.kar"), timeout=120)
    assert proc.returncode != 0
    assert "compile failed on worker worker-1" in proc.stderr
    assert "status 3" in proc.stderr
    assert "node 'boom' (Conv): refused by the test" in proc.stderr
    assert not (tmp_path / "x.kar").exists()
    # The failure is cached with its log: asking again does not compile again.
    again = run(["kiln"] + compile_args(farm, MODEL, tmp_path / "x.kar"), timeout=120)
    assert again.returncode != 0
    assert "cached failure" in again.stderr
    assert "node 'boom' (Conv): refused by the test" in again.stderr
    assert broker_log(farm).count("queued for") == 1
    # --retry-failed builds it again, here on a healthy worker.
    start_worker(farm, "worker-2")
    wait_for_log(farm, "worker worker-2 ready")
    for p in farm.workers[:1]:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
    wait_for_log(farm, "worker worker-1 dropped")
    ok = compile_json(farm, MODEL, tmp_path / "y.kar", "--retry-failed")
    assert ok["cached"] is False and ok["worker"] == "worker-2"
    # ... and the success replaces the cached failure.
    assert compile_json(farm, MODEL, tmp_path / "z.kar")["cached"] is True


def test_compile_that_outlives_the_timeout_is_killed(farm, tmp_path):
    sleeper = fake_cc(tmp_path, "sleepy-cc", "time.sleep(120)\n")
    start_worker(farm, "worker-1", "--cc", sleeper, "--timeout", "1")
    wait_for_log(farm, " ready: ")
    t0 = time.monotonic()
    proc = run(["kiln"] + compile_args(farm, MODEL, tmp_path / "x.kar"), timeout=60)
    assert proc.returncode != 0
    assert "timeout" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_broker_requeues_job_when_worker_dies(farm, tmp_path):
    stuck = fake_cc(tmp_path, "stuck-cc", "time.sleep(120)\n")
    doomed = start_worker(farm, "doomed", "--cc", stuck)
    wait_for_log(farm, "worker doomed ready")
    client = start_compile(farm, MODEL, tmp_path / "x.kar")
    try:
        wait_for_log(farm, "sent to worker doomed")
        start_worker(farm, "healthy")
        wait_for_log(farm, "worker healthy ready")
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=10)
        out, err = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    assert client.returncode == 0, f"{err}\n{farm.logs()}"
    res = json.loads(out)
    assert res["worker"] == "healthy"
    log = broker_log(farm)
    assert "worker doomed dropped: " in log
    assert "back in the queue" in log
    assert "(attempt 2" in log


def test_workers_come_back_after_a_broker_restart_and_the_cache_survives(farm, tmp_path):
    start_worker(farm, "worker-1")
    wait_for_log(farm, " ready: ")
    first = compile_json(farm, MODEL, tmp_path / "a.kar")
    assert first["cached"] is False

    farm._kill(farm.broker)
    farm.start_broker()
    wait_for_log(farm, "worker worker-1 ready", count=2, timeout=30)
    again = compile_json(farm, MODEL, tmp_path / "b.kar")
    assert again["cached"] is True and again["artifact"] == first["artifact"]
    other = compile_json(farm, OTHER_MODEL, tmp_path / "c.kar")
    assert other["cached"] is False and other["worker"] == "worker-1"


def test_compile_against_a_silent_endpoint_times_out(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc = run(["kiln", "compile", MODEL, "-o", tmp_path / "x.kar", "--broker",
                f"tcp://127.0.0.1:{port}", "--wait", "2", "--fallback", "none"], timeout=60)
    assert proc.returncode == 3
    assert "no answer from the broker" in proc.stderr
    assert time.monotonic() - t0 < 20
    assert not (tmp_path / "x.kar").exists()


def test_broker_refuses_a_non_loopback_endpoint(tmp_path):
    keydir = tmp_path / "key"
    run(["kiln", "keygen", "--out", keydir], check=True)
    proc = run(["kiln-broker", "--listen", f"tcp://0.0.0.0:{free_port()}", "--state",
                tmp_path / "state", "--key", keydir / "kiln.key"], timeout=30)
    assert proc.returncode != 0
    assert "loopback" in proc.stderr


@pytest.mark.parametrize("member", ["program.kbin", "provenance.json"])
def test_damaged_cache_entry_is_rebuilt_not_served(farm, tmp_path, member):
    start_worker(farm, "worker-1")
    wait_for_log(farm, " ready: ")
    first = compile_json(farm, MODEL, tmp_path / "a.kar")
    stored = os.path.join(farm.state, "cas", "sha256", first["artifact"][:2], first["artifact"])
    with tarfile.open(stored) as tf:
        info = tf.getmember(member)
    data = bytearray(open(stored, "rb").read())
    data[info.offset_data + info.size // 2] ^= 0x01
    open(stored, "wb").write(bytes(data))
    second = compile_json(farm, MODEL, tmp_path / "b.kar")
    assert second["cached"] is False and second["worker"] == "worker-1"
    assert second["artifact"] == first["artifact"]
    assert "cache entry unusable" in broker_log(farm)
    verify = run(["kiln", "verify", tmp_path / "b.kar", "--keyring", farm.keyring])
    assert verify.returncode == 0, verify.stderr
    # The rebuild replaced the damaged entry.
    third = compile_json(farm, MODEL, tmp_path / "c.kar")
    assert third["cached"] is True
