"""kiln-broker --metrics (issue 16): Prometheus scrapes /metrics while
jobs run, with real processes on loopback; the series named in
docs/operations.md are there, well-formed, and agree with what the farm
did (and with `kiln status`)."""

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, big_model, sleepy, tiny_model, write_jobs
from kiln.farm import free_port

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def scrape(port):
    """{(name, labels): value} of one scrape; checks the text format."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    typed, out = set(), {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or base in typed, f"{name} has no TYPE line"
        out[(name, labels)] = float(value)
    return out


def wait_for(port, pred, timeout=60, what="the metrics"):
    deadline = time.monotonic() + timeout
    m = None
    while time.monotonic() < deadline:
        m = scrape(port)
        if pred(m):
            return m
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout}s: {m}")


def test_metrics_scraped_while_jobs_run_name_the_series_and_agree(tmp_path):
    port = free_port()
    farm = Farm(tmp_path / "farm", broker_args=["--metrics", f"127.0.0.1:{port}"])
    try:
        farm.start_broker()
        farm.start_worker("w1", "--slots", "1", "--toolchain", sleepy(0.6))
        farm.wait_for_workers(1)
        # The page is rendered every half second: wait for the worker.
        m = wait_for(port, lambda m: m[("kiln_broker_workers", "")] == 1)
        assert m[("kiln_broker_worker_slots", '{worker="w1"}')] == 1
        assert m[("kiln_broker_jobs_done_total", "")] == 0
        models = [tiny_model(tmp_path / f"m{i}.onnx", 40 + i) for i in range(3)]
        jobs = write_jobs(tmp_path / "jobs.jsonl",
                          [{"model": p, "output": str(tmp_path / f"o{i}.kar")}
                           for i, p in enumerate(models)])
        batch = farm.spawn(farm.batch_argv(jobs, "--toolchain", "sleepy@1", "--client-name",
                                           "ci"), stdout=subprocess.PIPE, text=True)
        # While they run: one on the worker, the others queued for client ci.
        m = wait_for(port, lambda m: m[("kiln_broker_running_jobs", "")] == 1
                     and m.get(("kiln_broker_client_queued_jobs", '{client="ci"}'), 0) >= 1,
                     what="a job running and some queued")
        assert m[("kiln_broker_worker_busy_slots", '{worker="w1"}')] == 1
        assert m[("kiln_broker_busy_slots", "")] == 1
        assert m[("kiln_broker_queued_jobs", "")] >= 1
        batch.communicate(timeout=120)
        assert batch.returncode == 0
        m = wait_for(port, lambda m: m[("kiln_broker_jobs_done_total", "")] == 3)
        assert m[("kiln_broker_jobs_submitted_total", "")] == 3
        assert m[("kiln_broker_job_build_seconds_count", "")] == 3
        # Each build slept 0.6 s: the histogram's sum says at least that.
        assert m[("kiln_broker_job_build_seconds_sum", "")] >= 3 * 0.6
        assert m[("kiln_broker_job_build_seconds_bucket", '{le="0.5"}')] == 0
        assert m[("kiln_broker_job_build_seconds_bucket", '{le="+Inf"}')] == 3
        assert m[("kiln_broker_job_queue_seconds_count", "")] == 3
        # One slot: the third job waited for two builds.
        assert m[("kiln_broker_job_queue_seconds_sum", "")] >= 0.6
        # The same again is a cache hit; a 2 MiB weight is uploaded in chunks.
        again = subprocess.run(farm.batch_argv(jobs, "--toolchain", "sleepy@1"),
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        big = big_model(tmp_path / "big.onnx", 2)
        built = farm.compile(big, tmp_path / "big.kar", "--toolchain", "sleepy@1")
        assert built.returncode == 0, built.stderr
        m = wait_for(port, lambda m: m[("kiln_broker_jobs_done_total", "")] == 4
                     and m[("kiln_broker_cache_hits_total", "")] == 3)
        # 3 + 3, and the big model's twice (before and after its upload).
        assert m[("kiln_broker_cache_lookups_total", "")] == 8
        assert abs(m[("kiln_broker_cache_hit_ratio", "")] - 3 / 8) < 1e-9
        assert m[("kiln_broker_upload_bytes_total", "")] >= 2 << 20
        # The store commits in the background: wait until page and status agree.
        st = farm.status()
        m = wait_for(port, lambda m: m[("kiln_broker_store_bytes", "")]
                     == farm.status()["cache"]["bytes"] > 2 << 20
                     and m[("kiln_broker_store_artifacts", "")] == 4)
        st = farm.status()
        assert m[("kiln_broker_store_artifacts", "")] == st["cache"]["artifacts"] == 4
        assert m[("kiln_broker_store_evictions_total", "")] == 0
        assert ("kiln_broker_info", '{broker="%s",protocol="2"}' % st["broker"]) in m
        # Only GET /metrics.
        for path, code in (("/", 404), ("/metrics/x", 404)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert e.value.code == code
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST"), timeout=10)
        assert e.value.code == 405
    finally:
        farm.stop()


def test_metrics_address_in_use_is_a_clear_error(tmp_path):
    port = free_port()
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    try:
        keydir = tmp_path / "key"
        subprocess.run([kiln_bin("kiln"), "keygen", "--out", keydir], check=True,
                       capture_output=True, timeout=30)
        proc = subprocess.run([kiln_bin("kiln-broker"), "--listen",
                               f"tcp://127.0.0.1:{free_port()}", "--state", tmp_path / "s",
                               "--key", keydir / "kiln.key", "--metrics", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 1
        assert f"--metrics: cannot listen on '127.0.0.1:{port}'" in proc.stderr
        bad = subprocess.run([kiln_bin("kiln-broker"), "--listen", "tcp://127.0.0.1:1",
                              "--state", tmp_path / "s", "--key", keydir / "kiln.key",
                              "--metrics", "nonsense"], capture_output=True, text=True,
                             timeout=30)
        assert bad.returncode == 1 and "--metrics 'nonsense' is not HOST:PORT" in bad.stderr
    finally:
        s.close()
