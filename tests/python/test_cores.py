"""Execution cores and placement (seed 001): models are placed on the
runtime's cores round-robin and run on threads pinned to them; the core
set follows KILN_RT_VISIBLE_CORES / KILN_RT_NUM_CORES; DataParallel and
dynamic batching spread a batch over the cores; `kiln-run
--dynamic-batch` does the same from the command line."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import kiln
from conftest import SRC, run_python

CPUS = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(5)
    model = Tiny().eval()
    return model, kiln.trace(model, torch.rand(2, 3, 6, 6))


def test_runtime_has_a_core_per_cpu_by_default():
    rt = kiln.runtime()
    assert rt.num_cores == kiln.num_cores() == len(CPUS)
    assert [rt.core_cpu(c) for c in range(rt.num_cores)] == CPUS


@two_cores
def test_two_models_loaded_into_one_runtime_land_on_different_cores(tiny, tmp_path,
                                                                    kiln_env):
    _, traced = tiny
    path = tmp_path / "tiny.kar"
    traced.save(path)
    a = kiln.load(path, keyring=kiln_env / "keys")
    b = kiln.load(path, keyring=kiln_env / "keys")
    assert a.core != b.core
    assert {a.core, b.core} <= set(range(kiln.num_cores()))
    # Round-robin: the next load comes back around.
    c = kiln.load(path, keyring=kiln_env / "keys")
    assert c.core == (b.core + 1) % kiln.num_cores()


@two_cores
def test_model_runs_execute_on_threads_pinned_to_their_core(tiny):
    _, traced = tiny
    x = torch.rand(2, 3, 6, 6)
    others = [kiln.load(traced._path, traced._keyring) for _ in range(kiln.num_cores())]
    for m in others:
        m(x)
    # Each core's executor is a thread named kiln-core-N allowed on
    # exactly that core's CPU.
    pinned = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                allowed = [ln.split(":", 1)[1].strip() for ln in f
                           if ln.startswith("Cpus_allowed_list")][0]
        except OSError:
            continue
        if name.startswith("kiln-core-"):
            pinned[int(name.rsplit("-", 1)[1])] = allowed
    rt = kiln.runtime()
    for core in {m.core for m in others}:
        assert pinned.get(core) == str(rt.core_cpu(core)), pinned


def test_visible_and_num_cores_come_from_the_environment(tiny, tmp_path, kiln_env):
    _, traced = tiny
    path = tmp_path / "tiny.kar"
    traced.save(path)
    code = f"""
import kiln
rt = kiln.runtime()
ms = [kiln.load({str(path)!r}, keyring={str(kiln_env / 'keys')!r}) for _ in range(3)]
print(rt.num_cores, [rt.core_cpu(c) for c in range(rt.num_cores)], [m.core for m in ms])
"""
    one = run_python(code, env={"KILN_RT_NUM_CORES": "1"})
    assert one.returncode == 0, one.stderr
    assert one.stdout.split("\n")[0] == f"1 [{CPUS[0]}] [0, 0, 0]"

    last = CPUS[-1]
    vis = run_python(code, env={"KILN_RT_VISIBLE_CORES": str(last)})
    assert vis.returncode == 0, vis.stderr
    assert vis.stdout.split("\n")[0] == f"1 [{last}] [0, 0, 0]"

    bad = run_python(code, env={"KILN_RT_VISIBLE_CORES": "0-"})
    assert bad.returncode != 0
    assert "KILN_RT_VISIBLE_CORES='0-'" in bad.stderr
    too_many = run_python(code, env={"KILN_RT_NUM_CORES": str(len(CPUS) + 1)})
    assert too_many.returncode != 0
    assert f"only {len(CPUS)} cores are visible" in too_many.stderr


def test_dataparallel_splits_a_batch_of_8_across_cores(tiny):
    model, traced = tiny
    batch = torch.rand(8, 3, 6, 6)
    with torch.no_grad():
        want = model(batch)
    dp = kiln.DataParallel(traced)
    assert dp.device_ids == list(range(kiln.num_cores()))
    assert sorted(m.core for m in dp._models) == dp.device_ids
    assert torch.allclose(dp(batch), want, rtol=1e-4, atol=1e-5)
    # Any batch size, in chunks of the traced batch (2 here).
    for n in (1, 3, 7):
        with torch.no_grad():
            assert torch.allclose(dp(batch[:n]), model(batch[:n]), rtol=1e-4, atol=1e-5)
    one = kiln.DataParallel(traced, device_ids=[0])
    assert torch.equal(one(batch), dp(batch))
    with pytest.raises(ValueError, match="no core"):
        kiln.DataParallel(traced, device_ids=[len(CPUS)])


@two_cores
def test_dataparallel_without_dynamic_batching_needs_exact_shares(tiny):
    model, traced = tiny
    dp = kiln.DataParallel(traced, device_ids=[0, 1])
    dp.disable_dynamic_batching()
    batch = torch.rand(4, 3, 6, 6)          # 2 per core: the traced shape
    with torch.no_grad():
        assert torch.allclose(dp(batch), model(batch), rtol=1e-4, atol=1e-5)
    with pytest.raises(kiln.InputError, match=r"received float32 \[3, 3, 6, 6\]"):
        dp(torch.rand(6, 3, 6, 6))


@two_cores
def test_dataparallel_along_another_dimension():
    def scale(x):
        return x * 2 + 1

    traced = kiln.trace(scale, torch.rand(2, 3))
    dp = kiln.DataParallel(traced, device_ids=[0, 1], dim=1)
    x = torch.rand(2, 6)
    assert torch.allclose(dp(x), scale(x), atol=1e-6)


def test_dynamic_batch_needs_the_batch_in_dimension_0_of_every_output():
    def flatten_all(x):
        return x.reshape(6)         # [2, 3] -> [6]: the batch does not survive

    traced = kiln.trace(flatten_all, torch.rand(2, 3))
    with pytest.raises(kiln.KilnError, match=r"output 'output' is float32 \[6\]: its "
                       r"dimension 0 is not the batch \(2\)"):
        kiln.dynamic_batch(traced)
    assert not traced.dynamic_batching


def test_kiln_run_dynamic_batch(tiny, tmp_path, kiln_env):
    model, traced = tiny
    path = tmp_path / "tiny.kar"
    traced.save(path)
    x = torch.rand(5, 3, 6, 6)
    np.save(tmp_path / "x.npy", x.numpy())
    kiln_run = os.path.join(os.environ["KILN_BIN"], "kiln-run")
    base = [kiln_run, str(path), "--keyring", str(kiln_env / "keys"), "--input",
            str(tmp_path / "x.npy"), "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(base + ["--dynamic-batch"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    with torch.no_grad():
        want = model(x).numpy()
    assert got.shape == (5, 3)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5)

    proc = subprocess.run(base + ["--dynamic-batch", "--replicas", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(np.load(tmp_path / "out" / "output.npy"), got)

    # Without --dynamic-batch the compiled shape is required.
    proc = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "expected float32 [2, 3, 6, 6], received float32 [5, 3, 6, 6]" in proc.stderr

    np.save(tmp_path / "x.npy", np.zeros((5, 3, 7, 6), dtype=np.float32))
    proc = subprocess.run(base + ["--dynamic-batch"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "expected float32 [N, 3, 6, 6] with any N, received float32 [5, 3, 7, 6]" \
        in proc.stderr


def test_bench_dataparallel_runs_and_prints_the_ratio():
    proc = subprocess.run([sys.executable, os.path.join(SRC, "bench", "bench_dataparallel.py"),
                           "--model", "cnn", "--repeat", "2"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "kiln, 1 core" in proc.stdout
    if len(CPUS) >= 2:
        assert "ratio 1 core / 2 cores" in proc.stdout
