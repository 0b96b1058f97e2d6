"""Real hosts on one machine for the ansible test: each host is

  * a network namespace with its own address on a bridge (10.77.0.0/24 by
    default; the controller, this process, is 10.77.0.1 on the bridge),
  * its own mount namespace whose root is an overlayfs over the machine's
    "/" with a private writable upper layer (so /etc, /var, /opt, /usr
    ... are the host's own: what one host's roles write, no other host and
    not the controller sees), with private /tmp, /run and an empty /work
    (the source tree is not visible: programs must come from the roles),
  * its own PID and UTS namespaces: PID 1 is tests/ansible/hostinit.py,
    which runs sshd and reaps orphans, and the host name is its own,
  * an sshd listening on the host's address with a host key made for this
    run and the controller's public key authorised for root.

ansible-playbook reaches them over real SSH with host-key checking against
a known_hosts file written from the generated keys.

Needs root.  Everything it makes has the run's prefix in its name and is
removed by `stop()`, which is safe to call after a partial start; a lock
serialises runs on one machine, and `reap_leftovers()` removes what a
killed run left behind.  Every wait is bounded.
"""

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LOCK_PATH = "/run/kiln-ansible-test.lock"
PREFIX = "kilnt"          # names of namespaces, links, the bridge


def sh(argv, check=True, timeout=30, **kw):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def reap_leftovers():
    """Remove namespaces and links named with PREFIX that a killed run left."""
    for line in sh(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX + "-"):
            for pid in sh(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh(["ip", "netns", "del", name], check=False)
    for line in sh(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            link = parts[1].strip().split("@")[0]
            if link.startswith(PREFIX):
                sh(["ip", "link", "del", link], check=False)


def can_run():
    """(True, "") when this machine can make the hosts, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "pivot_root", "/usr/sbin/sshd", "ssh", "ssh-keygen",
                 "ansible-playbook"):
        if not shutil.which(tool):
            return False, f"{tool} is not installed (make deps)"
    return True, ""


class Host:
    def __init__(self, name, address, groups):
        self.name = name
        self.address = address
        self.groups = groups
        self.proc = None            # the `unshare` process; its child is PID 1
        self.root = None            # the host's overlay directories
        self.host_key_pub = None

    @property
    def netns(self):
        return f"{PREFIX}-{self.name}"


class Lab:
    """The hosts of one test run.  `start()` then `stop()`, always."""

    def __init__(self, workdir, hosts, subnet="10.77.0"):
        self.workdir = os.path.abspath(str(workdir))
        self.subnet = subnet
        self.bridge = f"{PREFIX}-br"
        self.hosts = {}
        for i, (name, groups) in enumerate(hosts):
            self.hosts[name] = Host(name, f"{subnet}.{10 + i}", groups)
        self.roots = os.path.join(self.workdir, "roots")
        self.ssh_dir = os.path.join(self.workdir, "ssh")
        self.key = os.path.join(self.ssh_dir, "id_ed25519")
        self.known_hosts = os.path.join(self.ssh_dir, "known_hosts")
        self.control_dir = os.path.join(self.workdir, "cp")
        self._lock = None
        self._mounted = False

    # --- bring-up ---------------------------------------------------------

    def start(self, timeout=30):
        self._lock = open(LOCK_PATH, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(f"another ansible test run holds {LOCK_PATH}")
        reap_leftovers()
        os.makedirs(self.roots, exist_ok=True)
        os.makedirs(self.ssh_dir, exist_ok=True)
        os.makedirs(self.control_dir, exist_ok=True)
        # The hosts' upper layers live on a tmpfs: never inside the lower
        # layer ("/"), and gone with one umount.
        sh(["mount", "-t", "tmpfs", "-o", "mode=0755,size=4g", f"{PREFIX}-roots", self.roots])
        self._mounted = True
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kiln-ansible-test",
            "-f", self.key])
        sh(["ip", "link", "add", self.bridge, "type", "bridge"])
        sh(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        sh(["ip", "link", "set", self.bridge, "up"])
        for host in self.hosts.values():
            self._make_root(host)
            self._make_network(host)
            self._boot(host)
        with open(self.known_hosts, "w") as f:
            for host in self.hosts.values():
                f.write(f"{host.address} {host.host_key_pub}\n")
        deadline = time.monotonic() + timeout
        for host in self.hosts.values():
            self._wait_ssh(host, deadline)

    def _make_root(self, host):
        host.root = os.path.join(self.roots, host.name)
        upper = os.path.join(host.root, "upper")
        for d in ("upper", "work", "merged"):
            os.makedirs(os.path.join(host.root, d))
        for d in ("etc/ssh", "root/.ssh", "usr/local/sbin", "var/log"):
            os.makedirs(os.path.join(upper, d), exist_ok=True)
        os.chmod(os.path.join(upper, "root/.ssh"), 0o700)
        # A fresh /root and /home: opaque directories hide the machine's
        # own (its shell start-up files, its credentials) from the host.
        os.makedirs(os.path.join(upper, "home"), exist_ok=True)
        for d in ("root", "home"):
            os.setxattr(os.path.join(upper, d), "trusted.overlay.opaque", b"y")
        os.chmod(os.path.join(upper, "root"), 0o700)
        for f in (".bashrc", ".profile"):
            if os.path.exists(os.path.join("/etc/skel", f)):
                shutil.copy(os.path.join("/etc/skel", f), os.path.join(upper, "root", f))
        key = os.path.join(upper, "etc/ssh/ssh_host_ed25519_key")
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", key])
        with open(key + ".pub") as f:
            host.host_key_pub = " ".join(f.read().split()[:2])
        with open(os.path.join(upper, "etc/ssh/sshd_config"), "w") as f:
            f.write(f"# kiln ansible test host {host.name}\n"
                    f"ListenAddress {host.address}\n"
                    "HostKey /etc/ssh/ssh_host_ed25519_key\n"
                    "PermitRootLogin prohibit-password\n"
                    "PubkeyAuthentication yes\n"
                    "PasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\n"
                    "UsePAM no\n"
                    "MaxStartups 100:30:200\n"
                    "MaxSessions 50\n"
                    "AcceptEnv LANG LC_*\n"
                    "Subsystem sftp /usr/lib/openssh/sftp-server\n")
        shutil.copy(self.key + ".pub", os.path.join(upper, "root/.ssh/authorized_keys"))
        os.chmod(os.path.join(upper, "root/.ssh/authorized_keys"), 0o600)
        with open(os.path.join(upper, "etc/hostname"), "w") as f:
            f.write(host.name + "\n")
        with open(os.path.join(upper, "etc/hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            for other in self.hosts.values():
                f.write(f"{other.address} {other.name}\n")
        shutil.copy(os.path.join(HERE, "hostinit.py"),
                    os.path.join(upper, "usr/local/sbin/kiln-test-init"))
        os.chmod(os.path.join(upper, "usr/local/sbin/kiln-test-init"), 0o755)

    def _make_network(self, host):
        veth = f"{PREFIX}-{host.name}"[:15]
        sh(["ip", "netns", "add", host.netns])
        sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
            "netns", host.netns])
        sh(["ip", "link", "set", veth, "master", self.bridge, "up"])
        sh(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        sh(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
        sh(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    def _boot(self, host):
        """Start the host: new mount, PID, UTS and IPC namespaces inside its
        network namespace; the overlay becomes its root; PID 1 is hostinit."""
        r = host.root
        m = f"{r}/merged"
        setup = " && ".join([
            "set -e",
            f"mount -t overlay overlay -o lowerdir=/,upperdir={r}/upper,workdir={r}/work {m}",
            f"mount --rbind /dev {m}/dev",
            f"mount -t proc proc {m}/proc",
            f"mount -t sysfs sysfs {m}/sys",
            f"mount -t tmpfs -o mode=1777 tmpfs {m}/tmp",
            f"mount -t tmpfs -o mode=0755 tmpfs {m}/run",
            f"mount -t tmpfs -o mode=0755 tmpfs {m}/work",
            f"mkdir -p {m}/run/sshd {m}/.oldroot",
            f"cd {m}",
            "pivot_root . .oldroot",
            "umount -l /.oldroot",
            "rmdir /.oldroot",
            f"hostname {host.name}",
            "exec /usr/bin/python3 /usr/local/sbin/kiln-test-init",
        ])
        log = open(os.path.join(self.workdir, f"host-{host.name}.log"), "w")
        host.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--pid", "--uts", "--ipc",
             "--fork", "--kill-child", "--propagation", "private", "sh", "-c", setup],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def _wait_ssh(self, host, deadline):
        while True:
            if host.proc.poll() is not None:
                raise RuntimeError(f"host {host.name} stopped while starting: "
                                   f"{self.host_log(host.name)}")
            try:
                with socket.create_connection((host.address, 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} ({host.address}) did not answer")
            time.sleep(0.1)

    # --- use ----------------------------------------------------------------

    def host_log(self, name):
        try:
            with open(os.path.join(self.workdir, f"host-{name}.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def ssh_options(self):
        return ["-i", self.key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]

    def ssh(self, name, command, timeout=60, check=False):
        host = self.hosts[name]
        proc = subprocess.run(["ssh"] + self.ssh_options() + [f"root@{host.address}", command],
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"on {name}: {command} exited {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def write_inventory(self, path, host_vars=None, group_vars=None):
        """An INI inventory of the hosts: groups from the Lab's host list,
        ansible_host the address, plus the given per-host and group vars."""
        groups = {}
        for host in self.hosts.values():
            for g in host.groups:
                groups.setdefault(g, []).append(host)
        lines = []
        for g, members in groups.items():
            lines.append(f"[{g}]")
            for host in members:
                extra = " ".join(f"{k}={v}" for k, v in (host_vars or {}).get(host.name, {}).items())
                lines.append(f"{host.name} ansible_host={host.address} {extra}".rstrip())
            lines.append("")
        lines.append("[all:vars]")
        lines.append("ansible_user=root")
        lines.append("ansible_python_interpreter=/usr/bin/python3")
        for k, v in (group_vars or {}).items():
            lines.append(f"{k}={v}")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    # --- teardown -----------------------------------------------------------

    def close_ssh_masters(self):
        """Close the SSH connection masters ansible left (ControlPersist)."""
        if os.path.isdir(self.control_dir):
            for sock in os.listdir(self.control_dir):
                subprocess.run(["ssh", "-o", f"ControlPath={os.path.join(self.control_dir, sock)}",
                                "-O", "exit", "lab"], capture_output=True, timeout=10)

    def _keep_logs(self):
        """Copy each host's logs (services, sshd) out of its root before the
        roots go: workdir/host-logs/HOST/."""
        for host in self.hosts.values():
            if not host.root:
                continue
            for rel in ("var/log/kiln", "var/log/sshd.log"):
                src = os.path.join(host.root, "upper", rel)
                dst = os.path.join(self.workdir, "host-logs", host.name, os.path.basename(rel))
                try:
                    if os.path.isdir(src):
                        shutil.copytree(src, dst, dirs_exist_ok=True)
                    elif os.path.isfile(src):
                        os.makedirs(os.path.dirname(dst), exist_ok=True)
                        shutil.copy(src, dst)
                except OSError:
                    pass

    def stop(self):
        """Kill every host (and so every process in it), delete links and
        namespaces, unmount the roots.  Safe after a partial start."""
        errors = []
        self.close_ssh_masters()
        for host in self.hosts.values():
            if host.proc is None:
                continue
            if host.proc.poll() is None:
                try:
                    os.killpg(host.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                host.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"host {host.name} did not stop")
        for host in self.hosts.values():
            # Anything still in the namespace (there should be nothing).
            for pid in sh(["ip", "netns", "pids", host.netns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh(["ip", "netns", "del", host.netns], check=False)
        sh(["ip", "link", "del", self.bridge], check=False)
        reap_leftovers()
        self._keep_logs()
        if self._mounted:
            for _ in range(50):
                if sh(["umount", self.roots], check=False).returncode == 0:
                    self._mounted = False
                    break
                time.sleep(0.1)
            if self._mounted:
                sh(["umount", "-l", self.roots], check=False)
                self._mounted = False
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if errors:
            raise RuntimeError("; ".join(errors))
