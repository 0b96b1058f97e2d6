"""A traced module saved in one process is loaded, verified and run in
another with the same result; the saved file is an ordinary kiln
artifact that `kiln verify` and `kiln-run` accept."""

import os
import subprocess

import numpy as np
import torch
import torch.nn as nn

import kiln
from conftest import run_python


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Flatten())
        self.a = nn.Linear(8 * 4 * 4, 6)
        self.b = nn.Linear(8 * 4 * 4, 2)

    def forward(self, image):
        h = self.body(image)
        return self.a(h), torch.relu(self.b(h))


def test_save_in_one_process_load_and_run_in_another(tmp_path, kiln_env):
    torch.manual_seed(3)
    model = TwoHeads().eval()
    traced = kiln.trace(model, torch.rand(1, 3, 8, 8))
    path = tmp_path / "two_heads.kar"
    traced.save(path)
    x = torch.rand(1, 3, 8, 8)
    torch.save(x, tmp_path / "x.pt")
    here = traced(x)

    code = f"""
import torch, kiln
m = kiln.load({str(path)!r}, keyring={str(kiln_env / 'keys')!r})
a, b = m(torch.load({str(tmp_path / 'x.pt')!r}))
torch.save((a, b, m.core), {str(tmp_path / 'out.pt')!r})
"""
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0, proc.stderr
    a, b, core = torch.load(tmp_path / "out.pt")
    assert core == 0            # the first model of a fresh process
    assert torch.equal(a, here[0]) and torch.equal(b, here[1])
    with torch.no_grad():
        want = model(x)
    assert torch.allclose(a, want[0], rtol=1e-4, atol=1e-5)
    assert torch.allclose(b, want[1], rtol=1e-4, atol=1e-5)

    # Deleting the module's own files does not affect the saved one.
    del traced
    assert path.exists()


def test_a_saved_module_is_a_plain_artifact_for_the_cli(tmp_path, kiln_env):
    def affine(x):
        return x * 3 - 1

    traced = kiln.trace(affine, torch.rand(2, 5))
    path = tmp_path / "affine.kar"
    kiln.save(traced, path)
    keyring = str(kiln_env / "keys")
    kiln_bin = os.environ["KILN_BIN"]
    verify = subprocess.run([os.path.join(kiln_bin, "kiln"), "verify", str(path),
                             "--keyring", keyring], capture_output=True, text=True,
                            timeout=60)
    assert verify.returncode == 0, verify.stderr
    x = np.random.default_rng(0).random((2, 5), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    run = subprocess.run([os.path.join(kiln_bin, "kiln-run"), str(path), "--keyring",
                          keyring, "--input", str(tmp_path / "x.npy"), "--output-dir",
                          str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    got = np.load(tmp_path / "out" / "output.npy")
    assert np.allclose(got, x * 3 - 1, atol=1e-6)


def test_a_module_cannot_be_pickled_by_mistake():
    traced = kiln.trace(lambda x: x + 1, torch.rand(2))
    import io
    import pytest
    with pytest.raises(TypeError, match="module.save"):
        torch.save(traced, io.BytesIO())
