"""A hostile worker cannot poison the farm (issue 14, findings 1 and 5):
the broker's reproducibility cross-check, against a worker that is a
Python process speaking the wire protocol by hand (hostile_worker.py),
registered beside honest kiln-workers on loopback.

- its trojaned artifact (every manifest field right, the weights changed)
  is never signed, stored or served from the action cache; the client's
  error names both workers; a third worker's build decides, and the
  hostile worker is quarantined;
- its forged compile failure is neither cached nor served;
- two honest workers that fail alike have the failure cached, and two
  that fail in different words report it uncached;
- a compile killed by SIGKILL is not cached as a failure;
- `--cross-check off` and `new-workers:1` repeat the builds they say;
- a build whose only checker leaves is built again and accepted unchecked.

Every process is stopped by the Farm's stop(); every wait is bounded.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import kiln_bin, run
from farm_helpers import running_farm, sleepy, tiny_model

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from hostile_worker import FORGED_LOG, trojan  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-cc", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")


def content_hash(kar_bytes):
    with tarfile.open(fileobj=io.BytesIO(kar_bytes)) as tar:
        return hashlib.sha256(tar.extractfile("manifest.json").read()).hexdigest()


def provenance(path):
    with tarfile.open(path) as tar:
        return json.loads(tar.extractfile("provenance.json").read())


def honest_build(tmp_path, model, folder):
    """The model compiled here, unsigned: what every honest worker builds."""
    kgraph = tmp_path / (os.path.basename(model) + ".kgraph")
    out = os.path.join(folder, os.path.basename(model) + ".kar")
    run(["kiln", "import", model, "-o", kgraph], check=True)
    run(["kiln-cc", kgraph, "-o", out, "--unsigned"], check=True)
    with open(out, "rb") as f:
        return f.read()


def start_mallory(farm, tmp_path, honest_dir, slots=1):
    tc = farm.status()["workers"][0]["toolchains"][0]
    log = open(tmp_path / "mallory.log", "wb")
    proc = farm.spawn(["/usr/bin/python3", os.path.join(HERE, "hostile_worker.py"), farm.port,
                       "mallory", tc, honest_dir, "--slots", slots], stdout=log,
                      stderr=log)
    log.close()
    return proc


def mallory_log(tmp_path):
    return (tmp_path / "mallory.log").read_text()


def test_a_trojaned_artifact_is_never_signed_or_cached_and_a_third_build_quarantines_its_worker(
        tmp_path):
    honest_dir = tmp_path / "honest"
    honest_dir.mkdir()
    a = tiny_model(tmp_path / "a.onnx", 101)
    honest_a = honest_build(tmp_path, a, honest_dir)
    with running_farm(tmp_path / "farm") as farm:
        farm.start_worker("honest-1")
        farm.wait_for_workers(1)
        start_mallory(farm, tmp_path, honest_dir, slots=8)
        farm.wait_for_workers(2)

        # Two workers, two different results, nobody to decide: the job
        # fails, naming both, and nothing is signed or cached.
        for attempt in range(2):
            proc = farm.compile(a, tmp_path / "a.kar")
            assert proc.returncode != 0, proc.stdout
            assert "cross-check failed" in proc.stderr, proc.stderr
            assert "mallory" in proc.stderr and "honest-1" in proc.stderr
            assert "cached failure" not in proc.stderr
            assert not (tmp_path / "a.kar").exists()
        assert mallory_log(tmp_path).count("sent a trojan") == 2
        bad = content_hash(trojan(honest_a))
        got = run(["kiln", "get", bad, "-o", tmp_path / "bad.kar", "--broker", farm.endpoint])
        assert got.returncode != 0 and not (tmp_path / "bad.kar").exists()
        st = farm.status()
        assert st["cache"]["artifacts"] == 0 and st["cross_check"]["disagreed"] == 2

        # A third worker decides: mallory (most free slots, so it builds
        # first) disagrees with two honest workers and is quarantined; the
        # client gets the honest build, which is not cached.
        farm.start_worker("honest-2")
        farm.wait_for_workers(3)
        b = tiny_model(tmp_path / "b.onnx", 102)
        honest_b = honest_build(tmp_path, b, honest_dir)
        proc = farm.compile(b, tmp_path / "b.kar")
        assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
        res = json.loads(proc.stdout)
        assert res["artifact"] == content_hash(honest_b) and res["cached"] is False
        assert run(["kiln", "verify", tmp_path / "b.kar", "--keyring", farm.keyring]).returncode == 0
        prov = provenance(tmp_path / "b.kar")
        assert prov["disagreed"] == ["mallory"], prov
        assert {prov["builder"], *prov["checked_by"]} == {"honest-1", "honest-2"}
        assert prov["cross_check"]["result"] == "2 of 3 agreed"
        st = farm.status()
        assert "mallory" in st["cross_check"]["quarantined"]
        quarantined = {w["name"]: w["quarantined"] for w in st["workers"]}
        assert quarantined["mallory"] and "built artifact" in quarantined["mallory"]
        assert quarantined["honest-1"] is None and quarantined["honest-2"] is None
        human = run(["kiln", "status", "--broker", farm.endpoint])
        assert "QUARANTINED" in human.stdout

        # From now on mallory gets nothing; the two honest workers agree,
        # and only then is the action cached.
        for model, honest in ((b, honest_b), (a, honest_a)):
            first = farm.compile(model, tmp_path / "x.kar")
            assert first.returncode == 0, first.stderr
            assert json.loads(first.stdout)["cached"] is False
            prov = provenance(tmp_path / "x.kar")
            assert prov["cross_check"]["result"] == "agreed" and len(prov["checked_by"]) == 1
            again = farm.compile(model, tmp_path / "y.kar")
            res = json.loads(again.stdout)
            assert res["cached"] is True and res["artifact"] == content_hash(honest)
            verify = run(["kiln", "verify", tmp_path / "y.kar", "--keyring", farm.keyring])
            assert verify.returncode == 0
        assert mallory_log(tmp_path).count("sent a trojan") == 3


def test_a_forged_failure_is_not_cached_and_a_confirmed_one_is(tmp_path):
    honest_dir = tmp_path / "honest"
    honest_dir.mkdir()                       # empty: mallory forges failures
    c = tiny_model(tmp_path / "c.onnx", 103)
    with running_farm(tmp_path / "farm") as farm:
        farm.start_worker("honest-1")
        farm.wait_for_workers(1)
        mallory = start_mallory(farm, tmp_path, honest_dir)
        farm.wait_for_workers(2)
        for attempt in range(2):
            proc = farm.compile(c, tmp_path / "c.kar")
            assert proc.returncode != 0
            assert "cross-check failed" in proc.stderr and "mallory" in proc.stderr
            assert "cached failure" not in proc.stderr and "FORGED" not in proc.stderr
        assert mallory_log(tmp_path).count("sent a forged failure") == 2
        assert farm.status()["cache"]["failures"] == 0
        # Mallory gone, the one honest worker builds it: the forged failure
        # was never the farm's word.
        mallory.kill()
        mallory.wait(timeout=10)
        farm.wait_for_status(lambda s: len(s["workers"]) == 1, what="mallory dropped")
        ok = farm.compile(c, tmp_path / "c.kar")
        assert ok.returncode == 0, ok.stderr
        assert provenance(tmp_path / "c.kar")["cross_check"]["checked"] is False

        # Two honest workers failing alike: confirmed, cached.
        bad_tc = "bad@1=sh -c 'echo deterministic: node boom refused >&2; exit 3'"
        noisy_tc = "noisy@1=sh -c 'echo refused, token $(od -An -N4 -tu4 /dev/urandom) >&2; exit 3'"
        for name in ("bad-1", "bad-2"):
            farm.start_worker(name, "--toolchain", bad_tc, "--toolchain", noisy_tc)
        farm.wait_for_workers(3)
        first = farm.compile(c, tmp_path / "d.kar", "--toolchain", "bad@1")
        assert first.returncode != 0 and "node boom refused" in first.stderr
        assert "the same on worker bad-" in first.stderr, first.stderr
        again = farm.compile(c, tmp_path / "d.kar", "--toolchain", "bad@1")
        assert again.returncode != 0 and "cached failure" in again.stderr
        # Failures whose logs differ (a random token in each): the client sees the
        # compile's own error, not a cross-check one, and it is not cached.
        for attempt in range(2):
            noisy = farm.compile(c, tmp_path / "d.kar", "--toolchain", "noisy@1")
            assert noisy.returncode != 0 and "refused, token" in noisy.stderr
            assert "cross-check" not in noisy.stderr and "cached failure" not in noisy.stderr
        assert farm.log().count("both failed, with different messages or logs") == 2


def test_a_compile_killed_by_sigkill_is_not_cached_as_a_failure(tmp_path):
    killer = "killer@1=sh -c 'kill -9 $$'"
    c = tiny_model(tmp_path / "k.onnx", 104)
    with running_farm(tmp_path / "farm") as farm:
        farm.start_worker("w1", "--toolchain", killer)
        farm.wait_for_workers(1)
        for attempt in range(2):
            proc = farm.compile(c, tmp_path / "k.kar", "--toolchain", "killer@1")
            assert proc.returncode != 0
            assert "signal 9" in proc.stderr, proc.stderr
            assert "cached failure" not in proc.stderr
        assert farm.log().count("sent to worker w1") == 2
        assert farm.status()["cache"]["failures"] == 0


@pytest.mark.parametrize("policy", ["off", "new-workers:1"])
def test_the_cross_check_policy_decides_which_builds_a_second_worker_repeats(tmp_path, policy):
    models = [tiny_model(tmp_path / f"p{i}.onnx", 110 + i) for i in range(2)]
    with running_farm(tmp_path / "farm", broker_args=["--cross-check", policy]) as farm:
        farm.start_worker("w1")
        farm.start_worker("w2")
        farm.wait_for_workers(2)
        checked = []
        for i, model in enumerate(models):
            proc = farm.compile(model, tmp_path / f"p{i}.kar")
            assert proc.returncode == 0, proc.stderr
            prov = provenance(tmp_path / f"p{i}.kar")
            assert prov["cross_check"]["policy"] == policy
            checked.append(prov["cross_check"]["checked"])
        compiles = sum(farm.log(w).count("compiling with") for w in ("w1", "w2"))
        if policy == "off":
            # Never checked: each model built once, and provenance says why.
            assert checked == [False, False] and compiles == 2
            assert "--cross-check off" in prov["cross_check"]["result"]
            assert farm.status()["cross_check"]["unchecked"] == 2
        else:
            # The first build confirms both workers; after that they are
            # taken at their word.
            assert checked == [True, False] and compiles == 3
            assert "new-workers" in prov["cross_check"]["result"]
        assert farm.status()["cross_check"]["policy"] == policy


def test_a_build_whose_checker_leaves_is_built_again_and_accepted_unchecked(tmp_path):
    # w1 has more free slots, so it builds first; the check goes to w2,
    # whose toolchain (same name and version) takes a minute, and w2 dies.
    model = tiny_model(tmp_path / "s.onnx", 120)
    with running_farm(tmp_path / "farm") as farm:
        farm.start_worker("w1", "--slots", "2", "--toolchain", sleepy(0.1))
        farm.start_worker("w2", "--slots", "1", "--toolchain", sleepy(60))
        farm.wait_for_workers(2)
        client = farm.spawn(farm.compile_argv(model, tmp_path / "s.kar", "--toolchain",
                                              "sleepy@1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        farm.wait_for_log("another worker checks it")
        farm.wait_for_log("sent to worker w2")
        farm.kill_worker("w2")
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, f"{err}\n{farm.logs()}"
        assert json.loads(out)["worker"] == "w1"
        prov = provenance(tmp_path / "s.kar")
        assert prov["cross_check"]["checked"] is False
        assert "no other connected worker" in prov["cross_check"]["result"]
        farm.wait_for_log("no worker left to check the build of w1")
