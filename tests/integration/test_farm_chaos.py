"""The farm under failure (issue 4), with real processes on loopback:

- chaos: 200 distinct models from 4 concurrent clients on 4 workers, one
  random worker killed with SIGKILL every 1.5 s and started again: all 200
  artifacts arrive, each verifies, none is delivered twice;
- the broker killed with SIGKILL mid-batch and started again: every waiting
  client gets its artifacts (clients send again what the broker forgot),
  the store passes a full integrity check, and what was built before the
  crash is still in the action cache.

Jobs use the builtin compiler behind a 0.5 s delay, so that they are in
flight when the kills come; the models are tiny graphs with distinct
weights."""

import json
import os
import random
import subprocess
import threading
import time

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, batch_lines, tiny_model, write_jobs

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker", "kiln-cc")),
    reason="build/bin lacks the farm's programs: run `make` first")


def slow_cc(tmp_path, delay):
    path = tmp_path / "slow-cc"
    path.write_text(f"#!/bin/sh\nsleep {delay}\nexec {kiln_bin('kiln-cc')} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def verify_all(farm, paths):
    bad = []
    for p in paths:
        proc = subprocess.run([kiln_bin("kiln"), "verify", p, "--keyring", farm.keyring],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            bad.append((p, proc.stderr))
    return bad


def test_chaos_200_jobs_4_clients_4_workers_with_a_worker_killed_every_few_seconds(tmp_path):
    farm = Farm(tmp_path / "farm", broker_args=["--liveness-ms", "3000", "--max-deaths", "5"])
    killer_stop = threading.Event()
    kills = []
    try:
        farm.start_broker()
        cc = slow_cc(tmp_path, 0.5)
        names = [f"w{i}" for i in range(1, 5)]
        for name in names:
            farm.start_worker(name, "--cc", cc, "--slots", "2", "--liveness-ms", "3000")
        farm.wait_for_workers(4)
        models = tmp_path / "models"
        models.mkdir()
        outs = tmp_path / "out"
        outs.mkdir()
        clients = []
        for c in range(4):
            jobs = [{"model": tiny_model(models / f"m{c}_{i}.onnx", 1000 * c + i),
                     "output": str(outs / f"m{c}_{i}.kar")} for i in range(50)]
            jobs_file = write_jobs(tmp_path / f"client{c}.jsonl", jobs)
            clients.append(farm.spawn(farm.batch_argv(jobs_file, "--client-name", f"client{c}",
                                                      "--wait", "240"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

        def killer():
            rng = random.Random(4)
            while not killer_stop.wait(1.5):
                name = rng.choice(names)
                farm.kill_worker(name)
                kills.append((time.monotonic(), name))
                farm.restart_worker(name)

        t0 = time.monotonic()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        results = []
        for c, proc in enumerate(clients):
            out, err = proc.communicate(timeout=300)
            results.append((proc.returncode, out, err))
        killer_stop.set()
        thread.join(timeout=10)
        elapsed = time.monotonic() - t0
        problems = [f"client {c}: exit {rc}\n{err}" for c, (rc, out, err) in enumerate(results)
                    if rc != 0]
        assert not problems, "\n".join(problems) + "\n" + farm.logs()
        artifacts, outputs, duplicates, resent = [], [], 0, 0
        for c, (rc, out, err) in enumerate(results):
            lines, summary = batch_lines(out)
            assert summary["jobs"] == 50 and summary["ok"] == 50, summary
            indexes = [l["index"] for l in lines]
            assert sorted(indexes) == list(range(50)), "a job was delivered twice or not at all"
            duplicates += summary["duplicates"]
            resent += summary["resent"]
            artifacts += [l["artifact"] for l in lines]
            outputs += [l["output"] for l in lines]
        assert len(set(outputs)) == 200
        assert len(set(artifacts)) == 200, "distinct models must give distinct artifacts"
        assert duplicates == 0
        bad = verify_all(farm, outputs)
        assert not bad, bad[:3]
        log = farm.log()
        requeued = log.count("back in the queue")
        print(f"\nchaos: 200 jobs from 4 clients in {elapsed:.1f} s, {len(kills)} workers killed, "
              f"{requeued} jobs requeued, {resent} requests resent, 0 duplicates, "
              f"200 artifacts verified")
        assert len(kills) >= 5, "the run was too short to kill workers"
    finally:
        killer_stop.set()
        farm.stop()


def test_broker_killed_mid_batch_every_client_gets_its_artifacts(tmp_path):
    farm = Farm(tmp_path / "farm")
    try:
        farm.start_broker()
        cc = slow_cc(tmp_path, 0.3)
        for name in ("w1", "w2"):
            farm.start_worker(name, "--cc", cc, "--slots", "2")
        farm.wait_for_workers(2)
        models = tmp_path / "models"
        models.mkdir()
        clients, all_jobs = [], []
        for c in range(2):
            jobs = [{"model": tiny_model(models / f"m{c}_{i}.onnx", 5000 + 100 * c + i),
                     "output": str(tmp_path / f"m{c}_{i}.kar")} for i in range(20)]
            all_jobs += jobs
            jobs_file = write_jobs(tmp_path / f"c{c}.jsonl", jobs)
            clients.append(farm.spawn(farm.batch_argv(jobs_file, "--client-name", f"c{c}",
                                                      "--wait", "180"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        farm.wait_for_log("built by", count=6)
        farm.kill_broker()
        before = [l.split(" action ")[1][:12] for l in farm.log().splitlines() if "built by" in l]
        # Right after kill -9, the store passes a full integrity check.
        check = subprocess.run([kiln_bin("kiln-broker"), "--check-store", "--state", farm.state],
                               capture_output=True, text=True, timeout=120)
        print("\nafter kill -9: " + check.stdout.strip().splitlines()[-1])
        assert check.returncode == 0, check.stdout + check.stderr
        assert "0 damaged" in check.stdout
        time.sleep(0.5)
        farm.start_broker()
        outputs = {}
        for c, proc in enumerate(clients):
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"client {c}: {err}\n{farm.logs()}"
            lines, summary = batch_lines(out)
            assert summary["ok"] == 20 and sorted(l["index"] for l in lines) == list(range(20))
            assert summary["duplicates"] == 0
            print(f"broker restart: client {c} resent {summary['resent']} requests")
            for l in lines:
                outputs[l["action_key"][:12]] = (l["model"], l["output"])
        bad = verify_all(farm, [o for _, o in outputs.values()])
        assert not bad, bad[:3]
        assert len(outputs) == 40
        # Workers came back by themselves.
        assert farm.log().count("worker w1 ready") >= 2 and farm.log().count("worker w2 ready") >= 2
        # What was built before the crash is served from the cache after it.
        model, _ = outputs[before[0]]
        again = farm.compile(model, tmp_path / "again.kar")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["cached"] is True
        # And the store still checks out in full.
        farm.kill_broker()
        check = subprocess.run([kiln_bin("kiln-broker"), "--check-store", "--state", farm.state],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0 and "0 damaged" in check.stdout, check.stdout
    finally:
        farm.stop()
