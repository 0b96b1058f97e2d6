"""compiler_workdir keeps what the compile saw and made; compiler_args
(a list or a string) and KILN_CC_FLAGS reach the compiler."""

import onnx
import pytest
import torch
import torch.nn as nn

import kiln


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x):
        return torch.relu(self.conv(x)) + 1


def _program_args(workdir):
    header = (workdir / "program.txt").read_text().splitlines()[0]
    return header.split("args '", 1)[1].rsplit("'", 1)[0]


def test_compiler_workdir_keeps_onnx_graph_log_artifact_and_ir_dumps(tmp_path):
    torch.manual_seed(0)
    workdir = tmp_path / "work"
    model = ConvNet().eval()
    x = torch.rand(1, 2, 5, 5)
    traced = kiln.trace(model, x, compiler_workdir=workdir,
                        compiler_args=["--optlevel", "1"])
    names = sorted(p.name for p in workdir.iterdir())
    assert names == ["compile.log", "graph.txt", "model.kar", "model.kgraph",
                     "model.onnx", "program.txt"]
    proto = onnx.load(str(workdir / "model.onnx"))
    assert {n.op_type for n in proto.graph.node} >= {"Conv", "Relu", "Add"}
    graph = (workdir / "graph.txt").read_text()
    assert "Conv" in graph and "x float32 [1, 2, 5, 5]" in graph
    program = (workdir / "program.txt").read_text()
    assert "conv2d" in program
    assert _program_args(workdir) == "--optlevel 1"
    log = (workdir / "compile.log").read_text()
    assert traced.artifact in log and "--optlevel 1" in log
    # The module does not depend on the work directory.
    for p in workdir.iterdir():
        p.unlink()
    with torch.no_grad():
        assert torch.allclose(traced(x), model(x), atol=1e-5)


def test_compiler_args_as_a_string_and_kiln_cc_flags_are_added(tmp_path, monkeypatch):
    model = ConvNet().eval()
    x = torch.rand(1, 2, 5, 5)
    kiln.trace(model, x, compiler_workdir=tmp_path / "a", compiler_args="--optlevel 3")
    assert _program_args(tmp_path / "a") == "--optlevel 3"
    monkeypatch.setenv("KILN_CC_FLAGS", "--optlevel 0")
    kiln.trace(model, x, compiler_workdir=tmp_path / "b")
    assert _program_args(tmp_path / "b") == "--optlevel 0"


def test_an_unknown_compiler_argument_is_a_compile_error_naming_it(monkeypatch, tmp_path):
    model = ConvNet().eval()
    monkeypatch.setenv("KILN_CC_FLAGS", "--no-such-flag")
    with pytest.raises(kiln.CompileError, match="--no-such-flag"):
        kiln.trace(model, torch.rand(1, 2, 5, 5), compiler_workdir=tmp_path)
    assert "--no-such-flag" in (tmp_path / "compile.log").read_text()
    with pytest.raises(ValueError, match="whitespace"):
        kiln.trace(model, torch.rand(1, 2, 5, 5), compiler_args=["--optlevel 1"])
