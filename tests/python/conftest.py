"""Fixtures for the kiln Python package's tests (kiln.trace and friends).

`make python-test` sets KILN_BIN, KILN_LIB and KILN_SRC; without them the
source tree's build/ is used.  Every test runs with a private
KILN_CONFIG_DIR (local builds are signed with a key made there, never
~/.config), and without KILN_BROKER, KILN_CC_FLAGS or KILN_KEYRING from
the caller's environment.  Farms bind 127.0.0.1 on free ports and are
stopped at the end, also on failure; every subprocess has a timeout.
"""

import os
import subprocess
import sys

import pytest

SRC = os.environ.get("KILN_SRC",
                     os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN = os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin"))
LIB = os.environ.get("KILN_LIB", os.path.join(SRC, "build", "lib"))
PYDIR = os.path.join(SRC, "python")
sys.path.insert(0, PYDIR)
os.environ.setdefault("KILN_BIN", BIN)
os.environ.setdefault("KILN_LIB", LIB)

from kiln.farm import LocalFarm  # noqa: E402

_SCRUBBED = ("KILN_BROKER", "KILN_CC_FLAGS", "KILN_KEYRING", "KILN_RT_VISIBLE_CORES",
             "KILN_RT_NUM_CORES")


@pytest.fixture(scope="session", autouse=True)
def kiln_env(tmp_path_factory):
    """A private config dir for the whole session; the caller's kiln
    settings put aside."""
    saved = {k: os.environ.pop(k) for k in _SCRUBBED if k in os.environ}
    old_config = os.environ.get("KILN_CONFIG_DIR")
    config = tmp_path_factory.mktemp("kiln-config")
    os.environ["KILN_CONFIG_DIR"] = str(config)
    try:
        yield config
    finally:
        if old_config is None:
            os.environ.pop("KILN_CONFIG_DIR", None)
        else:
            os.environ["KILN_CONFIG_DIR"] = old_config
        os.environ.update(saved)


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


def run_python(code, timeout=120, env=None, cwd=None):
    """Run `code` in a fresh /usr/bin/python3 that imports kiln from the
    source tree; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = PYDIR + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)
