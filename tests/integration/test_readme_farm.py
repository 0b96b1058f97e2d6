"""README.md's "Running a farm across hosts" section and its Python section
run as written, start to finish, every host on this machine over loopback
(issue 16).

The commands come from README.md itself, never from a copy: every fenced
```sh block of the farm section, in order, then the marked ```python block
of "Python: kiln.trace" with the client's environment that the farm section
exported.  Each command runs in bash, in a fresh HOME that is also the
working directory of every "host".  What is changed, and why (nothing
else is):

- Host names and ports.  Every HOST:PORT (`tcp://broker:7400`,
  `tcp://0.0.0.0:7400`, `0.0.0.0:8000`, `inference-host:8000`) becomes
  127.0.0.1 and a free port, one per README port: every host is this
  machine, other tests run at the same time (a fixed port would collide),
  and a test listens on loopback only.
- `scp`.  With every host this machine, `HOST:PATH` is PATH, so `scp` is a
  shell function that copies with cp, and a copy of a file onto itself
  (the same path on "another host") does nothing.
- System directories.  /etc/kiln, /var/lib/kiln, /var/cache/kiln and
  /srv/kiln are under the test's temporary directory (ROOT/etc/kiln, ...):
  a test may not write /etc.
- Placeholders the reader fills in from earlier output: FINGERPRINT is the
  fingerprint the first `kiln keygen` (step 1, the farm key) printed,
  DIGEST the "artifact" that `kiln compile --json` printed.
- `make install`: PATH is the build's bin directory, then /usr/bin:/bin
  (Debian's python3, as README assumes), and Python finds the package and
  libraries of the build (PYTHONPATH, KILN_LIB, KILN_BIN).

kiln-broker, kiln-worker and kiln-serve run in the foreground in README;
here each starts in the background (waited for until it listens, when it
listens) and is stopped at the end, also when the test fails.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import textwrap
import time
import urllib.request

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from conftest import BIN, SRC
from kiln.farm import free_port, stop_process, wait_for_port

DAEMONS = ("kiln-broker", "kiln-worker", "kiln-serve")
SYSTEM_DIRS = r"(?<![\w./])/(etc/kiln|var/lib/kiln|var/cache/kiln|srv/kiln)\b"
HOST_PORT = r"\b(?:[A-Za-z][\w.-]*|\d+\.\d+\.\d+\.\d+):(\d{2,5})\b"

# Given to every command: scp between "hosts" that are all this machine.
SCP = r'''
scp() {
  local a args=()
  for a in "$@"; do
    case $a in -*) echo "scp $a: the README test knows no scp options" >&2; return 2;; esac
    [[ $a =~ ^[A-Za-z][A-Za-z0-9.-]*:(.*)$ ]] && a=${BASH_REMATCH[1]:-.}
    args+=("$a")
  done
  local dst=${args[-1]} src to
  for src in "${args[@]:0:${#args[@]}-1}"; do
    to=$dst; [ -d "$dst" ] && to=$dst/$(basename "$src")
    [ "$src" -ef "$to" ] || cp "$src" "$to" || return 1
  done
}
'''


def readme_blocks():
    """The farm section's shell commands (one string each, in order) and
    the Python section's marked block."""
    text = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    sec = re.search(r"^## Running a farm across hosts\n(.*?)^## ", text, re.S | re.M)
    assert sec, "README.md lost its section 'Running a farm across hosts'"
    commands = []
    for block in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```", sec.group(1), re.S | re.M):
        for line in textwrap.dedent(block).replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    assert commands, "README.md's farm section has no ```sh blocks"
    py = re.search(r"<!-- readme-python: begin -->\s*```python\n(.*?)```\s*"
                   r"<!-- readme-python: end -->", text, re.S)
    assert py, "README.md lost its marked Python block"
    return commands, py.group(1)


class Hosts:
    """Runs README's commands as the hosts would, on this machine."""

    def __init__(self, tmp):
        self.home = tmp / "home"
        self.root = tmp / "root"
        self.home.mkdir()
        self.root.mkdir()
        self.envfile = tmp / "exports.sh"
        self.ports = {}        # README's port -> the free loopback port here
        self.values = {}       # placeholder -> the value printed earlier
        self.daemons = []      # (name, Popen, log path)
        self.outputs = []      # (command as run, stdout)
        self.env = {"HOME": str(self.home), "PATH": f"{BIN}:/usr/bin:/bin",
                    "LANG": "C.UTF-8", "TMPDIR": str(tmp)}

    def localise(self, cmd):
        cmd = re.sub(SYSTEM_DIRS, lambda m: f"{self.root}/{m.group(1)}", cmd)
        cmd = re.sub(HOST_PORT, lambda m: "127.0.0.1:%d" % self.ports.setdefault(
            m.group(1), free_port()), cmd)
        for name in ("FINGERPRINT", "DIGEST"):
            if re.search(rf"\b{name}\b", cmd):
                assert name in self.values, f"README uses {name} before printing it: {cmd}"
                cmd = re.sub(rf"\b{name}\b", self.values[name], cmd)
        return cmd

    def _script(self, cmd, exec_=False):
        return (SCP + f"[ -f {self.envfile} ] && source {self.envfile}\nset -e\n"
                + ("exec " + cmd if exec_ else f"{cmd}\nexport -p > {self.envfile}\n"))

    def run(self, readme_cmd):
        cmd = self.localise(readme_cmd)
        if shlex.split(cmd)[0] in DAEMONS and "--check-store" not in cmd:
            return self.start(cmd)
        try:
            res = subprocess.run(["bash", "-c", self._script(cmd)], cwd=self.home,
                                 env=self.env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"README's `{readme_cmd}` (run as `{cmd}`) did not finish "
                                 f"in {e.timeout} s\n{e.stdout}\n{e.stderr}\n{self.logs()}")
        assert res.returncode == 0, (f"README's `{readme_cmd}` (run as `{cmd}`) exited "
                                     f"{res.returncode}\n{res.stdout}\n{res.stderr}\n{self.logs()}")
        self.outputs.append((cmd, res.stdout))
        fp = re.search(r"fingerprint SHA256:([0-9a-f]{64})", res.stdout)
        if cmd.startswith("kiln keygen") and fp:
            self.values.setdefault("FINGERPRINT", fp.group(1))
        if cmd.startswith("kiln compile") and "--json" in cmd:
            self.values["DIGEST"] = json.loads(res.stdout)["artifact"]

    def start(self, cmd):
        name = shlex.split(cmd)[0]
        log = self.home.parent / f"{name}-{len(self.daemons)}.log"
        proc = subprocess.Popen(["bash", "-c", self._script(cmd, exec_=True)], cwd=self.home,
                                env=self.env, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append((name, proc, log))
        listen = re.search(r"--listen (?:tcp://)?127\.0\.0\.1:(\d+)", cmd)
        if listen:
            wait_for_port(int(listen.group(1)), timeout=30, proc=proc)
        if name == "kiln-serve":
            url = f"http://127.0.0.1:{listen.group(1)}/v2/health/ready"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if urllib.request.urlopen(url, timeout=2).status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, \
                    f"kiln-serve never became ready\n{self.logs()}"
                time.sleep(0.1)

    def exported(self):
        """The environment after every command so far (README's exports)."""
        out = subprocess.run(["bash", "-c", f"source {self.envfile}; env -0"],
                             env=self.env, capture_output=True, check=True).stdout
        return dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)

    def output(self, prefix):
        return [out for cmd, out in self.outputs if cmd.startswith(prefix)]

    def logs(self):
        return "\n".join(f"--- {name}\n" + open(log, errors="replace").read()[-3000:]
                         for name, _, log in self.daemons)

    def stop(self):
        for _, proc, _ in reversed(self.daemons):
            stop_process(proc)


def linear_of(model_onnx, x):
    """What torch computes for README's model (an nn.Linear exported to
    ONNX) on x, from the weights the file holds."""
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(model_onnx).graph.initializer}
    w = next(torch.from_numpy(a.copy()) for a in inits.values() if a.ndim == 2)
    b = next(torch.from_numpy(a.copy()) for a in inits.values() if a.ndim == 1)
    return torch.nn.functional.linear(torch.from_numpy(np.asarray(x, np.float32)), w, b).numpy()


def test_readme_farm_and_python_sections_run_as_written_on_loopback(tmp_path):
    commands, python_code = readme_blocks()
    hosts = Hosts(tmp_path)
    try:
        for cmd in commands:
            hosts.run(cmd)
        home = hosts.home
        running = {name for name, proc, _ in hosts.daemons if proc.poll() is None}
        assert running == set(DAEMONS), f"not running: {hosts.logs()}"

        # Step 5: the farm's key pinned by fingerprint, the model built on
        # the farm by the worker its certificate names.
        farm_pub = (hosts.root / "etc/kiln/farm/kiln.pub").read_bytes()
        pinned = glob.glob(str(home / ".config/kiln/keyring/farm-*.pub"))
        assert [open(p, "rb").read() for p in pinned] == [farm_pub]
        built = json.loads(hosts.output("kiln compile")[-1])
        assert (built["worker"], built["cached"], built["fallback"]) == ("w1", False, False)
        assert (home / "model.kar").is_file()

        # Step 6: verified, and kiln-run's output is torch's.
        assert hosts.output("kiln verify"), "README's step 6 no longer runs kiln verify"
        x = np.load(home / "x.npy")
        want = linear_of(str(home / "model.onnx"), x)
        np.testing.assert_allclose(np.load(home / "out" / "y.npy"), want, rtol=1e-5, atol=1e-6)

        # Step 7: kiln-serve answers with the same numbers, from the release.
        reply = json.loads(hosts.output("curl")[-1])
        assert reply["model_name"] == "linear" and reply["model_version"] == "1"
        served = np.asarray(reply["outputs"][0]["data"], np.float32).reshape(want.shape)
        np.testing.assert_allclose(served, linear_of(str(home / "model.onnx"), [[0, 1, 2, 3]]),
                                   rtol=1e-5, atol=1e-6)

        # The Python section, as alice, with what step 5 exported: it
        # compiles on the farm, and its own asserts compare with torch.
        env = hosts.exported()
        assert env.get("KILN_BROKER", "").startswith("tcp://127.0.0.1:")
        env.update(PYTHONPATH=os.path.join(SRC, "python"), KILN_BIN=BIN,
                   KILN_LIB=os.environ.get("KILN_LIB", os.path.join(os.path.dirname(BIN), "lib")))
        res = subprocess.run(["/usr/bin/python3", "-c", python_code], cwd=home, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr + hosts.logs()
        assert "torch.Size([5, 1000])" in res.stdout, res.stdout
        assert (home / "model.pt").is_file()
        status = subprocess.run([os.path.join(BIN, "kiln"), "status", "--json"], env=env,
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        jobs = json.loads(status.stdout)["jobs"]
        assert jobs["done"] >= 2, jobs      # README's model and resnet18, both on the farm
    finally:
        hosts.stop()
