"""`kiln get`, `kiln pin` and `kiln unpin` against a real broker and
worker on loopback (issue 12, item 1): an artifact built on the farm is
fetched by its content hash, byte for byte, in chunks under the client's
credit; a digest the farm does not hold fails at once with a clear
message; malformed digests are usage errors; hostile GETs leave the
broker serving; a pinned artifact survives eviction that takes unpinned
ones, and uploads that do not fit beside the pins are refused until
something is unpinned.  Every process is stopped by the fixtures, every
wait is bounded."""

import json
import os
import subprocess
import time

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, big_model, curve_farm, tiny_model
from raw_zmtp import RawDealer

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

MiB = 1 << 20
ABSENT = "0123456789abcdef" * 4          # a well-formed digest nothing has


@pytest.fixture
def farm(tmp_path):
    f = Farm(tmp_path / "farm")
    f.start_broker()
    try:
        f.start_worker("w1")
        f.wait_for_workers(1)
        yield f
    finally:
        f.stop()


def compile_json(farm, model, out):
    proc = farm.compile(model, out)
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    return json.loads(proc.stdout)


def kiln(*args, timeout=60):
    return subprocess.run([kiln_bin("kiln"), *[str(a) for a in args]], capture_output=True,
                          text=True, timeout=timeout)


def get(farm, digest, out, *extra, timeout=60):
    return kiln("get", digest, "-o", out, "--broker", farm.endpoint, *extra, timeout=timeout)


def leftovers(directory):
    """Temporary files `kiln get` left beside its target."""
    return [n for n in os.listdir(directory) if ".kiln-get-" in n]


def test_get_fetches_what_compile_wrote_byte_for_byte_and_verify_accepts_it(farm, tmp_path):
    built = compile_json(farm, tiny_model(tmp_path / "m.onnx", 1), tmp_path / "built.kar")
    digest = built["artifact"]
    proc = get(farm, digest, tmp_path / "got.kar", "--json")
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    out = json.loads(proc.stdout)
    data = (tmp_path / "built.kar").read_bytes()
    assert (tmp_path / "got.kar").read_bytes() == data
    assert out["artifact"] == digest and out["bytes"] == len(data)
    assert out["output"] == str(tmp_path / "got.kar")
    verify = kiln("verify", tmp_path / "got.kar", "--keyring", farm.keyring)
    assert verify.returncode == 0, verify.stderr
    # The digest in capitals names the same artifact; --keyring checks the
    # signature before the file appears.
    again = get(farm, digest.upper(), tmp_path / "again.kar", "--keyring", farm.keyring)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.kar").read_bytes() == data
    assert leftovers(tmp_path) == []
    # A keyring without the farm's key: refused, nothing written.
    other = tmp_path / "other-keys"
    assert kiln("keygen", "--out", other).returncode == 0
    os.remove(other / "kiln.key")
    refused = get(farm, digest, tmp_path / "untrusted.kar", "--keyring", other)
    assert refused.returncode == 5
    assert not (tmp_path / "untrusted.kar").exists() and leftovers(tmp_path) == []
    st = farm.status()
    assert st["transfer"]["downloaded_artifacts"] >= 2
    assert st["transfer"]["downloads_in_progress"] == 0


def test_get_of_an_artifact_the_farm_does_not_hold_fails_at_once_with_a_clear_message(
        farm, tmp_path):
    t0 = time.monotonic()
    proc = get(farm, ABSENT, tmp_path / "x.kar")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert f"the farm at {farm.endpoint} holds no artifact {ABSENT}" in proc.stderr, proc.stderr
    # The message is the farm's answer; a wait that ran out would say so.
    assert elapsed < 30, f"took {elapsed:.1f} s: an answer, not a timeout"
    assert not (tmp_path / "x.kar").exists() and leftovers(tmp_path) == []
    # Pinning it is refused the same way.
    pin = kiln("pin", ABSENT, "--broker", farm.endpoint)
    assert pin.returncode == 1 and "holds no artifact" in pin.stderr, pin.stderr


@pytest.mark.parametrize("digest", ["", "abc", ABSENT[:-1], ABSENT + "0", "g" * 64,
                                    ABSENT[:32] + " " + ABSENT[33:], "../" + ABSENT[3:]])
def test_malformed_digests_are_usage_errors(farm, tmp_path, digest):
    for argv in (["get", digest, "-o", tmp_path / "x.kar"], ["pin", digest], ["unpin", digest]):
        proc = kiln(*argv, "--broker", farm.endpoint)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "not an artifact's content hash" in proc.stderr
    assert not (tmp_path / "x.kar").exists()


def test_get_without_an_output_or_a_farm_is_a_usage_error(tmp_path):
    assert kiln("get", ABSENT, "--broker", "tcp://127.0.0.1:1").returncode == 2
    env = {k: v for k, v in os.environ.items() if k != "KILN_BROKER"}
    proc = subprocess.run([kiln_bin("kiln"), "get", ABSENT, "-o", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "which farm" in proc.stderr


def test_an_artifact_larger_than_one_chunk_arrives_intact_in_several_chunks(farm, tmp_path):
    built = compile_json(farm, big_model(tmp_path / "big.onnx", 3, seed=5),
                         tmp_path / "built.kar")
    size = (tmp_path / "built.kar").stat().st_size
    assert size > 3 * MiB
    proc = get(farm, built["artifact"], tmp_path / "got.kar", "--json")
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    assert (tmp_path / "got.kar").read_bytes() == (tmp_path / "built.kar").read_bytes()
    assert json.loads(proc.stdout)["bytes"] == size
    assert kiln("verify", tmp_path / "got.kar", "--keyring", farm.keyring).returncode == 0
    st = farm.status()
    assert st["transfer"]["downloaded_bytes"] >= size


def test_the_broker_sends_no_more_chunks_than_the_client_granted(farm, tmp_path):
    """A raw client grants 2 chunks of a 4-chunk artifact: it gets exactly
    2, in order, until it gives credit back; then the rest, the last one
    carrying the SHA-256 of the whole file."""
    built = compile_json(farm, big_model(tmp_path / "big.onnx", 3, seed=6),
                         tmp_path / "built.kar")
    data = (tmp_path / "built.kar").read_bytes()
    chunks = (len(data) + MiB - 1) // MiB
    assert chunks >= 4
    with RawDealer(farm.port) as d:
        d.send({"v": 2, "cmd": "GET", "frames": 0, "req_id": 7, "artifact": built["artifact"],
                "credit": 2})
        got = []
        for _ in range(2):
            h, payload = d.recv()
            assert h["cmd"] == "PART" and h["req_id"] == 7, h
            got.append((h, payload))
        assert [h["offset"] for h, _ in got] == [0, MiB]
        with pytest.raises(TimeoutError):
            d.recv(timeout=1.5)            # nothing more without credit
        d.send({"v": 2, "cmd": "CREDIT", "frames": 0, "req_id": 7, "credit": chunks})
        while len(got) < chunks:
            h, payload = d.recv()
            assert h["cmd"] == "PART", h
            got.append((h, payload))
    assert [h["offset"] for h, _ in got] == [i * MiB for i in range(chunks)]
    assert b"".join(p[0] for _, p in got) == data
    import hashlib
    assert got[-1][0]["digest"] == hashlib.sha256(data).hexdigest()
    assert all("digest" not in h for h, _ in got[:-1])


def test_hostile_get_messages_do_not_take_the_broker_down(farm, tmp_path):
    built = compile_json(farm, big_model(tmp_path / "big.onnx", 2, seed=7),
                         tmp_path / "built.kar")
    digest = built["artifact"]
    with RawDealer(farm.port) as d:
        def error_for(header, *payload):
            d.send(header, *payload)
            h, _ = d.recv_until(lambda h: h.get("cmd") == "ERROR")
            return h

        # garbage, not msgpack
        d.send_frames([b"\x00\xffGET me everything\xc1"])
        h, _ = d.recv()
        assert h["cmd"] == "ERROR" and h["code"] == 4, h           # EFORMAT
        # not a digest, no credit, too much credit, missing fields
        h = error_for({"v": 2, "cmd": "GET", "frames": 0, "req_id": 1, "artifact": "zz" * 32,
                       "credit": 4})
        assert h["code"] == 10 and h["req_id"] == 1, h              # EPROTO
        h = error_for({"v": 2, "cmd": "GET", "frames": 0, "req_id": 2, "artifact": digest,
                       "credit": 0})
        assert h["code"] == 10 and "no credit" in h["message"], h
        h = error_for({"v": 2, "cmd": "GET", "frames": 0, "req_id": 3, "artifact": digest,
                       "credit": 1 << 40})
        assert h["code"] == 5, h                                   # ELIMIT
        h = error_for({"v": 2, "cmd": "GET", "frames": 0, "req_id": 4})
        assert h["code"] == 10 and "missing field" in h["message"], h
        # a GET with payload frames it should not have
        h = error_for({"v": 2, "cmd": "GET", "frames": 1, "req_id": 5, "artifact": digest,
                       "credit": 1}, b"x" * 100)
        assert h["code"] == 10, h
        # what only the broker sends, sent to it
        h = error_for({"v": 2, "cmd": "PART", "frames": 0, "req_id": 6, "artifact": digest,
                       "artifact_size": 0, "offset": 0})
        assert "not a command the broker takes" in h["message"], h
        # credit for downloads that never were, a cancel of one: ignored
        d.send({"v": 2, "cmd": "CREDIT", "frames": 0, "req_id": 99, "credit": 200})
        d.send({"v": 2, "cmd": "CANCEL", "frames": 0, "req_id": 98})
        # more downloads at once than a client may have: the rest refused
        for req in range(10, 19):
            d.send({"v": 2, "cmd": "GET", "frames": 0, "req_id": req, "artifact": digest,
                    "credit": 1})
        h, _ = d.recv_until(lambda h: h.get("cmd") == "ERROR")
        assert h["code"] == 5 and "in progress" in h["message"], h
        for req in range(10, 19):
            d.send({"v": 2, "cmd": "CANCEL", "frames": 0, "req_id": req})
        # the same GET again and again (starts over), then out of order credit
        for _ in range(3):
            d.send({"v": 2, "cmd": "GET", "frames": 0, "req_id": 30, "artifact": digest,
                    "credit": 1})
        d.send({"v": 2, "cmd": "CREDIT", "frames": 0, "req_id": 30, "credit": 256})
        h, _ = d.recv_until(lambda h: h.get("cmd") == "PART" and h.get("req_id") == 30)
        assert h["offset"] == 0
    # A client that asked for everything and vanished, and one that lies
    # about the size of a frame: each dropped, the broker unharmed.
    with RawDealer(farm.port) as d:
        d.send({"v": 2, "cmd": "GET", "frames": 0, "req_id": 1, "artifact": digest,
                "credit": 256})
    with RawDealer(farm.port) as d:
        d.send_frame_header(1 << 40)
        with pytest.raises((ConnectionError, OSError, TimeoutError)):
            d.recv(timeout=5)
    # Still serving: status, a real download, no download left behind.
    proc = get(farm, digest, tmp_path / "got.kar")
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    assert (tmp_path / "got.kar").read_bytes() == (tmp_path / "built.kar").read_bytes()
    st = farm.wait_for_status(lambda s: s["transfer"]["downloads_in_progress"] == 0,
                              timeout=20, what="abandoned downloads dropped")
    assert st["workers"], st
    assert farm.broker.poll() is None


def test_a_pinned_artifact_survives_eviction_while_unpinned_ones_go(tmp_path):
    farm = Farm(tmp_path / "farm", broker_args=["--store-max-bytes", "6M"])
    farm.start_broker()
    try:
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        models = [big_model(tmp_path / f"m{i}.onnx", 1, seed=20 + i) for i in range(5)]
        first = compile_json(farm, models[0], tmp_path / "a.kar")
        pin = kiln("pin", first["artifact"], "--broker", farm.endpoint, "--json")
        assert pin.returncode == 0, pin.stderr
        assert json.loads(pin.stdout) == {"artifact": first["artifact"], "pinned": True,
                                          "changed": True, "broker": farm.endpoint}
        twice = kiln("pin", first["artifact"], "--broker", farm.endpoint, "--json")
        assert json.loads(twice.stdout)["changed"] is False
        st = farm.status()
        size_a = (tmp_path / "a.kar").stat().st_size
        assert st["cache"]["pinned"] == 1 and st["cache"]["pinned_bytes"] == size_a
        second = compile_json(farm, models[1], tmp_path / "b.kar")
        for i, m in enumerate(models[2:]):
            compile_json(farm, m, tmp_path / f"c{i}.kar")
        st = farm.status()
        assert st["cache"]["evicted"] > 0
        assert st["cache"]["bytes"] <= st["cache"]["max_bytes"]
        # The pinned one is still there, the older unpinned one is gone.
        proc = get(farm, first["artifact"], tmp_path / "a2.kar")
        assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
        assert (tmp_path / "a2.kar").read_bytes() == (tmp_path / "a.kar").read_bytes()
        gone = get(farm, second["artifact"], tmp_path / "b2.kar")
        assert gone.returncode == 1 and "holds no artifact" in gone.stderr, gone.stderr
        # `kiln status` says so in words too.
        text = kiln("status", "--broker", farm.endpoint)
        assert "1 artifacts pinned" in text.stdout, text.stdout
        # Unpinned, it is an ordinary entry again.
        unpin = kiln("unpin", first["artifact"], "--broker", farm.endpoint, "--json")
        assert json.loads(unpin.stdout)["changed"] is True
        assert farm.status()["cache"]["pinned"] == 0
        again = kiln("unpin", first["artifact"], "--broker", farm.endpoint, "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False
    finally:
        farm.stop()


def test_uploads_that_do_not_fit_beside_the_pins_are_refused_until_unpinned(tmp_path):
    farm = Farm(tmp_path / "farm", broker_args=["--store-max-bytes", "6M"])
    farm.start_broker()
    try:
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        pinned = []
        for i in range(2):
            built = compile_json(farm, big_model(tmp_path / f"p{i}.onnx", 1, seed=40 + i),
                                 tmp_path / f"p{i}.kar")
            assert kiln("pin", built["artifact"], "--broker", farm.endpoint).returncode == 0
            pinned.append(built["artifact"])
        big = big_model(tmp_path / "big.onnx", 4, seed=50)
        refused = farm.compile(big, tmp_path / "big.kar")
        assert refused.returncode != 0
        assert "full of pinned artifacts" in refused.stderr, refused.stderr
        assert "kiln unpin" in refused.stderr
        assert not (tmp_path / "big.kar").exists()
        # Both pinned artifacts are still served.
        for i, digest in enumerate(pinned):
            proc = get(farm, digest, tmp_path / f"again{i}.kar")
            assert proc.returncode == 0, proc.stderr
        # Unpin one: the upload fits now.
        assert kiln("unpin", pinned[1], "--broker", farm.endpoint).returncode == 0
        ok = farm.compile(big, tmp_path / "big.kar")
        assert ok.returncode == 0, f"{ok.stderr}\n{farm.logs()}"
        proc = get(farm, pinned[0], tmp_path / "still.kar")
        assert proc.returncode == 0, proc.stderr
    finally:
        farm.stop()


def test_pins_survive_a_restart_and_a_cap_below_them_is_logged_not_enforced(tmp_path):
    farm = Farm(tmp_path / "farm", broker_args=["--store-max-bytes", "8M"])
    farm.start_broker()
    try:
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        digests = []
        for i in range(2):
            built = compile_json(farm, big_model(tmp_path / f"p{i}.onnx", 1, seed=60 + i),
                                 tmp_path / f"p{i}.kar")
            assert kiln("pin", built["artifact"], "--broker", farm.endpoint).returncode == 0
            digests.append(built["artifact"])
        pinned_bytes = sum((tmp_path / f"p{i}.kar").stat().st_size for i in range(2))
        # Restarted with a cap smaller than what is pinned: nothing pinned
        # goes, and the log tells the operator what to do.
        farm.kill_broker()
        farm.broker_args = ["--store-max-bytes", "1M"]
        farm.start_broker()
        farm.wait_for_log("are pinned artifacts")
        assert "kiln unpin" in farm.log()
        st = farm.status()
        assert st["cache"]["pinned"] == 2 and st["cache"]["pinned_bytes"] == pinned_bytes
        assert st["cache"]["bytes"] > st["cache"]["max_bytes"]
        for i, digest in enumerate(digests):
            proc = get(farm, digest, tmp_path / f"after{i}.kar")
            assert proc.returncode == 0, proc.stderr
            assert (tmp_path / f"after{i}.kar").read_bytes() == \
                (tmp_path / f"p{i}.kar").read_bytes()
    finally:
        farm.stop()


def test_get_and_pin_use_the_curve_certificates_from_the_environment(tmp_path):
    """With CurveZMQ, `kiln get` and `kiln pin` authenticate with
    KILN_CERT / KILN_BROKER_CERT as `kiln compile` does; a client whose
    certificate the broker does not trust is told so, and gets nothing."""
    with curve_farm(tmp_path, untrusted_clients=("mallory",)) as farm:
        env = dict(os.environ, **farm.client_env)

        def kiln_as(env, *args, timeout=60):
            return subprocess.run([kiln_bin("kiln"), *[str(a) for a in args]], env=env,
                                  capture_output=True, text=True, timeout=timeout)

        model = tiny_model(tmp_path / "m.onnx", 3)
        built = kiln_as(env, "compile", model, "-o", tmp_path / "a.kar", "--json", timeout=120)
        assert built.returncode == 0, f"{built.stderr}\n{farm.logs()}"
        digest = json.loads(built.stdout)["artifact"]
        got = kiln_as(env, "get", digest, "-o", tmp_path / "b.kar")
        assert got.returncode == 0, f"{got.stderr}\n{farm.logs()}"
        assert (tmp_path / "b.kar").read_bytes() == (tmp_path / "a.kar").read_bytes()
        pin = kiln_as(env, "pin", digest)
        assert pin.returncode == 0, pin.stderr
        assert f"client alice pinned artifact {digest}" in farm.log()
        # Mallory's certificate is not in the trust directory: refused, by
        # get and by pin alike, before their wait runs out (that would say
        # "gave up" or "no answer") and with nothing left behind.
        mallory = dict(env, KILN_CERT=farm.certs["mallory"])
        for args in (("get", digest, "-o", tmp_path / "m.kar"), ("unpin", digest)):
            refused = kiln_as(mallory, *args, "--wait", "50", timeout=120)
            assert refused.returncode == 5, (args, refused.stderr)
            assert "refused our CurveZMQ certificate" in refused.stderr, refused.stderr
        again = kiln_as(env, "pin", digest, "--json")      # mallory's unpin did nothing
        assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False
        assert not (tmp_path / "m.kar").exists() and leftovers(tmp_path) == []
