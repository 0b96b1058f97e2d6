"""Trust on first use (issue 16): `kiln trust` against a real broker pins
the farm's key in the user's keyring, after which kiln.trace(broker=...)
needs no other key handling; before it, kiln.trace says to run it; a
broker presenting another key than the pinned one is refused.  Local
builds are trusted by kiln.load without copying keys."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import SRC, kiln_bin
from farm_helpers import Farm

EXIT_USAGE, EXIT_VERIFY = 2, 5

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

TRACE = textwrap.dedent("""
    import os, sys, torch, kiln
    broker, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    x = torch.rand(2, 8)
    if sys.argv[3] == "untrusted":
        try:
            kiln.trace(model, x, broker=broker)
        except kiln.VerifyError as e:
            print("VERIFY", str(e).replace(chr(10), " "))
        sys.exit(0)
    traced = kiln.trace(model, x, broker=broker or None)
    with torch.no_grad():
        err = (traced(x) - model(x)).abs().max().item()
    assert err < 1e-5, err
    traced.save(out)
    loaded = kiln.load(out)               # the default keyring, nothing copied
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-5)
    print("OK", traced.compile_info["mode"], traced.compile_info.get("worker"))
""")


def _env(config):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KILN_BROKER", "KILN_KEYRING", "KILN_CERT", "KILN_BROKER_CERT")}
    env["KILN_CONFIG_DIR"] = str(config)
    env["PYTHONPATH"] = os.path.join(SRC, "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _trace(env, broker, out, mode="trusted"):
    proc = subprocess.run([sys.executable, "-c", TRACE, broker, str(out), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _trust(env, farm, *extra):
    return subprocess.run([kiln_bin("kiln"), "trust", farm.endpoint, *extra], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_trust_on_first_use_then_trace_on_the_farm(tmp_path):
    farm = Farm(tmp_path / "farm")
    env = _env(tmp_path / "config")
    keyring = tmp_path / "config" / "keyring"
    try:
        farm.start_broker()
        farm.start_worker("w1")
        farm.wait_for_workers(1)
        # Before trust: VerifyError naming the command that fixes it.
        line = _trace(env, farm.endpoint, tmp_path / "m0.kar", "untrusted")
        assert line.startswith("VERIFY") and f"kiln trust {farm.endpoint}" in line, line
        # Not a terminal and no --yes: shown, not pinned.
        asked = _trust(env, farm)
        assert asked.returncode == EXIT_USAGE, asked.stderr
        fp = re.search(r"fingerprint SHA256:([0-9a-f]{64})", asked.stderr).group(1)
        assert not any(p.name.startswith("farm-") for p in keyring.glob("*.pub"))
        # The fingerprint the broker logs is the one shown.
        assert f"fingerprint SHA256:{fp}" in farm.log()
        wrong = _trust(env, farm, "--fingerprint", "0" * 64)
        assert wrong.returncode == EXIT_VERIFY, wrong.stderr
        ok = _trust(env, farm, "--fingerprint", fp[:16].upper(), "--json")
        assert ok.returncode == 0, ok.stderr
        res = json.loads(ok.stdout)
        assert res["added"] is True and res["fingerprint"] == fp
        assert os.path.dirname(res["path"]) == str(keyring)
        again = _trust(env, farm, "--yes", "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["added"] is False
        # Now kiln.trace on the farm works, and kiln.load with no keyring given.
        line = _trace(env, farm.endpoint, tmp_path / "m1.kar")
        assert line.startswith("OK farm"), line      # cached: the untrusted run built it
        # A local build: the user's own key is in the same keyring.
        line = _trace(env, "", tmp_path / "m2.kar")
        assert line.startswith("OK local"), line
        assert any(p.name.startswith("own-") for p in keyring.glob("*.pub"))
        # The broker comes back at the same address with another key: refused.
        farm.kill_broker()
        farm.keydir = str(tmp_path / "other-key")
        farm.start_broker()
        changed = _trust(env, farm, "--yes")
        assert changed.returncode == EXIT_VERIFY, changed.stderr
        assert "KEY HAS CHANGED" in changed.stderr and fp in changed.stderr
        pinned = [p for p in keyring.glob("farm-*.pub")]
        assert len(pinned) == 1
    finally:
        farm.stop()
