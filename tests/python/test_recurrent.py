"""torch's nn.LSTM, nn.GRU and nn.RNN through kiln (issue 15, item 4):
traced whole with kiln.trace (its ONNX export has one LSTM / GRU / RNN
node per layer), compared with torch in the same test.  2 layers,
bidirectional or not, batch_first or not, initial states given or not.

Tolerance: max |kiln - torch| <= 1e-4 · max |torch output| per output
(float32 both; the products sum in another order).

Also a GRU whose sequence_lens is a graph input, so that a length past
the sequence reaches the kernel at run time: kiln_model_run returns an
error naming the op, not a read past X.
"""

import subprocess

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from conftest import BIN

TOL = 1e-4


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert scale > 0, f"{what}: reference all zeros"
    assert err <= TOL * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


class _Net(torch.nn.Module):
    def __init__(self, cell, batch_first, bidirectional, with_state, **kw):
        super().__init__()
        self.cell = cell
        self.rnn = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}[cell](
            input_size=6, hidden_size=12, num_layers=2, batch_first=batch_first,
            bidirectional=bidirectional, **kw)
        self.with_state = with_state

    def forward(self, x, *state):
        if self.with_state:
            state = state if self.cell == "LSTM" else state[0]
            y, s = self.rnn(x, state)
        else:
            y, s = self.rnn(x)
        return (y,) + (tuple(s) if self.cell == "LSTM" else (s,))


CASES = [
    # cell, batch_first, bidirectional, initial state, extra kwargs, optlevel
    ("LSTM", False, False, False, {}, 3),
    ("LSTM", True, True, True, {}, 3),
    ("LSTM", False, True, False, {}, 0),
    ("GRU", False, True, True, {}, 3),
    ("GRU", True, False, False, {}, 0),
    ("GRU", True, True, False, {}, 3),
    ("RNN", False, True, True, {}, 3),
    ("RNN", True, False, False, {"nonlinearity": "relu"}, 3),
]


@pytest.mark.parametrize("cell,batch_first,bidi,with_state,kw,opt", CASES,
                         ids=[f"{c[0]}-bf{int(c[1])}-bi{int(c[2])}-h0{int(c[3])}-O{c[5]}"
                              + ("-relu" if c[4] else "") for c in CASES])
def test_torch_recurrent_layers_match_torch(cell, batch_first, bidi, with_state, kw, opt):
    torch.manual_seed(7)
    net = _Net(cell, batch_first, bidi, with_state, **kw).eval()
    T, B, D = 5, 3, 2 if bidi else 1
    x = torch.randn((B, T, 6) if batch_first else (T, B, 6))
    args = [x]
    if with_state:
        args.append(torch.randn(2 * D, B, 12))
        if cell == "LSTM":
            args.append(torch.randn(2 * D, B, 12))
    traced = kiln.trace(net, tuple(args), compiler_args=["--optlevel", str(opt)],
                        fallback=False, check_trace=False)
    for seed in range(2):
        torch.manual_seed(100 + seed)
        inputs = [torch.randn_like(a) for a in args]
        with torch.no_grad():
            want = net(*inputs)
        got = traced(*inputs)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{cell} output {k}, input {seed}")


def _gru_with_lengths(path, T, B, I, H):
    rng = np.random.default_rng(3)
    w = helper.make_tensor("W", TensorProto.FLOAT, [1, 3 * H, I],
                           rng.standard_normal(3 * H * I).astype(np.float32))
    r = helper.make_tensor("R", TensorProto.FLOAT, [1, 3 * H, H],
                           rng.standard_normal(3 * H * H).astype(np.float32))
    node = helper.make_node("GRU", ["X", "W", "R", "", "lens"], ["Y", "Y_h"], hidden_size=H)
    g = helper.make_graph(
        [node], "gru",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T, B, I]),
         helper.make_tensor_value_info("lens", TensorProto.INT32, [B])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [T, 1, B, H]),
         helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, B, H])],
        initializer=[w, r])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), str(path))


def test_sequence_lens_read_at_run_time_is_checked(tmp_path):
    T, B, I, H = 4, 2, 3, 5
    path = tmp_path / "gru.onnx"
    _gru_with_lengths(path, T, B, I, H)
    kar = tmp_path / "gru.kar"
    subprocess.run([f"{BIN}/kiln", "compile", "--local", str(path), "-o", str(kar)],
                   check=True, timeout=120, capture_output=True)
    m = kiln.load(kar)
    x = torch.randn(T, B, I)
    y, yh = m(x, torch.tensor([4, 2], dtype=torch.int32))
    # past its length a batch's Y is zero, and Y_h is its state at the length
    assert torch.all(y[2:, 0, 1] == 0) and torch.any(y[:2, 0, 1] != 0)
    assert torch.equal(yh[0, 1], y[1, 0, 1]) and torch.equal(yh[0, 0], y[3, 0, 0])
    for bad in ([5, 1], [1, -1], [2**31 - 1, 0]):
        with pytest.raises(kiln.KilnError, match=r"sequence_lens\[\d\] is .*not in 0\.\.4"):
            m(x, torch.tensor(bad, dtype=torch.int32))
    # the model still runs after a refused input
    y2, _ = m(x, torch.tensor([4, 2], dtype=torch.int32))
    assert torch.equal(y2, y)
