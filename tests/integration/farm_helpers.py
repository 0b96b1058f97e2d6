"""Helpers for the farm's integration tests (issue 4): a broker and
workers with any options, started and stopped by the test, tiny distinct
models, external toolchains made of a shell line, and bounded waits.

Every process started here belongs to a Farm, whose stop() (called by the
fixtures, also when a test fails) kills each one by its pid.  Every wait
is bounded in time.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from conftest import kiln_bin
from kiln.farm import free_port, stop_process, wait_for_port


def tiny_model(path, seed, size=4):
    """y = x + w, w a constant of `size` floats drawn from `seed`: each seed
    gives different weights, so a different graph digest."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(size).astype(np.float32)
    node = helper.make_node("Add", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node], f"tiny{seed}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])],
        [helper.make_tensor("w", TensorProto.FLOAT, [size], w.tolist())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def big_model(path, megabytes, seed=0):
    """y = x + w with w a constant of `megabytes` MiB (float32): a model
    whose weights must travel as chunks."""
    n = megabytes * (1 << 20) // 4
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    node = helper.make_node("Add", ["x", "w"], ["y"])
    init = helper.make_tensor("w", TensorProto.FLOAT, [n], w.tobytes(), raw=True)
    graph = helper.make_graph(
        [node], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def sleepy(seconds, name="sleepy", version="1"):
    """--toolchain spec: sleep, then hand the graph back as the output."""
    return f"{name}@{version}=sh -c 'sleep {seconds}; cp {{input}} {{output}}'"


@contextlib.contextmanager
def running_farm(workdir, **kw):
    """A Farm with its broker started, stopped (every process) on exit."""
    farm = Farm(workdir, **kw)
    farm.start_broker()
    try:
        yield farm
    finally:
        farm.stop()


def curve_certs(directory, trusted, untrusted=(), broker="the-broker"):
    """CurveZMQ certificates made with `kiln cert` in DIRECTORY/keys: the
    broker's, and one for each (name, role) of `trusted` and `untrusted`;
    the public halves of the trusted ones copied into DIRECTORY/trust (the
    secret halves stay behind).  Returns ({"broker": path, name: path},
    trust directory)."""
    keys, trust = os.path.join(str(directory), "keys"), os.path.join(str(directory), "trust")
    os.makedirs(trust, exist_ok=True)
    certs = {}
    for name, role in [(broker, "broker")] + list(trusted) + list(untrusted):
        subprocess.run([kiln_bin("kiln"), "cert", "--name", name, "--role", role, "--out", keys],
                       check=True, capture_output=True, timeout=30)
        certs["broker" if role == "broker" else name] = os.path.join(keys, name + ".cert")
    for name, _ in trusted:
        with open(certs[name], "rb") as src, \
                open(os.path.join(trust, name + ".cert"), "wb") as dst:
            dst.write(src.read())
    return certs, trust


@contextlib.contextmanager
def curve_farm(directory, workers=("w1",), clients=("alice",), untrusted_clients=(),
               broker="the-broker", name_workers=True):
    """A farm with CurveZMQ on loopback: certificates (curve_certs) for the
    broker, the workers and the clients (the untrusted ones left out of
    the broker's trust directory), the broker and every worker started
    with theirs (with --name as well unless name_workers is false, when
    the certificate names the worker), and the first client's environment
    (KILN_BROKER, KILN_CERT, KILN_BROKER_CERT) in farm.client_env, used by
    farm.status; yields the Farm once every worker has registered, with
    the certificates in farm.certs, and stops every process on exit."""
    certs, trust = curve_certs(
        directory, [(w, "worker") for w in workers] + [(c, "client") for c in clients],
        [(c, "client") for c in untrusted_clients], broker)
    farm = Farm(os.path.join(str(directory), "farm"), curve=(certs["broker"], trust))
    farm.certs = certs
    farm.client_env = {"KILN_BROKER": farm.endpoint, "KILN_CERT": certs[clients[0]],
                       "KILN_BROKER_CERT": certs["broker"]}
    try:
        farm.start_broker()
        for w in workers:
            farm.start_worker(w, "--cert", certs[w], "--broker-cert", certs["broker"],
                              named=name_workers)
        farm.wait_for_workers(len(workers))
        yield farm
    finally:
        farm.stop()


class Farm:
    """A broker and workers on loopback, each started with its own options."""

    def __init__(self, workdir, broker_args=(), curve=None):
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.broker_args = list(broker_args)
        self.curve = curve                     # (broker cert, trust dir) or None
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.state = os.path.join(self.workdir, "state")
        self.keydir = os.path.join(self.workdir, "farm-key")
        self.keyring = os.path.join(self.workdir, "keyring")
        self.broker = None
        self.workers = {}                      # name -> Popen
        self.worker_argv = {}                  # name -> argv, to restart
        self.others = []                       # other processes to stop
        self.wrap = []                         # argv prefix of broker and workers (prlimit)
        self.client_env = {}                   # what `kiln status` needs beside --broker (certs)

    # --- processes --------------------------------------------------------
    def _log(self, name):
        return open(os.path.join(self.workdir, name + ".log"), "ab")

    def start_broker(self, extra=()):
        if not os.path.exists(os.path.join(self.keydir, "kiln.key")):
            subprocess.run([kiln_bin("kiln"), "keygen", "--out", self.keydir], check=True,
                           capture_output=True, timeout=30)
            os.makedirs(self.keyring, exist_ok=True)
            with open(os.path.join(self.keydir, "kiln.pub"), "rb") as src, \
                    open(os.path.join(self.keyring, "farm.pub"), "wb") as dst:
                dst.write(src.read())
        listen = getattr(self, "endpoint_listen", None) or self.endpoint
        argv = [kiln_bin("kiln-broker"), "--listen", listen, "--state", self.state,
                "--key", os.path.join(self.keydir, "kiln.key"), "-v"]
        if self.curve:
            argv += ["--cert", self.curve[0], "--trust", self.curve[1]]
        log = self._log("broker")
        self.broker = subprocess.Popen(self.wrap + argv + self.broker_args + list(extra), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for_port(self.port, proc=self.broker)
        return self.broker

    def start_worker(self, name, *args, cache=True, named=True):
        """Start worker `name` (its log NAME.log); named=False leaves out
        --name, so that its certificate names it."""
        argv = [kiln_bin("kiln-worker"), "--broker", self.endpoint] + (
            ["--name", name] if named else [])
        if cache:
            argv += ["--cache", os.path.join(self.workdir, "cache-" + name)]
        argv += [str(a) for a in args]
        self.worker_argv[name] = argv
        return self._spawn_worker(name)

    def _spawn_worker(self, name):
        log = self._log(name)
        env = dict(os.environ, TMPDIR=self.workdir)
        proc = subprocess.Popen(self.wrap + self.worker_argv[name], stdout=log,
                                stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        log.close()
        self.workers[name] = proc
        return proc

    def restart_worker(self, name):
        return self._spawn_worker(name)

    def kill_worker(self, name, sig=signal.SIGKILL):
        proc = self.workers[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(timeout=10)

    def kill_broker(self, sig=signal.SIGKILL):
        if self.broker.poll() is None:
            os.killpg(self.broker.pid, sig)
        self.broker.wait(timeout=10)

    def spawn(self, argv, **kw):
        """A client process the farm stops at the end."""
        proc = subprocess.Popen([str(a) for a in argv], start_new_session=True, **kw)
        self.others.append(proc)
        return proc

    def stop(self):
        for proc in self.others:
            stop_process(proc)
        for proc in self.workers.values():
            stop_process(proc)
        stop_process(self.broker)

    # --- looking at it ----------------------------------------------------
    def log(self, name="broker"):
        path = os.path.join(self.workdir, name + ".log")
        if not os.path.exists(path):
            return ""
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.workdir)):
            if name.endswith(".log"):
                out.append(f"--- {name}\n" + self.log(name[:-4])[-6000:])
        return "\n".join(out)

    def wait_for_log(self, text, count=1, name="broker", timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log(name).count(text) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"'{text}' x{count} not in {name}.log within {timeout}s\n"
                             f"{self.logs()}")

    def status(self, *extra):
        proc = subprocess.run([kiln_bin("kiln"), "status", "--broker", self.endpoint, "--json",
                               *extra], capture_output=True, text=True, timeout=30,
                              env=dict(os.environ, **self.client_env))
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def wait_for_status(self, pred, timeout=30.0, what="the farm's state"):
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"{what} not reached within {timeout}s; last status {st}\n"
                             f"{self.logs()}")

    def wait_for_workers(self, n, timeout=30.0):
        return self.wait_for_status(lambda s: len(s["workers"]) >= n, timeout,
                                    f"{n} workers registered")

    # --- clients ------------------------------------------------------------
    def compile_argv(self, model, out, *extra):
        return [kiln_bin("kiln"), "compile", str(model), "-o", str(out), "--broker",
                self.endpoint, "--json", *[str(a) for a in extra]]

    def compile(self, model, out, *extra, timeout=120):
        return subprocess.run(self.compile_argv(model, out, *extra), capture_output=True,
                              text=True, timeout=timeout)

    def batch_argv(self, jobs_file, *extra):
        return [kiln_bin("kiln"), "batch", "--jobs", str(jobs_file), "--broker", self.endpoint,
                *[str(a) for a in extra]]


def write_jobs(path, jobs):
    """A jobs file for `kiln batch --jobs`: one JSON object per line."""
    with open(path, "w") as f:
        for job in jobs:
            f.write(json.dumps(job) + "\n")
    return str(path)


def batch_lines(stdout):
    """The per-job lines and the summary of `kiln batch` output."""
    jobs, summary = [], None
    for line in stdout.splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if "summary" in obj:
            summary = obj["summary"]
        else:
            jobs.append(obj)
    return jobs, summary


def shuffled(seq, seed):
    seq = list(seq)
    random.Random(seed).shuffle(seq)
    return seq
