#!/usr/bin/python3
"""PID 1 of one test host (tests/ansible/netns_hosts.py).

Runs sshd in the foreground and restarts it if it dies, reaps every
orphan the host's services leave behind (kiln-supervise daemons are
re-parented here, as they would be to init), and on SIGTERM stops the
whole host: SIGTERM to everything, then SIGKILL.  When this process
exits the kernel kills whatever is left in the host's PID namespace.
"""

import os
import signal
import subprocess
import sys
import time

SSHD = ["/usr/sbin/sshd", "-D", "-e", "-f", "/etc/ssh/sshd_config"]


def stop_everything(signum, frame):
    try:
        os.kill(-1, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.05)
        except ChildProcessError:
            break
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)


def start_sshd():
    log = open("/var/log/sshd.log", "ab")
    return subprocess.Popen(SSHD, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def main():
    signal.signal(signal.SIGTERM, stop_everything)
    signal.signal(signal.SIGINT, stop_everything)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    sshd = start_sshd()
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(1)
            continue
        if pid == sshd.pid:
            time.sleep(0.5)
            sshd = start_sshd()


if __name__ == "__main__":
    main()
