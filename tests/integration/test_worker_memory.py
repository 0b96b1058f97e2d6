"""Memory-aware placement (issue 14, build item 2): a compile stopped at
its worker's memory limit (--max-memory) is tried once more on a worker
that gives compiles more memory, and fails naming the limit when no
connected worker does.  Real broker and workers on loopback; the compile
is an external toolchain (a small Python script) that needs 768 MiB."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, tiny_model

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

EATER = """
import sys
block = bytearray(768 << 20)          # MemoryError under a 512 MiB address space
block[::4096] = b"x" * len(block[::4096])
open(sys.argv[1], "wb").write(b"built with %d MiB" % (len(block) >> 20))
"""


def _status(farm):
    proc = subprocess.run([kiln_bin("kiln"), "status", "--broker", farm.endpoint, "--json"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _wait_for_workers(farm, names, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = {w["name"]: w for w in _status(farm)["workers"]}
        if set(names) <= set(workers):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"workers {names} did not register within {timeout}s\n{farm.logs()}")


def test_a_compile_out_of_memory_is_retried_on_a_worker_with_more(tmp_path):
    script = tmp_path / "eater.py"
    script.write_text(EATER)
    toolchain = ["--toolchain", f"eater@1=/usr/bin/python3 {script} {{output}}"]
    farm = Farm(tmp_path / "farm", broker_args=["--cross-check", "off"])
    try:
        farm.start_broker()
        # The small worker has more free slots, so it is picked first.
        farm.start_worker("small", "--max-memory", "512M", "--slots", "2", *toolchain)
        farm.start_worker("big", "--max-memory", "3G", "--slots", "1", *toolchain)
        workers = _wait_for_workers(farm, ["small", "big"])
        assert workers["small"]["max_memory"] == 512 << 20
        assert workers["big"]["max_memory"] == 3 << 30

        model = tiny_model(tmp_path / "m.onnx", 7)
        proc = farm.compile(model, tmp_path / "m.kar", "--toolchain", "eater@1", timeout=180)
        assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
        assert json.loads(proc.stdout)["worker"] == "big"
        workers = {w["name"]: w for w in _status(farm)["workers"]}
        assert workers["small"]["failed"] == 1, workers
        assert workers["big"]["done"] == 1, workers

        # With only workers that give too little, the client is told the limit.
        farm.kill_worker("big", signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "big" in {w["name"] for w in _status(farm)["workers"]}:
            assert time.monotonic() < deadline, farm.logs()
            time.sleep(0.1)
        other = tiny_model(tmp_path / "n.onnx", 8)
        proc = farm.compile(other, tmp_path / "n.kar", "--toolchain", "eater@1", timeout=180)
        assert proc.returncode != 0
        assert "ran out of its 512 MiB memory limit (--max-memory)" in proc.stderr, proc.stderr
        assert not (tmp_path / "n.kar").exists()
    finally:
        farm.stop()
