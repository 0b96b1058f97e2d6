"""Seed 003's special flags, read by kiln.trace from KILN_CC_FLAGS (as
torch-neuron reads them from NEURON_CC_FLAGS) and accepted in
compiler_args: --workdir, --dynamic-batch-size, --extract-weights."""

import os

import pytest
import torch
import torch.nn as nn

import kiln


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5)).eval()


def test_workdir_and_dynamic_batch_size_from_kiln_cc_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KILN_CC_FLAGS", "--workdir ./artifacts --dynamic-batch-size")
    model = _model()
    traced = kiln.trace(model, torch.rand(1, 3, 6, 6))
    for name in ("model.onnx", "model.kgraph", "graph.txt", "model.kar", "program.txt"):
        assert (tmp_path / "artifacts" / name).is_file(), name
    assert traced.dynamic_batching
    x = torch.rand(8, 3, 6, 6)
    with torch.no_grad():
        want = model(x)
    got = traced(x)
    assert got.shape == (8, 5)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # The flags were kiln.trace's: the compiler saw none of them.
    assert traced.compile_info.get("action_key")
    with open(tmp_path / "artifacts" / "compile.log") as f:
        log = f.read()
    assert "--workdir" not in log and "--dynamic-batch-size" not in log, log


def test_extract_weights_is_accepted_and_weights_are_their_own_member(tmp_path):
    import tarfile
    traced = kiln.trace(_model(), torch.rand(1, 3, 6, 6),
                        compiler_args=["--extract-weights"])
    traced.save(tmp_path / "m.kar")
    with tarfile.open(tmp_path / "m.kar") as tar:
        names = tar.getnames()
    assert "weights.bin" in names and "program.kbin" in names, names


def test_a_flag_missing_its_value_is_a_clear_error():
    with pytest.raises(ValueError, match="--workdir needs a value"):
        kiln.trace(_model(), torch.rand(1, 3, 6, 6), compiler_args=["--workdir"])
    with pytest.raises(ValueError, match="takes no value"):
        kiln.trace(_model(), torch.rand(1, 3, 6, 6),
                   compiler_args=["--dynamic-batch-size=4"])
