"""Identity on the farm (issue 4): with key directories configured, clients
and workers authenticate with CurveZMQ certificates (`kiln cert`), the
certificate's name is what fair share, `kiln status` and the artifact's
provenance show, and a client or worker without a trusted certificate is
refused -- with a message that says so.  Without keys the broker listens
on loopback only (tested in test_farm.py)."""

import json
import os
import subprocess
import tarfile
import time

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, curve_certs, tiny_model

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")


@pytest.fixture
def pki(tmp_path):
    """Certificates: the broker's, alice (client) and w1 (worker) trusted;
    mallory (client) and rogue (worker) not; eve (client) trusted but
    trying to be a worker."""
    certs, trust = curve_certs(tmp_path, [("alice", "client"), ("w1", "worker"),
                                          ("eve", "client")],
                               [("mallory", "client"), ("rogue", "worker")])
    # The secret parts never go to the broker; kiln cert keeps them private.
    assert os.stat(certs["alice"] + "_secret").st_mode & 0o077 == 0
    assert sorted(os.listdir(trust)) == ["alice.cert", "eve.cert", "w1.cert"]
    return certs, trust


def test_authenticated_farm_names_its_clients_and_workers_and_refuses_strangers(pki, tmp_path):
    certs, trust = pki
    farm = Farm(tmp_path / "farm", curve=(certs["broker"], trust))
    # With keys the broker may listen beyond loopback; the test still
    # connects through 127.0.0.1.
    farm.endpoint_listen = f"tcp://0.0.0.0:{farm.port}"
    try:
        farm.start_broker()
        farm.start_worker("w1", "--cert", certs["w1"], "--broker-cert", certs["broker"])
        # A worker without a certificate, one with an untrusted one, and a
        # trusted client's certificate used by a worker: none registers.
        farm.start_worker("nocert")
        farm.start_worker("rogue", "--cert", certs["rogue"], "--broker-cert", certs["broker"])
        farm.start_worker("eve-worker", "--cert", certs["eve"], "--broker-cert", certs["broker"])
        alice = {"KILN_CERT": certs["alice"], "KILN_BROKER_CERT": certs["broker"]}
        env = dict(os.environ, **alice)

        def status():
            proc = subprocess.run([kiln_bin("kiln"), "status", "--broker", farm.endpoint, "--json"],
                                  capture_output=True, text=True, timeout=30, env=env)
            assert proc.returncode == 0, proc.stderr
            return json.loads(proc.stdout)

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not status()["workers"]:
            time.sleep(0.1)
        time.sleep(2)      # give the refused workers time to (fail to) register
        st = status()
        assert st["authenticated"] is True
        assert [w["name"] for w in st["workers"]] == ["w1"], st["workers"]
        assert st["workers"][0]["authenticated"] is True
        farm.wait_for_log("not a command the broker takes from a client")   # eve as a worker
        farm.wait_for_log("refused a connection: its CurveZMQ certificate is not trusted")
        farm.wait_for_log("refused a connection: HANDSHAKE_FAILED")
        farm.wait_for_log("refused this worker's certificate", name="rogue")
        farm.wait_for_log("may require CurveZMQ", name="nocert")

        model = tiny_model(tmp_path / "m.onnx", 30)
        ok = subprocess.run(farm.compile_argv(model, tmp_path / "a.kar", "--client-name",
                                              "not-me"),
                            capture_output=True, text=True, timeout=120, env=env)
        assert ok.returncode == 0, ok.stderr + farm.logs()
        assert json.loads(ok.stdout)["worker"] == "w1"
        with tarfile.open(tmp_path / "a.kar") as tf:
            prov = json.load(tf.extractfile("provenance.json"))
        # The certificate names the client, not what it claims to be.
        assert prov["client"] == "alice" and prov["builder"] == "w1"
        assert prov["authenticated"] is True
        assert [c["client"] for c in status()["queue"]["clients"]] == ["alice"]

        # A client without a certificate, and one with an untrusted one.
        t0 = time.monotonic()
        bare = farm.compile(model, tmp_path / "b.kar", "--wait", "20")
        assert bare.returncode != 0
        assert "may require CurveZMQ" in bare.stderr, bare.stderr
        stranger = subprocess.run(
            farm.compile_argv(model, tmp_path / "c.kar", "--wait", "20", "--cert",
                              certs["mallory"], "--broker-cert", certs["broker"]),
            capture_output=True, text=True, timeout=60)
        assert stranger.returncode != 0
        assert "refused our CurveZMQ certificate" in stranger.stderr, stranger.stderr
        assert time.monotonic() - t0 < 20, "refusals must be reported, not waited out"
        assert not (tmp_path / "b.kar").exists() and not (tmp_path / "c.kar").exists()
        assert status()["jobs"]["submitted"] == 1
    finally:
        farm.stop()
