"""Progress on a terminal (issue 16): `kiln compile` and `kiln batch`
under a pseudo-terminal show their phases on stderr (upload with bytes,
queue place, the worker, time and the farm's estimate from an earlier
build) and clear the line when they end; without a terminal, or with
--json or --quiet, nothing of it appears.  Real broker and worker on
loopback."""

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time

import pytest

from conftest import kiln_bin
from farm_helpers import Farm, big_model, sleepy, tiny_model, write_jobs

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

CLEAR = b"\r\x1b[K"


def run_pty(argv, timeout=120):
    """Run argv with stderr on a pseudo-terminal (120 columns) and stdout
    on a pipe; (returncode, stdout text, stderr bytes)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave, start_new_session=True)
    os.close(slave)
    err = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:          # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                err += chunk
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode()
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        os.close(master)
    return proc.returncode, out, err


@pytest.fixture
def farm(tmp_path):
    f = Farm(tmp_path / "farm")
    f.start_broker()
    f.start_worker("w1", "--slots", "1", "--toolchain", sleepy(2.0))
    f.wait_for_workers(1)
    try:
        yield f
    finally:
        f.stop()


def test_compile_shows_its_phases_on_a_terminal_and_nothing_elsewhere(farm, tmp_path):
    model = big_model(tmp_path / "big.onnx", 4)
    # Another job holds the only slot: ours is queued first.
    other = farm.spawn(farm.compile_argv(tiny_model(tmp_path / "o.onnx", 9), tmp_path / "o.kar",
                                         "--toolchain", "sleepy@1"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    farm.wait_for_log("sent to worker w1")
    argv = [kiln_bin("kiln"), "compile", model, "-o", tmp_path / "a.kar", "--broker",
            farm.endpoint, "--toolchain", "sleepy@1"]
    rc, out, err = run_pty(argv)
    other.wait(timeout=60)
    assert rc == 0, err
    assert out.strip().endswith(str(tmp_path / "a.kar"))
    assert b"kiln: importing and hashing" in err
    assert b"uploading weights" in err and b"of 4.0 MiB" in err, err
    assert b"queued, place 1 in your queue" in err, err
    assert b"compiling on w1" in err, err
    # The line was cleared at the end, and nothing else was left behind.
    assert err.endswith(CLEAR) and b"\n" not in err, err
    # The same graph with other arguments: the farm knows how long it takes.
    rc, out, err = run_pty(argv + ["--compiler-args", "--again"])
    assert rc == 0, err
    assert b"compiling on w1" in err and b"s left" in err, err
    # Built by kiln-cc, the 4 MiB of weights make an artifact that comes
    # apart, in chunks (kiln_client_get): its download is shown too.
    rc, out, err = run_pty([kiln_bin("kiln"), "compile", model, "-o", tmp_path / "c.kar",
                            "--broker", farm.endpoint])
    assert rc == 0, err
    assert re.search(rb"downloading the artifact (\S+ MiB) of \1 \(100%\)", err), err
    assert err.endswith(CLEAR) and b"\n" not in err, err
    # No terminal: no progress; --json and --quiet: none even on one.
    proc = subprocess.run([str(a) for a in argv + ["--compiler-args", "--pipe"]],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    for flag in ("--json", "--quiet"):
        rc, out, err = run_pty(argv + ["--compiler-args", "--x" + flag, flag])
        assert rc == 0 and err == b"", (flag, err)


def test_batch_shows_one_line_of_overall_progress(farm, tmp_path):
    models = [tiny_model(tmp_path / f"m{i}.onnx", 60 + i) for i in range(3)]
    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      [{"model": m, "output": str(tmp_path / f"o{i}.kar")}
                       for i, m in enumerate(models)])
    rc, out, err = run_pty(farm.batch_argv(jobs, "--toolchain", "sleepy@1"))
    assert rc == 0, err
    assert len(out.strip().splitlines()) == 4          # 3 jobs and the summary, intact
    assert b"kiln batch: 0/3 done" in err or b"queued" in err, err
    assert b"kiln batch: 3/3 done (0 cached, 0 failed)" in err, err
    assert b"ETA" in err
    assert err.endswith(CLEAR) and b"\n" not in err
    proc = subprocess.run(farm.batch_argv(jobs, "--toolchain", "sleepy@1"),
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == b""


PY_TRACE = """
import json, logging, sys, torch, kiln
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
broker, keyring = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU()).eval()
x = torch.rand(2, 256)
events = []
kiln.trace(model, x, broker=broker, keyring=keyring, progress=events.append)
print(json.dumps(events))
kiln.trace(model, x, broker=broker, keyring=keyring, compiler_args="--optlevel 1", progress=True)
kiln.trace(model, x, broker=broker, keyring=keyring, compiler_args="--optlevel 0")
"""


def test_kiln_trace_reports_progress_to_a_callback_or_logging_only_when_asked(farm, tmp_path):
    import json
    import sys
    from conftest import SRC
    env = dict(os.environ, KILN_CONFIG_DIR=str(tmp_path / "config"),
               PYTHONPATH=os.path.join(SRC, "python"))
    env.pop("KILN_PROGRESS", None)
    proc = subprocess.run([sys.executable, "-c", PY_TRACE, farm.endpoint, farm.keyring],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    events = json.loads(proc.stdout.strip().splitlines()[-1])
    phases = [e["phase"] for e in events]
    assert phases[-1] == "done" and "running" in phases, events
    assert any(e["phase"] == "upload" and e["sent_bytes"] == e["total_bytes"] > 0
               for e in events), events
    assert any(e.get("worker") == "w1" for e in events if e["phase"] == "running")
    # progress=True: one log line per phase; the default: none at all.
    logged = [l for l in proc.stderr.splitlines() if l.startswith("kiln.progress: ")]
    assert any(l.startswith("kiln.progress: compiling on w1") for l in logged), proc.stderr
    # (the third trace, with the default, would have doubled them)
    assert logged[-1] == "kiln.progress: done" and len(logged) <= 4, logged
