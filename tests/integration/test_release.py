"""Signed release records with the real `kiln` binary: a farm key builds,
a release key releases, `kiln release verify` trusts each for its own job
only, stock `openssl` checks the signature, and tampering, expiry and
rollback are refused (docs/release-format.md)."""

import base64
import calendar
import hashlib
import json
import os
import subprocess
import tarfile
import time

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import run


def _model(path):
    """A tiny ONNX model (y = relu(x) + 1), made without torch."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                               helper.make_node("Add", ["r", "one"], ["y"])],
                              "release_test", [x], [y], initializer=[one])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


class Keys:
    """A farm key and a release key made with `kiln keygen`, two artifacts
    compiled locally and signed by the farm key."""

    def __init__(self, root):
        self.root = root
        self.env = {"KILN_CONFIG_DIR": str(root / "config"), "KILN_BROKER": ""}
        self.farm = root / "farm"
        self.release = root / "release"
        self.farm_id = json.loads(run(["kiln", "keygen", "--out", self.farm, "--json"],
                                      check=True).stdout)["key_id"]
        self.release_id = json.loads(run(["kiln", "keygen", "--out", self.release, "--json"],
                                         check=True).stdout)["key_id"]
        onnx_path = root / "m.onnx"
        _model(onnx_path)
        self.kar, self.digest = {}, {}
        # Two optimisation levels: two compilations, two content hashes.
        for name, level in (("a", "1"), ("b", "0")):
            kar = root / f"{name}.kar"
            proc = run(["kiln", "compile", onnx_path, "-o", kar, "--local", "--key",
                        self.farm / "kiln.key", "--compiler-args", f"--optlevel {level}",
                        "--json"], env=self.env, check=True)
            self.kar[name] = kar
            self.digest[name] = json.loads(proc.stdout)["artifact"]
        assert self.digest["a"] != self.digest["b"]

    def sign(self, out, artifact="a", seq=1, model="relu", expires=None, key=None, check=True,
             extra=()):
        args = ["kiln", "release", "sign", self.kar[artifact], "--model", model,
                "--seq", seq, "--key", key or self.release / "kiln.key", "-o", out, "--json",
                *extra]
        if expires:
            args += ["--expires", expires]
        proc = run(args, env=self.env, check=check)
        return json.loads(proc.stdout) if check else proc

    def verify(self, record, *extra, keyring=None):
        return run(["kiln", "release", "verify", record, "--keyring", keyring or self.release,
                    *extra], env=self.env)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return Keys(tmp_path_factory.mktemp("release"))


def _manifest_sha256(kar):
    with tarfile.open(kar) as tf:
        return hashlib.sha256(tf.extractfile("manifest.json").read()).hexdigest()


def _envelope(path):
    env = json.loads(open(path).read())
    return env, base64.b64decode(env["record"], validate=True)


def test_release_is_signed_by_the_release_key_and_verifies(keys, tmp_path):
    out = tmp_path / "release.json"
    rec = keys.sign(out, seq=3, expires="12h")
    assert rec["model"] == "relu" and rec["seq"] == 3
    # The content hash is the SHA-256 of the artifact's manifest.json, as
    # `kiln compile` reported it.
    assert rec["artifact"] == keys.digest["a"] == _manifest_sha256(keys.kar["a"])
    assert rec["key_id"] == keys.release_id
    assert rec["target"] and rec["runtime_abi"] == 1
    issued = time.strptime(rec["issued_at"], "%Y-%m-%dT%H:%M:%SZ")
    expires = time.strptime(rec["expires_at"], "%Y-%m-%dT%H:%M:%SZ")
    assert calendar.timegm(expires) - calendar.timegm(issued) == 12 * 3600
    assert abs(calendar.timegm(issued) - time.time()) < 60

    # The file: one line of JSON, the record inside canonical JSON whose
    # fields are what sign printed.
    text = open(out).read()
    assert text.endswith("}\n") and text.count("\n") == 1
    env, record = _envelope(out)
    assert sorted(env) == ["algorithm", "key_id", "record", "signature"]
    assert env["algorithm"] == "ed25519" and env["key_id"] == keys.release_id
    assert len(base64.b64decode(env["signature"])) == 64
    fields = json.loads(record)
    assert record == json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert fields["format"] == "kiln-release" and fields["format_version"] == 1
    assert {k: fields[k] for k in rec if k != "output"} == {k: v for k, v in rec.items() if k != "output"}

    proc = keys.verify(out, "--artifact", keys.kar["a"])
    assert proc.returncode == 0, proc.stderr
    assert "ok, release seq 3 of model 'relu'" in proc.stdout
    proc = keys.verify(out, "--artifact", keys.kar["a"], "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    summary = json.loads(proc.stdout)
    assert summary["ok"] is True and summary["artifact_checked"] is True
    assert summary["state"] is None
    assert summary["artifact"] == keys.digest["a"] and summary["seq"] == 3


def test_farm_key_cannot_release(keys, tmp_path):
    out = tmp_path / "release.json"
    keys.sign(out)
    # The farm keyring does not hold release keys.
    proc = keys.verify(out, keyring=keys.farm)
    assert proc.returncode == 5
    assert f"signed by key {keys.release_id} which is not in release keyring" in proc.stderr
    # The key that signed the artifact cannot also release it.
    proc = keys.sign(tmp_path / "x.json", key=keys.farm / "kiln.key", check=False)
    assert proc.returncode == 1
    assert "cannot also release it" in proc.stderr
    assert not (tmp_path / "x.json").exists()
    # With --farm-keyring, sign checks the artifact's signature first.
    assert keys.sign(tmp_path / "z.json", extra=["--farm-keyring", keys.farm])["seq"] == 1
    proc = keys.sign(tmp_path / "w.json", extra=["--farm-keyring", keys.release], check=False)
    assert proc.returncode == 5
    assert f"signed by key {keys.farm_id} which is not in keyring" in proc.stderr
    assert not (tmp_path / "w.json").exists()
    # A record signed by a key that is in no release keyring is refused,
    # even if it is a good key.
    other = tmp_path / "other"
    run(["kiln", "keygen", "--out", other], check=True)
    keys.sign(tmp_path / "y.json", key=other / "kiln.key")
    proc = keys.verify(tmp_path / "y.json")
    assert proc.returncode == 5 and "not in release keyring" in proc.stderr


# The commands of docs/release-format.md, "Checking a release by hand".
OPENSSL_CHECK = r"""
set -e
sed -n 's/.*"record":"\([A-Za-z0-9+/=]*\)".*/\1/p' release.json | base64 -d > record.json
sed -n 's/.*"signature":"\([A-Za-z0-9+/=]*\)".*/\1/p' release.json | base64 -d > record.sig
openssl pkeyutl -verify -pubin -inkey "$PUB" -rawin -in record.json -sigfile record.sig
"""


def test_stock_openssl_checks_the_release_signature(keys, tmp_path):
    keys.sign(tmp_path / "release.json", seq=9)

    def check(pub):
        return subprocess.run(["bash", "-c", OPENSSL_CHECK], cwd=tmp_path, capture_output=True,
                              text=True, timeout=30, env={**os.environ, "PUB": str(pub)})

    proc = check(keys.release / "kiln.pub")
    assert proc.returncode == 0, proc.stderr
    assert "Signature Verified Successfully" in proc.stdout
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["seq"] == 9 and record["artifact"] == keys.digest["a"]
    # The key id is computable from the public key alone.
    kid = subprocess.run(["bash", "-c", f"openssl pkey -pubin -in {keys.release}/kiln.pub "
                          "-outform DER | sha256sum | cut -c1-16"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    assert kid == record["key_id"] == keys.release_id
    # The farm's public key does not verify it.
    assert check(keys.farm / "kiln.pub").returncode != 0
    # Nor does the release key once the record is changed.
    changed = (tmp_path / "record.json").read_bytes().replace(b'"seq":9', b'"seq":8')
    (tmp_path / "record.json").write_bytes(changed)
    proc = subprocess.run(["openssl", "pkeyutl", "-verify", "-pubin", "-inkey",
                           keys.release / "kiln.pub", "-rawin", "-in", "record.json",
                           "-sigfile", "record.sig"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0 and "Signature Verification Failure" in proc.stdout


def test_tampering_is_detected(keys, tmp_path):
    out = tmp_path / "release.json"
    keys.sign(out, seq=3)
    env, record = _envelope(out)

    def tampered(name, **fields):
        path = tmp_path / name
        path.write_text(json.dumps({**env, **fields}, sort_keys=True, separators=(",", ":")) + "\n")
        return keys.verify(path, "--artifact", keys.kar["a"])

    # The record changed (a higher seq, another artifact): bad signature.
    for old, new in ((b'"seq":3', b'"seq":4'), (keys.digest["a"].encode(), keys.digest["b"].encode())):
        forged = base64.b64encode(record.replace(old, new)).decode()
        proc = tampered("forged.json", record=forged)
        assert proc.returncode == 5
        assert "bad signature on the release record" in proc.stderr
    # The signature changed.
    sig = bytearray(base64.b64decode(env["signature"]))
    sig[10] ^= 1
    proc = tampered("sig.json", signature=base64.b64encode(bytes(sig)).decode())
    assert proc.returncode == 5 and "bad signature" in proc.stderr
    # Another algorithm or key claimed: refused before any cryptography.
    proc = tampered("alg.json", algorithm="rsa")
    assert proc.returncode == 5 and "signature algorithm 'rsa' is not supported" in proc.stderr
    # An unknown field, a truncated file, a file over the bound.
    proc = tampered("extra.json", comment="hi")
    assert proc.returncode == 5 and "unknown field 'comment'" in proc.stderr
    (tmp_path / "short.json").write_text(out.read_text()[:100])
    proc = keys.verify(tmp_path / "short.json")
    assert proc.returncode == 5 and "not valid JSON" in proc.stderr
    (tmp_path / "big.json").write_text(" " * 5000)
    proc = keys.verify(tmp_path / "big.json")
    assert proc.returncode == 5 and "more than the limit of 4096" in proc.stderr

    # The right record with the wrong artifact.
    proc = keys.verify(out, "--artifact", keys.kar["b"])
    assert proc.returncode == 5
    assert f"artifact {keys.digest['b']} is not the one release seq 3 of model 'relu' names" \
        in proc.stderr
    # A damaged artifact is refused as such.
    bad = bytearray(keys.kar["a"].read_bytes())
    with tarfile.open(keys.kar["a"]) as tf:
        info = tf.getmember("program.kbin")
    bad[info.offset_data + 1] ^= 1
    (tmp_path / "bad.kar").write_bytes(bytes(bad))
    proc = keys.verify(out, "--artifact", tmp_path / "bad.kar")
    assert proc.returncode == 5 and "program.kbin" in proc.stderr


def test_expired_release_is_refused(keys, tmp_path):
    out = tmp_path / "release.json"
    keys.sign(out, expires="2s")
    # Issued at whole seconds, so a 2 s record has at least 1 s left now.
    proc = keys.verify(out)
    assert proc.returncode == 0, proc.stderr
    time.sleep(2.5)
    proc = keys.verify(out)
    assert proc.returncode == 5
    assert "release seq 1 of model 'relu' expired at" in proc.stderr


def test_rollback_is_refused_with_state(keys, tmp_path):
    state = tmp_path / "state"
    r = {}
    for name, artifact, seq in (("a5", "a", 5), ("a4", "a", 4), ("b5", "b", 5), ("b6", "b", 6)):
        r[name] = tmp_path / f"{name}.json"
        keys.sign(r[name], artifact=artifact, seq=seq)

    def verify(name):
        return keys.verify(r[name], "--state", state, "--json")

    proc = verify("a5")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == "recorded"
    saved = json.loads((state / "relu.json").read_text())
    assert saved["seq"] == 5 and saved["artifact"] == keys.digest["a"]
    # The same release again passes and changes nothing.
    proc = verify("a5")
    assert proc.returncode == 0 and json.loads(proc.stdout)["state"] == "unchanged"
    # A lower seq, validly signed, is a rollback.
    proc = verify("a4")
    assert proc.returncode == 5
    assert "release seq 4 of model 'relu' is lower than the seq already accepted" in proc.stderr
    # The same seq naming another artifact is refused.
    proc = verify("b5")
    assert proc.returncode == 5 and "names another artifact" in proc.stderr
    # Without --state nothing is remembered, so the same records pass.
    assert keys.verify(r["a4"]).returncode == 0
    # A higher seq moves the state on; the old one is now refused.
    proc = verify("b6")
    assert proc.returncode == 0 and json.loads(proc.stdout)["state"] == "recorded"
    assert json.loads((state / "relu.json").read_text())["seq"] == 6
    proc = verify("a5")
    assert proc.returncode == 5 and "refusing a rollback" in proc.stderr
    # Written with rename: nothing else left in the directory.
    assert sorted(os.listdir(state)) == ["relu.json"]


@pytest.mark.parametrize("args,want", [
    (["--expires", "1w"], "not a whole number followed by s, m, h or d"),
    (["--expires", "400d"], "longer than the limit of 365d"),
    (["--model", "../etc"], "is not allowed"),
    (["--seq", "0"], "--seq wants a whole number"),
    (["--seq", "-3"], "--seq wants a whole number"),
    (["--seq", "99999999999999999999"], "--seq wants a whole number"),
])
def test_sign_refuses_bad_options_with_usage(keys, tmp_path, args, want):
    base = {"--model": "relu", "--seq": "1", "--key": str(keys.release / "kiln.key"),
            "-o": str(tmp_path / "r.json")}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = ["kiln", "release", "sign", keys.kar["a"]] + [x for kv in base.items() for x in kv]
    proc = run(argv, env=keys.env)
    assert proc.returncode == 2
    assert want in proc.stderr and "usage: kiln release sign" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_release_help_and_usage_errors():
    proc = run(["kiln", "--help"])
    assert "release" in proc.stdout
    proc = run(["kiln", "release", "-h"])
    assert proc.returncode == 0 and "kiln release verify" in proc.stdout
    assert run(["kiln", "release"]).returncode == 2
    assert run(["kiln", "release", "publish"]).returncode == 2
    proc = run(["kiln", "release", "verify", "x.json"])
    assert proc.returncode == 2 and "missing --keyring" in proc.stderr
