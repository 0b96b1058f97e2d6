"""Attention as one op (kiln_cc_fuse.c's s_plan_attention, the runtime's
attention kernel) against torch: nn.MultiheadAttention as exported, with
the sequence first and batch first, with a float mask; a hand-written
cross-attention whose queries, keys and values differ in length and
width, scaled after the product, with a key-padding mask broadcast over
heads and queries; GPT's block, Q, K and V a Split of one product (read
at offsets, the Split writing only an output some other op reads) and a
causal mask built in forward; one head over a sequence long enough to be
cut into blocks of queries; and the scores' softmax over an axis that is not the
last, which must stay apart.  Each small model is exported with
torch.onnx.export (opset 14), compiled at -O2 and -O3 and run on every
micro-kernel this CPU has and with 2 and 3 threads; every output must be
within 1e-4 of torch's largest magnitude, and where the pattern is
attention's the profile must show one attention op a layer, no softmax,
and no copy of K's transpose.
"""

import numpy as np
import pytest
import torch

from engine_helpers import export, kernel_ops, profiles_within, seeded_model, signing_dir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return signing_dir(tmp_path_factory, "attention")


class SelfAttention(torch.nn.Module):
    def __init__(self, e, heads, batch_first, causal_len=0):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(e, heads, batch_first=batch_first)
        self.mask = None
        if causal_len:
            self.mask = torch.triu(torch.full((causal_len, causal_len), -1e4), 1)

    def forward(self, x):
        y, _ = self.mha(x, x, x, need_weights=False, attn_mask=self.mask)
        return y


class CrossAttention(torch.nn.Module):
    """10 queries against 37 keys, heads of 16 for Q and K and of 24 for
    V, the scores divided by 4 after their product, a key-padding mask of
    [batch, 1, 1, keys] added; with `bias_1d`, one bias per key of shape
    [keys] instead (a mask of fewer axes than the scores)."""

    def __init__(self, bias_1d=False):
        super().__init__()
        self.q = torch.nn.Linear(48, 64)
        self.k = torch.nn.Linear(48, 64)
        self.v = torch.nn.Linear(48, 96)
        if bias_1d:
            pad = torch.linspace(-2.0, 1.0, 37)
        else:
            pad = torch.zeros(2, 1, 1, 37)
            pad[1, :, :, 30:] = -1e4
        self.register_buffer("pad", pad)

    def forward(self, x):
        b = x.shape[0]
        q = self.q(x[:, :10]).reshape(b, 10, 4, 16).permute(0, 2, 1, 3)
        k = self.k(x).reshape(b, 37, 4, 16).permute(0, 2, 1, 3)
        v = self.v(x).reshape(b, 37, 4, 24).permute(0, 2, 1, 3)
        s = torch.matmul(q, k.transpose(-1, -2)) / 4.0 + self.pad
        p = torch.softmax(s, -1)
        return torch.matmul(p, v).permute(0, 2, 1, 3).reshape(b, 10, 96)


class CausalQKV(torch.nn.Module):
    """GPT's block: Q, K and V the outputs of a Split of one product (each
    read at an offset: the Split writes none of them), heads split, a
    causal mask built in forward and added, the heads merged.  With
    `relu_v`, V goes through a Relu first: the Split still writes that
    output (one strided copy) and no other, also when it splits a
    reshape of the product (`reshaped`: the views stop at the Split,
    which still reads the reshape)."""

    def __init__(self, relu_v=False, reshaped=False):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        self.relu_v = relu_v
        self.reshaped = reshaped

    def forward(self, x):
        b, t, _ = x.shape
        h = self.qkv(x)
        if self.reshaped:
            # split along a new axis of a reshape, each part squeezed
            q, k, v = (z.squeeze(2) for z in h.reshape(b, t, 3, 64).split(1, 2))
        else:
            q, k, v = h.split(64, -1)
        if self.relu_v:
            v = torch.relu(v)
        q, k, v = (z.reshape(b, t, 4, 16).transpose(1, 2) for z in (q, k, v))
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.25
        s = s + torch.triu(torch.full((t, t), -1e4), 1)
        y = torch.matmul(torch.softmax(s, -1), v)
        return y.transpose(1, 2).reshape(b, t, 64)


class QueryAxisSoftmax(torch.nn.Module):
    """The scores' softmax over the queries (axis -2): not attention."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -2)
        return torch.matmul(p, v)


MODELS = {
    # name: (make, input shape, attention ops expected at -O2/-O3, strided
    # copies left: with a batch of 2, batch_first's transposes of the
    # three inputs and of the output, which torch makes around its
    # sequence-first attention)
    "mha_seq_first": (lambda: SelfAttention(64, 4, False), (24, 1, 64), 1, 0),
    "mha_batch_first_causal": (lambda: SelfAttention(48, 3, True, 19), (2, 19, 48), 1, 4),
    "cross_attention": (CrossAttention, (2, 37, 48), 1, 0),
    "cross_attention_key_bias": (lambda: CrossAttention(True), (2, 37, 48), 1, 0),
    "causal_qkv": (CausalQKV, (2, 23, 64), 1, 0),
    "causal_qkv_relu_v": (lambda: CausalQKV(True), (2, 23, 64), 1, 1),
    "causal_qkv_reshaped_relu_v": (lambda: CausalQKV(True, True), (2, 23, 64), 1, 1),
    "one_head_long": (lambda: SelfAttention(16, 1, True), (1, 600, 16), 1, 0),
    "query_axis_softmax": (QueryAxisSoftmax, (2, 20, 32), 0, None),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_matches_torch(workdir, name):
    make, shape, fused, strided = MODELS[name]
    model = seeded_model(make)
    want, kgraph, xpath = export(workdir, name, model, torch.randn(*shape))
    for log in profiles_within(workdir, name, kgraph, xpath, want, TOLERANCE):
        ops = kernel_ops(log)
        assert ops.get("attention", 0) == fused, f"{name}: {ops}"
        if fused:
            assert "softmax" not in ops, f"{name}: {ops}"
            assert ops.get("strided", 0) == strided, f"{name}: {ops}"
        else:
            assert ops.get("softmax") == 1, f"{name}: {ops}"
