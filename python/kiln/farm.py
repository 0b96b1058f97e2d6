"""Start and stop a kiln farm (a broker and N workers) on this machine.

A LocalFarm owns the processes it starts: `stop()` (or leaving the `with`
block) kills every one of them, also when the code inside failed.  Ports
are chosen free on 127.0.0.1; every wait is bounded in time.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, timeout=10.0, proc=None):
    """Wait until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout}s")


class LocalFarm:
    """A kiln-broker and `workers` kiln-workers on loopback.

    bindir: directory with kiln-broker, kiln-worker, kiln.
    workdir: where state, keys and logs go (a fresh temp dir by default;
    removed on stop unless given by the caller).
    """

    def __init__(self, bindir, workers=2, workdir=None, worker_args=()):
        self.bindir = os.path.abspath(bindir)
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kiln-farm-")
        self.n_workers = workers
        self.worker_args = list(worker_args)
        self.port = None
        self.endpoint = None
        self.broker = None
        self.workers = []
        self.keydir = os.path.join(self.workdir, "farm-key")
        self.keyring = os.path.join(self.workdir, "keyring")
        self.state = os.path.join(self.workdir, "state")

    def _bin(self, name):
        return os.path.join(self.bindir, name)

    def _log(self, name):
        return open(os.path.join(self.workdir, name + ".log"), "ab")

    def start(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self):
        if not os.path.exists(os.path.join(self.keydir, "kiln.key")):
            subprocess.run([self._bin("kiln"), "keygen", "--out", self.keydir],
                           check=True, capture_output=True, timeout=30)
        os.makedirs(self.keyring, exist_ok=True)
        shutil.copy(os.path.join(self.keydir, "kiln.pub"),
                    os.path.join(self.keyring, "farm.pub"))
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.start_broker()
        for i in range(self.n_workers):
            self.start_worker(f"worker-{i + 1}")

    def start_broker(self):
        """Start (or restart) the broker on the farm's port and state dir."""
        self.broker = subprocess.Popen(
            [self._bin("kiln-broker"), "--listen", self.endpoint,
             "--state", self.state, "--key", os.path.join(self.keydir, "kiln.key")],
            stdout=self._log("broker"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_for_port(self.port, proc=self.broker)
        return self.broker

    def start_worker(self, name):
        proc = subprocess.Popen(
            [self._bin("kiln-worker"), "--broker", self.endpoint, "--name", name]
            + self.worker_args,
            stdout=self._log(name), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.workers.append(proc)
        return proc

    def logs(self):
        """Every log the farm wrote, as one string (for failure messages)."""
        text = []
        for name in sorted(os.listdir(self.workdir)):
            if name.endswith(".log"):
                with open(os.path.join(self.workdir, name), "rb") as f:
                    text.append(f"--- {name}\n" + f.read().decode(errors="replace")[-4000:])
        return "\n".join(text)

    @staticmethod
    def _kill(proc):
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)

    def stop(self):
        for proc in self.workers:
            self._kill(proc)
        self.workers = []
        self._kill(self.broker)
        self.broker = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def stop_process(proc):
    """Stop `proc` and its process group (SIGTERM, then SIGKILL after 5 s):
    what LocalFarm.stop does to each of its processes, for code that starts
    its own.  Nothing when `proc` is None or has already exited."""
    LocalFarm._kill(proc)
