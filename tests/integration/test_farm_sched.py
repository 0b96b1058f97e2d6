"""How the farm schedules and moves data (issue 4), with real processes on
loopback: fair share between clients (a single job does not wait behind
another client's 500-job batch; its wait is measured), priority, jobs going
only to workers with their toolchain and target, weights uploaded once in
chunks and then served from the broker's store and the workers' caches,
with the scheduler preferring the worker that holds a job's blobs, and
size limits refused with a clear error."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import kiln_bin
from farm_helpers import (Farm, batch_lines, big_model, running_farm, sleepy, tiny_model,
                          write_jobs)

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")


@pytest.fixture
def farm(tmp_path):
    with running_farm(tmp_path / "farm", broker_args=["--liveness-ms", "3000"]) as f:
        yield f


def _timed_compile(farm, model, out, *extra):
    t0 = time.monotonic()
    proc = farm.compile(model, out, *extra, timeout=120)
    return proc, time.monotonic() - t0


def test_single_job_does_not_wait_behind_another_clients_batch(farm, tmp_path):
    job_s = 1.0
    for name in ("w1", "w2"):
        farm.start_worker(name, "--toolchain", sleepy(job_s))
    farm.wait_for_workers(2)
    model = tiny_model(tmp_path / "m.onnx", 10)
    # One job alone: what a job costs end to end on this machine now.
    solo, solo_s = _timed_compile(farm, model, tmp_path / "solo.kar", "--toolchain", "sleepy@1",
                                  "--compiler-args", "--solo", "--client-name", "laptop")
    assert solo.returncode == 0, solo.stderr
    # Another client's batch of 500 distinct jobs fills the queue.
    jobs = write_jobs(tmp_path / "batch.jsonl",
                      [{"model": model, "output": str(tmp_path / f"b{i}.kar"),
                        "compiler_args": f"--job {i}"} for i in range(500)])
    batch = farm.spawn(farm.batch_argv(jobs, "--toolchain", "sleepy@1", "--client-name", "ci"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    farm.wait_for_status(lambda s: s["queue"]["queued"] >= 450 and s["queue"]["running"] == 2,
                         what="the batch queued and running")
    single, single_s = _timed_compile(farm, model, tmp_path / "single.kar", "--toolchain",
                                      "sleepy@1", "--compiler-args", "--single",
                                      "--client-name", "laptop")
    assert single.returncode == 0, single.stderr
    queued = farm.status()["queue"]["queued"]
    # With 2 slots busy, the single job waits for the first slot to free
    # (at most one job duration) and then runs: about two job durations.
    # Behind the batch it would wait 500 / 2 jobs.
    print(f"\nfair share: a job alone took {solo_s:.2f} s; with {queued} of another client's "
          f"jobs still queued it took {single_s:.2f} s (behind the batch: "
          f"~{500 / 2 * job_s:.0f} s)")
    assert single_s < 2 * solo_s + 2.0, (single_s, solo_s)
    assert queued > 400
    # Interrupting the batch client cancels its jobs on the farm.
    batch.send_signal(signal.SIGINT)
    out, _ = batch.communicate(timeout=60)
    assert batch.returncode != 0
    jobs_done, summary = batch_lines(out)
    assert summary["jobs"] == 500 and summary["ok"] < 20
    st = farm.wait_for_status(lambda s: s["queue"]["queued"] == 0, timeout=20,
                              what="the canceled batch gone from the queue")
    assert st["jobs"]["canceled"] >= 400


def test_lower_priority_value_runs_first_within_a_client(farm, tmp_path):
    farm.start_worker("w1", "--toolchain", sleepy(0.3))
    farm.wait_for_workers(1)
    model = tiny_model(tmp_path / "m.onnx", 11)
    jobs = write_jobs(tmp_path / "batch.jsonl",
                      [{"model": model, "output": str(tmp_path / f"b{i}.kar"),
                        "compiler_args": f"--job {i}"} for i in range(30)])
    batch = farm.spawn(farm.batch_argv(jobs, "--toolchain", "sleepy@1", "--client-name", "team"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    farm.wait_for_status(lambda s: s["queue"]["queued"] >= 25, what="the batch queued")
    urgent, urgent_s = _timed_compile(farm, model, tmp_path / "u.kar", "--toolchain", "sleepy@1",
                                      "--compiler-args", "--urgent", "--client-name", "team",
                                      "--priority", "-10")
    assert urgent.returncode == 0, urgent.stderr
    st = farm.status()
    print(f"\npriority: the urgent job took {urgent_s:.2f} s with "
          f"{st['queue']['queued']} jobs of the same client queued")
    assert st["queue"]["queued"] >= 15
    out, err = batch.communicate(timeout=120)
    assert batch.returncode == 0, err


def test_jobs_go_only_to_workers_with_their_toolchain_and_target(farm, tmp_path):
    farm.start_worker("plain", "--slots", "2")
    farm.start_worker("vendor", "--no-builtin", "--target", "trn1", "--toolchain",
                      "fakecc@2.1=cp {input} {output}")
    farm.wait_for_workers(2)
    model = tiny_model(tmp_path / "m.onnx", 12)
    a = farm.compile(model, tmp_path / "a.kar", "--toolchain", "fakecc@2.1", "--target", "trn1")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["worker"] == "vendor"
    b = farm.compile(model, tmp_path / "b.kar")
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["worker"] == "plain"
    # The wrapped output is an artifact like any other: signed, verifiable,
    # naming the toolchain; its payload is the toolchain's output file.
    ok = subprocess.run([kiln_bin("kiln"), "verify", tmp_path / "a.kar", "--keyring",
                         farm.keyring], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    info = subprocess.run([kiln_bin("kiln"), "inspect", tmp_path / "a.kar"], capture_output=True,
                          text=True, timeout=30)
    assert "fakecc" in info.stdout and "trn1" in info.stdout, info.stdout
    assert "toolchain.out" in info.stdout
    # Nobody offers this version: the job waits, and the client gives up
    # when told to, which cancels the job.
    c = farm.compile(model, tmp_path / "c.kar", "--toolchain", "fakecc@3", "--target", "trn1",
                     "--wait", "2")
    assert c.returncode != 0 and "gave up waiting after 2 s" in c.stderr, c.stderr
    farm.wait_for_status(lambda s: s["queue"]["queued"] == 0, timeout=10,
                         what="the unservable job canceled")


def _batch_one(farm, tmp_path, model, out, *extra):
    jobs = write_jobs(tmp_path / (os.path.basename(str(out)) + ".jsonl"),
                      [{"model": str(model), "output": str(out)}])
    proc = subprocess.run(farm.batch_argv(jobs, *extra), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{farm.logs()}"
    lines, summary = batch_lines(proc.stdout)
    return lines[0], summary


@pytest.fixture
def farm_unchecked(tmp_path):
    """A farm whose builds are not cross-checked: under the default policy
    (every build checked by a second worker) both workers of a two-worker
    farm hold a job's weights after it, and which of them builds the next
    job that needs them is a tie (the test failed in 2 of 14 runs)."""
    with running_farm(tmp_path / "farm",
                      broker_args=["--liveness-ms", "3000", "--cross-check", "off"]) as f:
        yield f


def test_weights_move_once_and_the_worker_holding_them_is_preferred(farm_unchecked, tmp_path):
    farm = farm_unchecked
    farm.start_worker("w1")
    farm.start_worker("w2")
    farm.wait_for_workers(2)
    model = big_model(tmp_path / "big.onnx", 24)
    first, s1 = _batch_one(farm, tmp_path, model, tmp_path / "a.kar")
    assert s1["uploaded_bytes"] >= 24 << 20
    builder = first["worker"]
    st = farm.status()
    assert st["transfer"]["uploaded_bytes"] >= 24 << 20
    fetched = st["transfer"]["fetched_bytes"]
    assert fetched >= 24 << 20
    # The same weights under other compiler arguments: a new action, but no
    # weight byte crosses the network again, and the worker that holds them
    # builds it.  (The broker picks among idle workers: the first job's
    # builder may still be finishing when the client has its artifact.)
    farm.wait_for_status(lambda s: all(w["busy"] == 0 for w in s["workers"]), timeout=30,
                         what="both workers idle")
    second, s2 = _batch_one(farm, tmp_path, model, tmp_path / "b.kar", "--compiler-args",
                            "--optlevel 1")
    assert second["cached"] is False
    assert s2["uploaded_bytes"] == 0
    assert second["worker"] == builder
    st = farm.status()
    assert st["transfer"]["fetched_bytes"] == fetched
    # A worker restarted with its cache keeps it and says so.
    farm.kill_worker(builder)
    farm.restart_worker(builder)
    farm.wait_for_log(f"worker {builder} ready: ", count=2)
    ready = [l for l in farm.log().splitlines() if f"worker {builder} ready: " in l][-1]
    assert "0 blobs cached" not in ready, ready


def test_sizes_over_the_limits_are_refused_with_clear_errors(tmp_path):
    farm = Farm(tmp_path / "farm", broker_args=["--store-max-bytes", "4M"])
    farm.start_broker()
    try:
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        model = big_model(tmp_path / "big.onnx", 8)
        proc = farm.compile(model, tmp_path / "x.kar")
        assert proc.returncode != 0
        assert "more than the store holds" in proc.stderr, proc.stderr
        # The broker is fine afterwards.
        small = farm.compile(tiny_model(tmp_path / "s.onnx", 13), tmp_path / "s.kar")
        assert small.returncode == 0, small.stderr
    finally:
        farm.stop()
