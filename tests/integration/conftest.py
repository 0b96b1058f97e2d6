"""Shared fixtures for kiln's integration tests: real programs, real
sockets on 127.0.0.1, every process stopped at the end, every wait bounded.

KILN_BIN (set by `make integration-test`) is the directory of the built
programs; KILN_SRC the source tree.
"""

import os
import subprocess
import sys

import pytest

SRC = os.environ.get("KILN_SRC", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(__file__))

from kiln.farm import LocalFarm  # noqa: E402


def kiln_bin(name):
    return os.path.join(BIN, name)


def run(args, timeout=120, check=False, env=None, **kw):
    """Run a kiln program (args[0] is a name in KILN_BIN) with a timeout."""
    argv = [kiln_bin(args[0])] + [str(a) for a in args[1:]]
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=full_env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    return proc


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    """Each test's client caches (import digests, members by digest) in a
    directory of its own, never ~/.cache: what one test fetched must not
    change what another sends or receives."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))


@pytest.fixture
def kiln_run():
    return run


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """A broker and two workers on loopback, for one test module."""
    workdir = str(tmp_path_factory.mktemp("farm"))
    f = LocalFarm(BIN, workers=2, workdir=workdir)
    f.start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A private KILN_CONFIG_DIR so that local builds never touch ~/.config."""
    d = tmp_path / "config"
    monkeypatch.setenv("KILN_CONFIG_DIR", str(d))
    return d
