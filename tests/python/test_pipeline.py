"""--pipeline-cores N (torch-neuron's --neuroncore-pipeline-cores): the
model runs as N stages on N cores and gives the same bits as compiled
whole (issue 17).  Models are kept small: resnet18 at 64×64 and a
two-layer encoder; bench/bench_pipeline.py runs resnet50 and a larger
encoder."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torchvision

import kiln
from kiln import _runtime

from conftest import BIN, PYDIR

PIPE2 = ["--neuroncore-pipeline-cores", "2"]


@pytest.fixture(autouse=True)
def two_cores():
    if _runtime.num_cores() < 2:
        pytest.skip("the runtime has fewer than 2 cores")


class Encoder(nn.Module):
    """BERT-like: token and position embeddings, a mask every layer reads,
    two encoder layers, a pooler."""

    def __init__(self, vocab=100, d=64, heads=4, layers=2, tokens=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, tokens, d) * 0.1)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.pool = nn.Linear(d, d)

    def forward(self, ids, mask):
        h = self.tok(ids) + self.pos
        bias = (1.0 - mask)[:, None, :] * -10000.0    # [b, 1, tokens]
        bias = bias.repeat_interleave(self.layers[0].self_attn.num_heads, 0)
        bias = bias.expand(-1, ids.shape[1], -1)
        for layer in self.layers:
            h = layer(h, src_mask=bias)
        return torch.tanh(self.pool(h[:, 0]))


def _encoder_inputs(batch=1, tokens=16):
    ids = torch.randint(0, 100, (batch, tokens))
    mask = torch.ones(batch, tokens)
    mask[:, tokens - 3:] = 0
    return ids, mask


def test_resnet18_on_two_cores_gives_the_bits_of_one(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.rand(1, 3, 64, 64)
    whole = kiln.trace(model, x)
    piped = kiln.trace(model, x, compiler_args=PIPE2, compiler_workdir=tmp_path / "w")
    assert whole.stages == 1 and piped.stages == 2
    n = _runtime.num_cores()
    c0 = piped.stage_cores[0]
    assert piped.stage_cores == [c0, (c0 + 1) % n]
    assert set(piped.cores) == set(piped.stage_cores)
    assert "stages=2" in repr(piped)
    for _ in range(2):
        x = torch.rand(1, 3, 64, 64)
        want = whole(x)
        got = piped(x)
        assert torch.equal(got, want)
        with torch.no_grad():
            assert torch.allclose(got, model(x), atol=1e-4, rtol=1e-4)
    # The seeds' spelling is noted in the log and compiled as kiln's.
    log = (tmp_path / "w" / "compile.log").read_text()
    assert "--neuroncore-pipeline-cores is torch-neuron's spelling" in log
    manifest = kiln.load(piped._path, keyring=piped._keyring)
    assert manifest.stages == 2


def test_encoder_stream_and_concurrent_calls_match_one_at_a_time():
    torch.manual_seed(1)
    model = Encoder().eval()
    ids, mask = _encoder_inputs()
    whole = kiln.trace(model, (ids, mask))
    piped = kiln.trace(model, (ids, mask), compiler_args=["--pipeline-cores", "2"])
    assert piped.stages == 2
    batch = [_encoder_inputs() for _ in range(6)]
    want = [whole(i, m) for i, m in batch]
    for (i, m), w in zip(batch, want):
        assert torch.equal(piped(i, m), w)
        with torch.no_grad():
            assert torch.allclose(w, model(i, m), atol=1e-4, rtol=1e-4)
    # Concurrent calls share the pipeline.
    got = [None] * len(batch)

    def call(k):
        got[k] = piped(*batch[k])
    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # A batch streams through in micro-batches of the traced size.
    kiln.dynamic_batch(piped)
    ids8 = torch.cat([i for i, _ in batch]), torch.cat([m for _, m in batch])
    assert torch.equal(piped(*ids8), torch.cat(want))


def test_a_pipelined_artifact_on_one_core_is_a_clear_error(tmp_path):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 4)).eval()
    x = torch.rand(1, 3, 8, 8)
    piped = kiln.trace(model, x, compiler_args=PIPE2)
    path = tmp_path / "m.kar"
    piped.save(path)
    keyring = piped._keyring
    script = ("import sys, torch, kiln\n"
              "m = kiln.load(sys.argv[1], keyring=sys.argv[2])\n"
              "print(m.stages, m.stage_cores, m(torch.ones(1, 3, 8, 8)).sum().item())\n")
    env = dict(os.environ, PYTHONPATH=PYDIR, KILN_RT_NUM_CORES="1")
    proc = subprocess.run([sys.executable, "-c", script, str(path), keyring], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert ("pipelined over 2 cores (compiled with --pipeline-cores 2) but this "
            "runtime has 1") in proc.stderr, proc.stderr
    assert "KILN_RT_PIPELINE_SHARE=1" in proc.stderr
    # Allowed explicitly, the stages share the one core.
    env["KILN_RT_PIPELINE_SHARE"] = "1"
    proc = subprocess.run([sys.executable, "-c", script, str(path), keyring], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stages, cores, total = proc.stdout.split(" ", 1)[0], None, None
    assert stages == "2"
    want = piped(torch.ones(1, 3, 8, 8)).sum().item()
    assert abs(float(proc.stdout.split()[-1]) - want) <= 1e-5 * max(1.0, abs(want))
    # kiln-run says the same.
    run = subprocess.run([os.path.join(BIN, "kiln-run"), str(path), "--keyring", keyring,
                          "--input", str(tmp_path / "none.npy"), "--output-dir",
                          str(tmp_path / "out")],
                         env=dict(os.environ, KILN_RT_NUM_CORES="1"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "pipelined over 2 cores" in run.stderr, run.stderr


def test_more_stages_than_ops_is_refused_naming_the_flag():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    with pytest.raises(kiln.CompileError, match="--pipeline-cores 8: the program has"):
        kiln.trace(model, torch.rand(1, 4), compiler_args=["--pipeline-cores", "8"])
