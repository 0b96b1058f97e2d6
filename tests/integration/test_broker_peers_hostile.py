"""The broker against hostile or careless peers (issue 14, findings 3, 4
and 7), with real processes on loopback: uploads that announce more than
the store holds and stall, certificates removed from the trust directory
while their holders are connected, and two workers under one name.

Every process belongs to a Farm (stopped at the end, also on failure) or
is a raw socket closed by `with`; every wait is bounded.
"""

import json
import os
import subprocess
import tarfile
import time

import pytest

from conftest import kiln_bin, run
from farm_helpers import Farm, big_model, curve_certs, sleepy, tiny_model
from raw_zmtp import RawDealer

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

MiB = 1 << 20


def provenance(path):
    with tarfile.open(path) as tf:
        return json.load(tf.extractfile("provenance.json"))


# --- finding 7: two workers with the same --name ------------------------------

def test_a_second_worker_with_a_taken_name_is_refused_and_the_first_keeps_building(tmp_path):
    farm = Farm(tmp_path / "farm")
    farm.start_broker()
    try:
        # The first w1 has one slot; the impostor would show as three.
        farm.start_worker("w1", "--slots", "1", "--toolchain", sleepy(0.4))
        farm.wait_for_workers(1)
        twin_log = open(tmp_path / "twin.log", "wb")
        farm.spawn([kiln_bin("kiln-worker"), "--broker", farm.endpoint, "--name", "w1",
                    "--slots", "3", "--toolchain", sleepy(0.4),
                    "--cache", tmp_path / "twin-cache"],
                   stdout=twin_log, stderr=subprocess.STDOUT, env=dict(os.environ,
                                                                      TMPDIR=str(tmp_path)))
        twin_log.close()
        deadline = time.monotonic() + 30
        while ("the broker refused to register this worker"
               not in (tmp_path / "twin.log").read_text(errors="replace")):
            assert time.monotonic() < deadline, "the second w1 was not refused\n" + farm.logs()
            time.sleep(0.1)
        # Jobs while both run: none fails, each built by the first.
        models = [tiny_model(tmp_path / f"m{i}.onnx", 700 + i) for i in range(4)]
        procs = [farm.spawn(farm.compile_argv(m, tmp_path / f"{i}.kar", "--toolchain",
                                              "sleepy@1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, m in enumerate(models)]
        # For three seconds (three heartbeats) the one w1 is the first.
        deadline = time.monotonic() + 3
        seen = []
        while time.monotonic() < deadline:
            st = farm.status()
            seen.append([(w["name"], w["slots"]) for w in st["workers"]])
            time.sleep(0.2)
        assert all(s == [("w1", 1)] for s in seen), seen
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, f"{err}\n{farm.logs()}"
            assert json.loads(out)["worker"] == "w1"
        twin = (tmp_path / "twin.log").read_text(errors="replace")
        assert "the broker refused to register this worker" in twin, twin
        assert "worker name 'w1' is taken by a live worker" in twin, twin
        log = farm.log()
        assert "worker w1 dropped" not in log, log
        st = farm.status()
        assert st["jobs"]["failed"] == 0 and st["jobs"]["requeued"] == 0, st["jobs"]
        assert st["workers"][0]["done"] == len(models)
        # Once the first leaves, the second takes the name (it retries).
        farm.kill_worker("w1")
        farm.wait_for_status(lambda s: [(w["name"], w["slots"]) for w in s["workers"]]
                             == [("w1", 3)], timeout=20, what="the second w1 registered")
    finally:
        farm.stop()


# --- finding 3: uploads that announce more than the store holds ----------------

def _allocated(directory):
    """Bytes the file system allocated to the files under `directory`
    (what posix_fallocate takes), not their apparent sizes."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads: line")


def test_stalled_uploads_are_bounded_by_the_store_cap_and_the_broker_still_serves(tmp_path):
    cap, blob, max_uploads = 256 * MiB, 64 * MiB, 6
    farm = Farm(tmp_path / "farm", broker_args=["--store-max-bytes", str(cap),
                                                "--max-uploads", str(max_uploads)])
    farm.start_broker()
    attackers = []
    try:
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        pid = farm.broker.pid
        threads_before = _threads(pid)
        # The attack: 12 connections each announce two 64 MiB blobs (3 GiB
        # in all, twelve times the cap) and send one 1 MiB chunk of each.
        rng = os.urandom
        announced = 0
        for i in range(12):
            d = RawDealer(farm.port)
            attackers.append(d)
            blobs = [{"digest": rng(32).hex(), "size": blob} for _ in range(2)]
            d.send({"v": 2, "cmd": "FIND", "frames": 0, "req_id": 1, "blobs": blobs})
            h, _ = d.recv_until(lambda h: h.get("cmd") == "MISSING")
            assert h["credit"] >= 2, h
            for b in blobs:
                d.send({"v": 2, "cmd": "CHUNK", "frames": 1, "digest": b["digest"],
                        "blob_size": blob, "offset": 0}, b"\0" * MiB)
                announced += blob
        for d in attackers:
            d.send({"v": 2, "cmd": "HEARTBEAT", "frames": 0})
        # Refusals name the limit that was hit; some uploads were refused.
        busy = []
        for d in attackers:
            try:
                h, _ = d.recv_until(lambda h: h.get("cmd") == "ERROR", timeout=1.0)
                busy.append(h)
            except TimeoutError:
                pass
        assert busy, "no upload was refused\n" + farm.logs()
        assert all(h["code"] == 18 for h in busy), busy    # EBUSY: try again
        # (an upload that stalled may have made room for a later one: "dropped")
        assert any(f"--store-max-bytes {cap}" in h["message"]
                   or f"--max-uploads {max_uploads}" in h["message"] for h in busy), busy
        staged = _allocated(os.path.join(farm.state, "tmp"))
        threads = _threads(pid)
        st = farm.status()
        assert announced == 24 * blob
        assert staged <= cap, f"{staged} bytes preallocated against a cap of {cap}"
        assert st["transfer"]["uploads_in_progress"] <= max_uploads, st["transfer"]
        assert st["transfer"]["upload_reserved_bytes"] <= cap, st["transfer"]
        assert threads - threads_before <= 2 * max_uploads, (threads_before, threads)
        print(f"announced {announced} bytes, preallocated {staged}, broker threads "
              f"{threads_before} -> {threads}")
        # An honest client, while the attackers stay connected (they
        # heartbeat, so the broker does not forget them): its upload waits
        # ("busy"), takes a stalled upload's place, and builds.
        model = big_model(tmp_path / "big.onnx", 3, seed=14)
        proc = farm.spawn(farm.compile_argv(model, tmp_path / "honest.kar"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            for d in attackers:
                d.send({"v": 2, "cmd": "HEARTBEAT", "frames": 0})
            time.sleep(0.5)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err + farm.logs()
        assert _allocated(os.path.join(farm.state, "tmp")) <= cap
        assert "dropped: no chunk for" in farm.log(), farm.log()
        run(["kiln", "verify", tmp_path / "honest.kar", "--keyring", farm.keyring], check=True)
    finally:
        for d in attackers:
            d.close()
        farm.stop()


# --- finding 4: certificates removed from the trust directory -----------------

@pytest.fixture
def curve_farm(tmp_path):
    """A CurveZMQ farm: clients alice and ops, workers w1 and w2, all
    trusted; the test removes certificates from `trust`."""
    certs, trust = curve_certs(tmp_path, [("alice", "client"), ("ops", "client"),
                                          ("w1", "worker"), ("w2", "worker")])
    farm = Farm(tmp_path / "farm", curve=(certs["broker"], trust))
    farm.start_broker()

    def env(who):
        return dict(os.environ, KILN_CERT=certs[who], KILN_BROKER_CERT=certs["broker"])

    def status():
        proc = subprocess.run([kiln_bin("kiln"), "status", "--broker", farm.endpoint, "--json"],
                              capture_output=True, text=True, timeout=30, env=env("ops"))
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def wait(pred, what, timeout=20):
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = status()
            if pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"{what} not reached within {timeout}s; {st}\n{farm.logs()}")

    def worker(name, *args):
        farm.start_worker(name, "--cert", certs[name], "--broker-cert", certs["broker"],
                          *args)

    def revoke(who):
        os.remove(os.path.join(trust, who + ".cert"))

    def compile_as(who, seed):
        """A compile with the sleepy toolchain, in the background."""
        model = tiny_model(tmp_path / f"m{seed}.onnx", seed)
        proc = farm.spawn(farm.compile_argv(model, tmp_path / "a.kar", "--toolchain",
                                            "sleepy@1"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env(who))
        return model, proc

    try:
        yield farm, env, status, wait, worker, revoke, compile_as
    finally:
        farm.stop()


def test_a_client_whose_certificate_is_removed_is_cut_off_mid_request(curve_farm, tmp_path):
    farm, env, status, wait, worker, revoke, compile_as = curve_farm
    worker("w1", "--toolchain", sleepy(40))
    wait(lambda s: len(s["workers"]) == 1, "w1 registered")
    model, proc = compile_as("alice", 41)
    wait(lambda s: s["queue"]["running"] == 1, "alice's job running")
    t0 = time.monotonic()
    revoke("alice")
    out, err = proc.communicate(timeout=60)
    # Answered long before the build could end (it sleeps 40 s), refused, no
    # artifact.
    assert proc.returncode != 0, out + farm.logs()
    assert "no longer trusted" in err, err
    assert time.monotonic() - t0 < 30, "the revoked client was served until its job ended"
    assert not (tmp_path / "a.kar").exists()
    assert "client alice revoked" in farm.log()
    # Its next request, on a new connection, is refused too.
    again = subprocess.run(farm.compile_argv(model, tmp_path / "b.kar", "--wait", "10"),
                           capture_output=True, text=True, timeout=60, env=env("alice"))
    assert again.returncode != 0 and not (tmp_path / "b.kar").exists()
    assert status()["workers"][0]["name"] == "w1"          # the others are served


def test_a_worker_whose_certificate_is_removed_gets_no_more_work(curve_farm, tmp_path):
    farm, env, status, wait, worker, revoke, compile_as = curve_farm
    worker("w1", "--toolchain", sleepy(15))
    wait(lambda s: len(s["workers"]) == 1, "w1 registered")
    _, proc = compile_as("alice", 42)
    wait(lambda s: s["workers"] and s["workers"][0]["busy"] == 1, "the job running on w1")
    revoke("w1")
    # Within a few heartbeats (before its 15 s build could end) w1 is gone
    # from the farm, its job queued again.
    st = wait(lambda s: not s["workers"], "w1 dropped", timeout=12)
    assert st["queue"]["queued"] == 1 and st["jobs"]["requeued"] == 1, st
    farm.wait_for_log("no longer trusted", name="w1", timeout=10)
    worker("w2", "--toolchain", sleepy(0.2))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err + farm.logs()
    assert json.loads(out)["worker"] == "w2"
    assert provenance(tmp_path / "a.kar")["builder"] == "w2"
    # What w1 sends when its build ends is refused, never taken.
    farm.wait_for_log("w1 DONE refused", timeout=45)
    st = status()
    assert [w["name"] for w in st["workers"]] == ["w2"], st["workers"]
    assert st["jobs"]["done"] == 1 and st["jobs"]["failed"] == 0, st["jobs"]
