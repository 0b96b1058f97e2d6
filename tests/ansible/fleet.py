"""The controller's side of the ansible test: ansible-playbook against the
hosts of a netns_hosts.Lab, the kiln CLI against the farm those hosts
run, a release key, and small models with known outputs.

Every command has a timeout; playbook output is kept in the work
directory (one log per run) and its PLAY RECAP parsed.
"""

import io
import json
import os
import re
import subprocess
import tarfile
import time
import urllib.error
import urllib.request

import numpy as np

SRC = os.environ.get("KILN_SRC", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
ANSIBLE_DIR = os.path.join(SRC, "ansible")

RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)"
                   r"\s+skipped=(\d+)\s+rescued=(\d+)\s+ignored=(\d+)")


class PlaybookRun:
    def __init__(self, name, rc, output, seconds):
        self.name = name
        self.rc = rc
        self.output = output
        self.seconds = seconds
        self.recap = {}
        for line in output.splitlines():
            m = RECAP.match(line.strip())
            if m:
                keys = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
                self.recap[m.group(1)] = dict(zip(keys, map(int, m.groups()[1:])))

    def tail(self, n=60):
        return "\n".join(self.output.splitlines()[-n:])

    def batches(self):
        """The hosts of each serial batch, in order: a play's header opens
        a batch, and the hosts named in its task results belong to it."""
        batches = []
        for chunk in re.split(r"^PLAY \[.*$", self.output, flags=re.M)[1:]:
            hosts = []
            for m in re.finditer(r"^(?:ok|changed|fatal|skipping|included): \[([^\]\s]+)", chunk,
                                 flags=re.M):
                if m.group(1) not in hosts and m.group(1) != "localhost":
                    hosts.append(m.group(1))
            if hosts:
                batches.append(hosts)
        return batches


class Fleet:
    def __init__(self, lab, workdir):
        self.lab = lab
        self.work = str(workdir)
        self.pki = os.path.join(self.work, "pki")          # what the roles fetch
        self.keys = os.path.join(self.work, "keys")        # the controller's own
        self.models = os.path.join(self.work, "models")
        self.logs = os.path.join(self.work, "logs")
        for d in (self.pki, self.keys, self.models, self.logs):
            os.makedirs(d, exist_ok=True)
        self.runs = []
        self.dist = os.environ.get("KILN_DIST", os.path.join(SRC, "build", "dist",
                                                             "kiln-linux-x86_64.tar.gz"))
        self.broker_ip = lab.hosts["broker"].address
        self.endpoint = f"tcp://{self.broker_ip}:7400"
        # The controller's identities: a CurveZMQ client certificate the
        # broker trusts, and the release key (never on any host).
        self.kiln("cert", "--name", "deployer", "--role", "client", "--out",
                  os.path.join(self.keys, "certs"))
        self.client_cert = os.path.join(self.keys, "certs", "deployer.cert")
        self.kiln("keygen", "--out", os.path.join(self.keys, "release"))
        self.release_key = os.path.join(self.keys, "release", "kiln.key")
        self.release_pub = os.path.join(self.keys, "release", "kiln.pub")
        self._write_config()

    # --- ansible ----------------------------------------------------------

    def _write_config(self):
        self.inventory = os.path.join(self.work, "inventory.ini")
        # worker2 also offers an external toolchain for another target: the
        # test builds a release for a target the inference hosts refuse.
        self.lab.write_inventory(self.inventory, host_vars={
            "worker2": {"kiln_worker_toolchains": "'[\"passthru@1=cp {input} {output}\"]'",
                        "kiln_worker_target": "riscv64-test"}})
        self.vars_file = os.path.join(self.work, "vars.json")
        with open(self.vars_file, "w") as f:
            json.dump({
                "kiln_dist_tarball": self.dist,
                "kiln_pki_dir": self.pki,
                # The hosts' root is the machine's own, with every library
                # already installed; apt would only be asked to confirm it.
                "kiln_install_packages": False,
                "kiln_broker_trusted_certs": [self.client_cert],
                "kiln_runtime_release_keyring_files": [self.release_pub],
                "kiln_runtime_replicas": 2,
                # Room for the test's models, not for wide_mlp_onnx's arena.
                "kiln_runtime_memory_limit_mb": 2048,
                "kiln_worker_slots": 1,
                "kiln_broker_health_timeout": 30,
                "kiln_worker_health_timeout": 30,
                "kiln_runtime_ready_timeout": 30,
                "kiln_artifact_kiln": os.path.join(BIN, "kiln"),
                "kiln_artifact_broker": self.endpoint,
                "kiln_artifact_cert": self.client_cert,
                "kiln_artifact_broker_cert": os.path.join(self.pki, "broker.cert"),
                "kiln_artifact_cache_dir": os.path.join(self.work, "artifacts"),
                "kiln_artifact_gate_timeout": 30,
            }, f, indent=1)
        self.cfg = os.path.join(self.work, "ansible.cfg")
        with open(self.cfg, "w") as f:
            f.write("[defaults]\n"
                    f"roles_path = {os.path.join(ANSIBLE_DIR, 'roles')}\n"
                    f"inventory = {self.inventory}\n"
                    "interpreter_python = /usr/bin/python3\n"
                    "retry_files_enabled = false\n"
                    "forks = 10\n"
                    "timeout = 30\n"
                    "host_key_checking = true\n"
                    f"local_tmp = {os.path.join(self.work, 'ansible-tmp')}\n"
                    "[ssh_connection]\n"
                    "pipelining = true\n"
                    f"control_path_dir = {self.lab.control_dir}\n"
                    "ssh_args = -o ControlMaster=auto -o ControlPersist=60s "
                    + " ".join(self.lab.ssh_options()) + "\n")

    def playbook(self, name, timeout=900, flags=(), **extra):
        """Run ansible/NAME against the lab (with ansible-playbook `flags`);
        returns a PlaybookRun."""
        argv = ["ansible-playbook", os.path.join(ANSIBLE_DIR, name), *flags, "-e", "@" + self.vars_file]
        for k, v in extra.items():
            argv += ["-e", json.dumps({k: v})]
        env = dict(os.environ, ANSIBLE_CONFIG=self.cfg, ANSIBLE_HOME=os.path.join(self.work, "ansible-home"),
                   ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, env=env, cwd=self.work)
            rc, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = -1, (e.stdout or b"").decode(errors="replace") + f"\n(timed out after {timeout} s)"
        run = PlaybookRun(name, rc, out, time.monotonic() - t0)
        self.runs.append(run)
        with open(os.path.join(self.logs, f"{len(self.runs):02d}-{name}.log"), "w") as f:
            f.write(out)
        return run

    # --- kiln on the controller --------------------------------------------

    def kiln(self, *args, timeout=120, check=True):
        proc = subprocess.run([os.path.join(BIN, "kiln")] + [str(a) for a in args],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kiln {' '.join(map(str, args))} exited {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def farm_args(self):
        return ["--broker", self.endpoint, "--cert", self.client_cert,
                "--broker-cert", os.path.join(self.pki, "broker.cert")]

    def status(self):
        return json.loads(self.kiln("status", "--json", *self.farm_args()).stdout)

    def compile(self, onnx, out, *extra):
        proc = self.kiln("compile", onnx, "-o", out, "--json", "--wait", "120", *extra,
                         *self.farm_args(), timeout=180)
        return json.loads(proc.stdout)

    def release(self, kar, seq, out, model="mlp", expires="1d"):
        self.kiln("release", "sign", kar, "--model", model, "--seq", seq, "--key",
                  self.release_key, "--expires", expires, "-o", out)
        return out

    # --- the inference hosts over HTTP --------------------------------------

    def url(self, host):
        return f"http://{self.lab.hosts[host].address}:8000"

    def served(self, host, model="mlp"):
        with urllib.request.urlopen(f"{self.url(host)}/v2/models/{model}", timeout=10) as r:
            return json.load(r)["kiln"]

    def infer(self, host, x, model="mlp"):
        body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "data": x.ravel().tolist()}]}).encode()
        req = urllib.request.Request(f"{self.url(host)}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            out = json.load(r)["outputs"][0]
        return np.array(out["data"], dtype=np.float32).reshape(out["shape"])

    def ready(self, host):
        try:
            with urllib.request.urlopen(f"{self.url(host)}/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


# --- models ------------------------------------------------------------------

def mlp_weights(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32),
            rng.standard_normal((16, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32))


def mlp_onnx(path, seed):
    """y = relu(x W1 + b1) W2 + b2 for x of shape [1, 8]; weights from
    `seed`, so each seed is a different model with the same interface."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w1, b1, w2, b2 = mlp_weights(seed)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["y"])]
    graph = helper.make_graph(
        nodes, f"mlp{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def mlp_expected(seed, x):
    w1, b1, w2, b2 = mlp_weights(seed)
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def tamper(kar, out, member="weights.bin"):
    """A copy of `kar` with one bit of `member` flipped: the manifest (and
    so the content hash the release names) is unchanged."""
    with tarfile.open(kar) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == member:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x01
                data = bytes(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out


def wide_mlp_onnx(path, seed, wide_log2=30):
    """mlp_onnx(seed)'s interface and outputs, plus a branch that tiles x to
    2**wide_log2 floats (4 GiB at 30) and adds 0 * their sum: its arena
    does not fit an inference host with a smaller address-space limit, so
    kiln-serve cannot bring it up there."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w1, b1, w2, b2 = mlp_weights(seed)
    repeats = np.array([1, 1 << (wide_log2 - 3)], dtype=np.int64)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["h4"]),
             helper.make_node("Tile", ["x", "repeats"], ["wide"]),
             helper.make_node("ReduceSum", ["wide"], ["total"], keepdims=1),
             helper.make_node("Mul", ["total", "zero"], ["nothing"]),
             helper.make_node("Add", ["h4", "nothing"], ["y"])]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    inits += [numpy_helper.from_array(repeats, "repeats"),
              numpy_helper.from_array(np.zeros((1, 1), np.float32), "zero")]
    graph = helper.make_graph(
        nodes, f"wide{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)
