"""The ansible roles on real hosts (issue 13): a broker, two workers and two
inference hosts, each a network namespace with its own root filesystem
(overlayfs), PID 1, host name and sshd (tests/ansible/netns_hosts.py),
driven by ansible-playbook over SSH from this process, the controller.

The tests run in order and share the fleet (one module-scoped fixture);
each says what it needs from the ones before it and skips when an earlier
one failed.  Teardown kills every process and removes every namespace,
link and mount, also when a test fails.  Needs root; `make ansible-test`.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

from fleet import SRC, Fleet, mlp_expected, mlp_onnx, tamper, wide_mlp_onnx
from netns_hosts import Lab, can_run

OK, WHY = can_run()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)

HOSTS = [("broker", ["kiln_broker"]), ("worker1", ["kiln_workers"]), ("worker2", ["kiln_workers"]),
         ("infer1", ["kiln_inference"]), ("infer2", ["kiln_inference"])]
INFERENCE = ("infer1", "infer2")
X = (np.arange(8, dtype=np.float32).reshape(1, 8) - 3.5) / 4


@pytest.fixture(scope="module")
def fleet():
    dist = os.environ.get("KILN_DIST", os.path.join(SRC, "build", "dist", "kiln-linux-x86_64.tar.gz"))
    if not os.path.exists(dist):
        pytest.fail(f"{dist} does not exist: run `make dist` (or `make ansible-test`)")
    # A directory of its own, not pytest's: the hosts' roots are mounted
    # in it, and pytest prunes old numbered directories of other runs.
    work = tempfile.mkdtemp(prefix="kiln-ansible-test-", dir="/var/tmp")
    lab = Lab(os.path.join(work, "lab"), HOSTS)
    t0 = time.monotonic()
    f = None
    try:
        lab.start()
        f = Fleet(lab, work)
        f.passed = set()
        yield f
    finally:
        lab.stop()
        if f is not None:
            print("\nplaybook runs: " + ", ".join(f"{r.name} {r.seconds:.0f} s" for r in f.runs))
        # Keep the logs (playbooks, the hosts' services), drop the rest.
        for name in os.listdir(work):
            if name not in ("logs", "lab"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
        for name in os.listdir(os.path.join(work, "lab")):
            if name != "host-logs":
                path = os.path.join(work, "lab", name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        print(f"\nfleet: {time.monotonic() - t0:.0f} s in all; logs in {work}/logs and {work}/lab/host-logs")


def needs(fleet, *steps):
    missing = [s for s in steps if s not in fleet.passed]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def assert_ok(run):
    assert run.rc == 0, f"{run.name} exited {run.rc}:\n{run.tail()}"
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in run.recap.values()), run.recap


def serving(fleet, host):
    s = fleet.served(host)
    return s.get("seq"), s.get("digest"), s.get("state")


# --- the farm ----------------------------------------------------------------

def test_site_brings_up_a_farm_and_inference_hosts_over_ssh(fleet):
    run = fleet.playbook("site.yml")
    assert_ok(run)
    assert set(run.recap) == {h for h, _ in HOSTS}
    # The farm answers over the network, with both workers, authenticated.
    st = fleet.status()
    assert st["authenticated"] is True
    assert sorted(w["name"] for w in st["workers"]) == ["worker1", "worker2"]
    assert all(w["authenticated"] for w in st["workers"])
    for host in INFERENCE:
        assert fleet.ready(host), f"{host} is not ready"
    fleet.passed.add("site")


def test_hosts_are_separate_and_hold_only_their_own_secrets(fleet):
    needs(fleet, "site")
    lab = fleet.lab
    # The farm key was made on the broker and only its public part left it.
    assert lab.ssh("broker", "test -s /etc/kiln/farm/kiln.key").returncode == 0
    assert os.path.exists(os.path.join(fleet.pki, "farm.pub"))
    assert not os.path.exists(os.path.join(fleet.pki, "kiln.key"))
    for host in INFERENCE:
        found = lab.ssh(host, "grep -rl 'PRIVATE KEY' /etc/kiln /var/lib/kiln 2>/dev/null;"
                              " find /etc/kiln /var/lib/kiln -name '*.key' -o -name '*_secret'",
                        check=True).stdout.strip()
        assert found == "", f"{host} holds private keys: {found}"
        # Each keyring holds its one key: farm key for artifacts, release key for records.
        keyring = lab.ssh(host, "cat /etc/kiln/keyring/*.pub", check=True).stdout
        release_keyring = lab.ssh(host, "cat /etc/kiln/release-keyring/*.pub", check=True).stdout
        assert keyring.strip() == open(os.path.join(fleet.pki, "farm.pub")).read().strip()
        assert release_keyring.strip() == open(fleet.release_pub).read().strip()
    # A worker's CurveZMQ secret is on that worker only.
    assert lab.ssh("worker1", "test -s /etc/kiln/curve/worker1.cert_secret").returncode == 0
    assert lab.ssh("worker2", "test -e /etc/kiln/curve/worker1.cert_secret").returncode != 0
    # Own file systems, process tables and names.
    assert lab.ssh("infer1", "test -e /etc/kiln/curve").returncode != 0
    assert lab.ssh("infer1", "test -e /usr/local/sbin/kiln-farm-status").returncode != 0
    assert lab.ssh("broker", "test -x /usr/local/sbin/kiln-farm-status").returncode == 0
    assert not os.path.exists("/etc/kiln/services/kiln-broker.json")
    for host, _ in HOSTS:
        out = lab.ssh(host, "hostname; cat /proc/1/cmdline | tr '\\0' ' '", check=True).stdout.split("\n")
        assert out[0] == host and "kiln-test-init" in out[1], out
    fleet.passed.add("separate")


def test_supervised_services_come_back_after_kill_9(fleet):
    needs(fleet, "site")
    lab = fleet.lab
    def status():
        # Exit 3 while the service is down (between a death and its restart).
        return json.loads(lab.ssh("broker", "/usr/local/sbin/kiln-supervise status kiln-broker").stdout)

    before = status()
    assert before["running"] and before["child_pid"] > 0
    lab.ssh("broker", f"kill -9 {before['child_pid']}", check=True)
    deadline = time.monotonic() + 30
    after = status()
    while time.monotonic() < deadline and not (after["running"] and after["child_pid"] != before["child_pid"]):
        time.sleep(0.2)
        after = status()
    assert after["running"] and after["child_pid"] != before["child_pid"], after
    assert after["restarts"] == before["restarts"] + 1
    # The workers reconnect to the restarted broker by themselves.
    deadline = time.monotonic() + 30
    names = []
    while time.monotonic() < deadline:
        names = sorted(w["name"] for w in fleet.status()["workers"])
        if names == ["worker1", "worker2"]:
            break
        time.sleep(0.5)
    assert names == ["worker1", "worker2"]
    fleet.passed.add("supervised")


def test_models_compile_through_the_farm_from_the_controller(fleet):
    needs(fleet, "site")
    m = fleet.models
    fleet.kars = {}
    for seed in (1, 2, 3):
        onnx = mlp_onnx(os.path.join(m, f"mlp{seed}.onnx"), seed)
        res = fleet.compile(onnx, os.path.join(m, f"mlp{seed}.kar"))
        assert res["worker"] in ("worker1", "worker2"), res
        fleet.kars[seed] = (res["output"], res["artifact"])
    # Built for another target by worker2's external toolchain.
    res = fleet.compile(os.path.join(m, "mlp3.onnx"), os.path.join(m, "mlp3-riscv.kar"),
                        "--toolchain", "passthru@1", "--target", "riscv64-test")
    assert res["worker"] == "worker2", res
    fleet.kars["riscv"] = (res["output"], res["artifact"])
    assert len({d for _, d in fleet.kars.values()}) == 4
    fleet.passed.add("compiled")


# --- releases ------------------------------------------------------------------

def test_release_1_rolls_out_canary_first_and_serves_the_right_numbers(fleet):
    needs(fleet, "compiled")
    kar, digest = fleet.kars[1]
    rel = fleet.release(kar, 1, os.path.join(fleet.models, "release-1.json"))
    os.remove(kar)      # the deploy fetches it from the farm by its content hash
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel)
    assert_ok(run)
    assert run.batches() == [["infer1"], ["infer2"]], run.batches()
    for host in INFERENCE:
        assert serving(fleet, host) == (1, digest, "READY")
        y = fleet.infer(host, X)
        np.testing.assert_allclose(y, mlp_expected(1, X), rtol=1e-4, atol=1e-4)
    fleet.passed.add("release1")


def test_release_2_with_new_weights_replaces_release_1(fleet):
    needs(fleet, "release1")
    kar, digest = fleet.kars[2]
    rel = fleet.release(kar, 2, os.path.join(fleet.models, "release-2.json"))
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=kar)
    assert_ok(run)
    for host in INFERENCE:
        assert serving(fleet, host) == (2, digest, "READY")
        y = fleet.infer(host, X)
        np.testing.assert_allclose(y, mlp_expected(2, X), rtol=1e-4, atol=1e-4)
        assert not np.allclose(y, mlp_expected(1, X))
        # Both artifacts kept by content hash; the host's state says which is which.
        state = json.loads(fleet.lab.ssh(host, "cat /var/lib/kiln/deploy/mlp/state.json",
                                         check=True).stdout)
        assert (state["current"]["seq"], state["previous"]["seq"]) == (2, 1)
        kars = fleet.lab.ssh(host, "ls /var/lib/kiln/repo/mlp", check=True).stdout.split()
        assert sorted(kars) == sorted([fleet.kars[1][1] + ".kar", digest + ".kar", "release.json"])
    fleet.passed.add("release2")


def bad_release(fleet, run, why):
    """A bad release failed on the canary: infer1 failed, infer2 was never
    touched, and both still serve release 2 with its numbers."""
    assert run.rc != 0, f"{why}: the rollout did not fail\n{run.tail()}"
    assert run.recap["infer1"]["failed"] == 1, run.recap
    assert "infer2" not in run.recap, f"{why}: the rollout went past the canary: {run.recap}"
    for host in INFERENCE:
        assert serving(fleet, host) == (2, fleet.kars[2][1], "READY"), f"{why}: {host}"
        np.testing.assert_allclose(fleet.infer(host, X), mlp_expected(2, X), rtol=1e-4, atol=1e-4)


def snapshot(fleet, host):
    return fleet.lab.ssh(host, "cd /var/lib/kiln && ls -l --time-style=+%s repo/mlp deploy/mlp "
                               "serve-state && cat deploy/mlp/state.json repo/mlp/release.json "
                               "serve-state/mlp.json", check=True).stdout


def test_a_tampered_artifact_fails_on_the_canary_before_anything_changes(fleet):
    needs(fleet, "release2")
    kar, digest = fleet.kars[3]
    rel = fleet.release(kar, 3, os.path.join(fleet.models, "release-3.json"))
    bad = tamper(kar, os.path.join(fleet.models, "mlp3-tampered.kar"))
    before = {h: snapshot(fleet, h) for h in INFERENCE}
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=bad)
    bad_release(fleet, run, "tampered artifact")
    assert "sha256 mismatch" in run.output
    assert snapshot(fleet, "infer2") == before["infer2"]
    fleet.passed.add("tampered")


def test_a_lower_seq_fails_on_the_canary_before_anything_changes(fleet):
    needs(fleet, "release2")
    rel = os.path.join(fleet.models, "release-1.json")
    before = {h: snapshot(fleet, h) for h in INFERENCE}
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel)
    bad_release(fleet, run, "lower seq")
    assert "refusing a rollback" in run.output
    assert snapshot(fleet, "infer2") == before["infer2"]
    fleet.passed.add("lower")


def test_an_artifact_signed_by_an_unknown_key_fails_on_the_canary(fleet):
    needs(fleet, "release2")
    # Built and signed by someone's own key, not the farm's; released by
    # the (real) release key.
    other = os.path.join(fleet.keys, "stranger")
    fleet.kiln("keygen", "--out", other)
    kar = os.path.join(fleet.models, "mlp6-stranger.kar")
    fleet.kiln("compile", mlp_onnx(os.path.join(fleet.models, "mlp6.onnx"), 6), "-o", kar, "--local",
               "--key", os.path.join(other, "kiln.key"), timeout=180)
    rel = fleet.release(kar, 5, os.path.join(fleet.models, "release-5-stranger.json"))
    before = snapshot(fleet, "infer2")
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=kar)
    bad_release(fleet, run, "unknown signing key")
    assert "not in keyring" in run.output or "keyring" in run.output
    assert snapshot(fleet, "infer2") == before


def test_an_expired_release_fails_on_the_canary(fleet):
    needs(fleet, "release2")
    kar, _ = fleet.kars[3]
    rel = fleet.release(kar, 6, os.path.join(fleet.models, "release-6-expired.json"), expires="1s")
    time.sleep(1.5)
    before = snapshot(fleet, "infer2")
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=kar)
    bad_release(fleet, run, "expired release")
    assert "expired at" in run.output
    assert snapshot(fleet, "infer2") == before


def test_a_release_kiln_serve_refuses_is_rolled_back_on_the_canary(fleet):
    needs(fleet, "release2")
    kar, digest = fleet.kars["riscv"]
    rel = fleet.release(kar, 4, os.path.join(fleet.models, "release-4-riscv.json"))
    before = snapshot(fleet, "infer2")
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=kar)
    bad_release(fleet, run, "another target")
    # The record was put in place and kiln-serve refused it: the rescue
    # put release 2's record back.
    assert run.recap["infer1"]["rescued"] == 1, run.recap
    assert "restored release seq 2" in run.output
    refusal = fleet.served("infer1")["last_refusal"]
    assert refusal["reason"] == "target" and refusal["seq"] == 4, refusal
    release_json = fleet.lab.ssh("infer1", "cat /var/lib/kiln/repo/mlp/release.json", check=True).stdout
    assert release_json == open(os.path.join(fleet.models, "release-2.json")).read()
    assert snapshot(fleet, "infer2") == before
    fleet.passed.add("refused")


def test_a_release_that_cannot_come_up_on_the_canary_is_rolled_back(fleet):
    needs(fleet, "release2")
    # Verified and signed like any release, but its arena (4 GiB) does not
    # fit kiln-serve's 2 GiB address-space limit (kiln_runtime_memory_limit_mb):
    # the runtime cannot bring it up, and the rollout stops on the canary.
    kar = os.path.join(fleet.models, "wide.kar")
    res = fleet.compile(wide_mlp_onnx(os.path.join(fleet.models, "wide.onnx"), 2), kar)
    rel = fleet.release(res["output"], 7, os.path.join(fleet.models, "release-7-wide.json"))
    before = snapshot(fleet, "infer2")
    run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=rel, kiln_artifact_file=kar)
    bad_release(fleet, run, "does not fit the host")
    assert run.recap["infer1"]["rescued"] == 1, run.recap
    assert "restored release seq 2" in run.output
    refusal = fleet.served("infer1")["last_refusal"]
    assert refusal["reason"] == "load" and refusal["seq"] == 7, refusal
    assert "out of memory" in refusal.get("message", json.dumps(refusal)), refusal
    assert snapshot(fleet, "infer2") == before


# --- idempotence -----------------------------------------------------------------

def test_a_second_run_changes_nothing(fleet):
    needs(fleet, "site")
    run = fleet.playbook("site.yml")
    assert_ok(run)
    assert all(r["changed"] == 0 for r in run.recap.values()), \
        f"site.yml changed something on its second run: {run.recap}\n{run.tail(200)}"
    # --check --diff on a farm that is as described: runs through, would change nothing.
    run = fleet.playbook("site.yml", flags=("--check", "--diff"))
    assert_ok(run)
    assert all(r["changed"] == 0 for r in run.recap.values()), run.recap
    if "release2" in fleet.passed:
        run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=os.path.join(fleet.models, "release-2.json"),
                             kiln_artifact_file=fleet.kars[2][0])
        assert_ok(run)
        assert all(r["changed"] == 0 for r in run.recap.values()), run.recap
    fleet.passed.add("idempotent")


# --- rollback (last: it leaves the fleet on release 1) ---------------------------------

def test_rollback_returns_every_host_to_the_previous_release(fleet):
    needs(fleet, "release2")
    run = fleet.playbook("rollback.yml", kiln_artifact_model="mlp")
    assert_ok(run)
    for host in INFERENCE:
        assert serving(fleet, host) == (1, fleet.kars[1][1], "READY")
        np.testing.assert_allclose(fleet.infer(host, X), mlp_expected(1, X), rtol=1e-4, atol=1e-4)
    status = fleet.playbook("fleet-status.yml", kiln_artifact_model="mlp")
    assert_ok(status)
    assert all(r["changed"] == 0 for r in status.recap.values()), status.recap
    assert "model 'mlp' serves seq 1" in status.output
    fleet.passed.add("rollback")


def test_an_unreachable_canary_stops_the_rollout(fleet):
    needs(fleet, "rollback")
    before = serving(fleet, "infer2")
    ns = fleet.lab.hosts["infer1"].netns
    fleet.lab.close_ssh_masters()     # a new connection, which must time out
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True, timeout=30)
    try:
        run = fleet.playbook("deploy-artifact.yml", kiln_artifact_release=os.path.join(fleet.models, "release-2.json"),
                             kiln_artifact_file=fleet.kars[2][0])
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True, timeout=30)
    assert run.rc != 0
    assert run.recap["infer1"]["unreachable"] == 1, run.recap
    assert "infer2" not in run.recap, run.recap
    assert serving(fleet, "infer2") == before
