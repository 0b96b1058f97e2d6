"""The TorchScript extension (python/kiln/csrc/kiln_torch.cpp): a signed
kiln artifact as the custom class torch.classes.kiln.Model.

A module whose forward calls torch.ops.kiln.run on a Model attribute
traces with torch.jit.trace, saves with torch.jit.save, and loads and runs
in a new process after `import kiln` and in a C++ program linked with
libtorch alone (kiln-torch-run); a changed byte of the embedded artifact
makes torch.jit.load fail with kiln's verification error; a wrong input is
an error naming the input; the extension and the ctypes binding place
models round-robin on one shared runtime."""

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn

import kiln
from kiln import _ext
from kiln import compile as kiln_compile
from conftest import BIN, LIB, run_python


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), torch.sigmoid(self.b(h))


class KilnWrapper(nn.Module):
    """What kiln.trace's TorchScript form looks like: the compiled part a
    Model attribute, called through kiln::run."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        outs = torch.ops.kiln.run(self.m, [x])
        return outs[0], outs[1]


def _close(got, want):
    """Equal within float32 rounding of outputs of this size."""
    tol = 1e-5 * max(1.0, float(want.abs().max()))
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=tol)


@pytest.fixture(scope="module")
def compiled(kiln_env):
    """The torch model, kiln.trace's module of it (which owns the artifact
    file) and an example input."""
    torch.manual_seed(7)
    model = TwoHeads().eval()
    x = torch.rand(2, 5)
    traced = kiln.trace(model, x)
    with torch.no_grad():
        want = model(x)
    yield model, traced, x, want
    del traced


@pytest.fixture(scope="module")
def saved(compiled, tmp_path_factory):
    """m.pt: the traced wrapper of a Model, saved with torch.jit.save."""
    _, traced, x, _ = compiled
    wrapper = KilnWrapper(torch.classes.kiln.Model(traced._path, traced._keyring, -1))
    script = torch.jit.trace(wrapper, (x,))
    path = tmp_path_factory.mktemp("torchscript") / "m.pt"
    torch.jit.save(script, str(path))
    return path, script


def test_model_class_runs_the_artifact_like_the_torch_model(compiled):
    _, traced, x, want = compiled
    m = torch.classes.kiln.Model(traced._path, traced._keyring, -1)
    a, b = m.run([x])
    assert _close(a, want[0]) and _close(b, want[1])
    # The same kernels as the ctypes binding: the same bits.
    here = traced(x)
    assert torch.equal(a, here[0]) and torch.equal(b, here[1])
    assert 0 <= m.core() < kiln.num_cores()
    with tarfile.open(traced._path) as tar:
        manifest = tar.extractfile("manifest.json").read()
    assert m.digest() == hashlib.sha256(manifest).hexdigest()


def test_wrong_input_is_an_error_naming_the_input_and_both_shapes(compiled):
    _, traced, x, _ = compiled
    m = torch.classes.kiln.Model(traced._path, traced._keyring, -1)
    name = traced._model.inputs[0].name
    shape_msg = (f"kiln: input '{name}': expected float32 [2, 5], "
                 f"received float32 [3, 5]")
    with pytest.raises(RuntimeError, match=r"^" + shape_msg.replace("[", r"\[")):
        m.run([torch.rand(3, 5)])
    with pytest.raises(RuntimeError, match="received float64"):
        torch.ops.kiln.run(m, [x.double()])
    with pytest.raises(RuntimeError, match=rf"the model takes 1 input \('{name}'\), got 2"):
        torch.ops.kiln.run(m, [x, x])
    script = torch.jit.trace(KilnWrapper(m), (x,))
    with pytest.raises(RuntimeError, match=rf"input '{name}': expected float32 \[2, 5\]"):
        script(torch.rand(3, 5))
    # A non-contiguous input of the right shape is fine.
    xt = torch.rand(5, 2).t()
    assert torch.equal(m.run([xt])[0], m.run([xt.contiguous()])[0])


def test_a_missing_artifact_fails_on_first_use_not_on_construction(tmp_path):
    m = torch.classes.kiln.Model(str(tmp_path / "gone.kar"), str(tmp_path), -1)
    with pytest.raises(RuntimeError, match=r"kiln: could not open artifact '.*gone\.kar'"):
        m.core()


def test_tracing_records_kiln_run_on_the_model_attribute(saved):
    _, script = saved
    graph = str(script.graph)
    assert 'prim::GetAttr[name="m"]' in graph
    assert "__torch__.torch.classes.kiln.Model" in graph
    assert "kiln::run(" in graph


def test_saved_module_loads_and_runs_in_a_new_process(compiled, saved, tmp_path, kiln_env):
    model, traced, x, want = compiled
    path, script = saved
    torch.save(x, tmp_path / "x.pt")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    code = f"""
import os, torch, kiln
m = torch.jit.load({str(path)!r})
a, b = m(torch.load({str(tmp_path / 'x.pt')!r}))
left = os.listdir({str(tmpdir)!r})
# It can be saved again (the embedded bytes stay readable), and loads.
torch.jit.save(m, {str(tmp_path / 'again.pt')!r})
a2, b2 = torch.jit.load({str(tmp_path / 'again.pt')!r})(torch.load({str(tmp_path / 'x.pt')!r}))
torch.save((a, b, a2, b2, left, m.m.digest()), {str(tmp_path / 'out.pt')!r})
"""
    proc = run_python(code, timeout=120, env={"KILN_KEYRING": traced._keyring,
                                              "TMPDIR": str(tmpdir)})
    assert proc.returncode == 0, proc.stderr
    a, b, a2, b2, left, digest = torch.load(tmp_path / "out.pt")
    here = script(x)
    assert torch.equal(a, here[0]) and torch.equal(b, here[1])
    assert torch.equal(a2, a) and torch.equal(b2, b)
    assert _close(a, want[0]) and _close(b, want[1])
    assert digest == torch.classes.kiln.Model(traced._path, traced._keyring, -1).digest()
    # The embedded artifact's temporary file was unlinked once loaded.
    assert left == []
    assert os.listdir(tmpdir) == []


def _tamper(pt, out):
    """Copy the .pt zip at `pt` to `out` with one byte of the embedded
    artifact's weights changed; returns the member that was changed."""
    with zipfile.ZipFile(pt) as z:
        records = [(info, z.read(info)) for info in z.infolist()]
    changed = None
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info, data in records:
            start = data.find(b"manifest.json\0")
            if changed is None and start == 0:
                # The artifact tar, stored as the state tensor's bytes.
                with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                    names = [n for n in tar.getnames() if not n.startswith(("manifest",
                             "signature", "provenance"))]
                    changed = "weights.bin" if "weights.bin" in names else names[-1]
                    member = tar.getmember(changed)
                    at = member.offset_data + member.size // 2
                data = bytearray(data)
                data[at] ^= 0x01
                data = bytes(data)
            z.writestr(info.filename, data)
    assert changed, "no embedded artifact found in the .pt archive"
    return changed


def test_a_tampered_embedded_artifact_fails_torch_jit_load(saved, tmp_path, kiln_env):
    path, _ = saved
    bad = tmp_path / "tampered.pt"
    member = _tamper(path, bad)
    keyring = str(kiln_env / "keys")
    _ext.set_keyring(keyring)
    try:
        with pytest.raises(RuntimeError) as e:
            torch.jit.load(str(bad))
        msg = str(e.value)
        assert f"kiln: embedded artifact failed verification against keyring '{keyring}'" in msg
        assert f"member '{member}': sha256 mismatch" in msg
        assert "kiln-embedded-" not in msg       # no temporary path in it

        # The untouched file loads; against a keyring without the signer's
        # key it does not.
        torch.jit.load(str(path))
        _ext.set_keyring(str(tmp_path))
        with pytest.raises(RuntimeError, match="failed verification against keyring "
                           f"'{tmp_path}': .*not in keyring"):
            torch.jit.load(str(path))
    finally:
        _ext.set_keyring(None)


def test_cpp_program_loads_and_runs_the_saved_module(compiled, saved, tmp_path):
    _, traced, x, want = compiled
    path, script = saved
    x.numpy().astype("<f4").tofile(tmp_path / "x.bin")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run = subprocess.run([os.path.join(BIN, "kiln-torch-run"), str(path), "--keyring",
                          traced._keyring, "--input", f"2x5:{tmp_path / 'x.bin'}",
                          "--output-dir", str(out)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["out0 [2, 3]", "out1 [2, 2]"]
    here = script(x)
    for i, (h, w) in enumerate(zip(here, want)):
        got = torch.from_numpy(np.fromfile(out / f"out{i}.bin", dtype="<f4")).reshape(w.shape)
        assert torch.equal(got, h)
        assert _close(got, w)

    # A wrong shape is kiln's error, naming the input.
    bad = subprocess.run([os.path.join(BIN, "kiln-torch-run"), str(path), "--keyring",
                          traced._keyring, "--input", f"5x2:{tmp_path / 'x.bin'}",
                          "--output-dir", str(out)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert bad.returncode == 1
    assert "expected float32 [2, 5], received float32 [5, 2]" in bad.stderr


def test_extension_and_ctypes_share_one_runtime_and_its_placement(compiled):
    _, traced, _, _ = compiled
    code = f"""
import torch, kiln
rt = kiln.runtime()
a = rt.load({traced._path!r}, {traced._keyring!r})
b = torch.classes.kiln.Model({traced._path!r}, {traced._keyring!r}, -1)
b_core = b.core()       # placed when first used, not when constructed
c = rt.load({traced._path!r}, {traced._keyring!r})
d = torch.classes.kiln.Model({traced._path!r}, {traced._keyring!r}, 0)
print(a.core, b_core, c.core, d.core(), rt.num_cores)
"""
    proc = run_python(code, timeout=120, env={"KILN_RT_NUM_CORES": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1", "0", "0", "2"]


def test_process_keyring_mirrors_default_keyring(tmp_path, monkeypatch):
    for var in ("KILN_KEYRING", "KILN_CONFIG_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)

    def both():
        return torch.ops.kiln.keyring(), kiln_compile.default_keyring()

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert both() == (str(tmp_path / "home/.config/kiln/keys"),) * 2
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert both() == (str(tmp_path / "xdg/kiln/keys"),) * 2
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "config"))
    assert both() == (str(tmp_path / "config/keys"),) * 2
    (tmp_path / "config" / "keyring").mkdir(parents=True)
    assert both() == (str(tmp_path / "config/keyring"),) * 2
    monkeypatch.setenv("KILN_KEYRING", "")
    assert both() == (str(tmp_path / "config/keyring"),) * 2
    monkeypatch.setenv("KILN_KEYRING", str(tmp_path / "ring"))
    assert both() == (str(tmp_path / "ring"),) * 2
    try:
        _ext.set_keyring(tmp_path / "set")
        assert _ext.keyring() == str(tmp_path / "set")
    finally:
        _ext.set_keyring(None)
    assert _ext.keyring() == str(tmp_path / "ring")


def test_import_kiln_works_without_the_extension(tmp_path):
    pkg = tmp_path / "py" / "kiln"
    shutil.copytree(os.path.join(os.path.dirname(kiln.__file__)), pkg,
                    ignore=shutil.ignore_patterns("csrc", "__pycache__", "_paths.py"))
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libkilnrt.so", "libkilnclient.so"):
        os.symlink(os.path.join(LIB, name), lib / name)
    code = """
import kiln
from kiln import _ext
try:
    _ext.load()
except kiln.KilnError as e:
    print(e)
"""
    env = {"PYTHONPATH": str(tmp_path / "py"), "KILN_LIB": str(lib)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "could not load the TorchScript extension libkiln_torch.so" in proc.stdout
    assert "KILN_LIB" in proc.stdout
