"""What kiln.trace and its modules refuse, and how: wrong shapes and
dtypes (naming the input, the expected and the received), an unsupported
op (listing every one), a compile timeout (subprocess.TimeoutExpired, the
compiler stopped), a check_trace mismatch (naming the output and the max
error), and an artifact that was tampered with."""

import io
import os
import subprocess
import tarfile

import pytest
import torch
import torch.nn as nn
import torchvision

import kiln


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, image):
        return self.fc(torch.flatten(torch.relu(self.conv(image)), 1))


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(1)
    model = SmallCNN().eval()
    return model, kiln.trace(model, torch.rand(2, 3, 8, 8))


def test_wrong_shape_names_the_input_and_both_shapes(cnn):
    _, traced = cnn
    with pytest.raises(kiln.InputError) as e:
        traced(torch.rand(2, 3, 8, 9))
    msg = str(e.value)
    assert "input 'image'" in msg
    assert "expected float32 [2, 3, 8, 8]" in msg
    assert "received float32 [2, 3, 8, 9]" in msg
    assert isinstance(e.value, ValueError)
    with pytest.raises(kiln.InputError, match=r"received float32 \[3, 3, 8, 8\]"):
        traced(torch.rand(3, 3, 8, 8))     # no dynamic batching asked for


def test_wrong_dtype_names_the_input_and_both_dtypes(cnn):
    _, traced = cnn
    with pytest.raises(kiln.InputError, match=r"input 'image': expected float32 "
                       r"\[2, 3, 8, 8\], received float64 \[2, 3, 8, 8\]"):
        traced(torch.rand(2, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(kiln.InputError, match=r"received int64"):
        traced(torch.zeros(2, 3, 8, 8, dtype=torch.int64))


def test_wrong_number_of_inputs_and_non_tensors_are_refused(cnn):
    _, traced = cnn
    with pytest.raises(kiln.InputError, match=r"takes 1 input \(image\), received 2"):
        traced(torch.rand(2, 3, 8, 8), torch.rand(1))
    with pytest.raises(kiln.InputError, match="received a list"):
        traced([1.0, 2.0])


def test_non_contiguous_input_gives_the_same_result(cnn):
    model, traced = cnn
    x = torch.rand(2, 8, 8, 3).permute(0, 3, 1, 2)
    assert not x.is_contiguous()
    with torch.no_grad():
        assert torch.allclose(traced(x), model(x), rtol=1e-4, atol=1e-5)


def test_unsupported_ops_are_all_listed():
    class DataDependent(nn.Module):
        # Output shapes that depend on the data: kiln compiles fixed shapes
        # (seed 001), so these ops are refused by design.
        def forward(self, x):
            return torch.nonzero(x > 0.5).float().sum() + torch.unique(x).sum()

    with pytest.raises(kiln.UnsupportedOperatorError) as e:
        kiln.trace(DataDependent().eval(), torch.rand(6), fallback=False)
    msg = str(e.value)
    assert "NonZero (1)" in msg and "Unique (1)" in msg, msg
    assert e.value.ops == {"NonZero": 1, "Unique": 1}

    # With fallback (the default) those ops, and everything their
    # data-dependent shapes feed, run in torch: other inputs, with other
    # numbers of nonzero elements, still give torch's answer.
    model = DataDependent().eval()
    with pytest.warns(UserWarning, match="run on the CPU"):
        traced = kiln.trace(model, torch.rand(6))
    assert "nonzero" in traced.cpu_ops and "unique" in traced.cpu_ops
    for seed in range(3):
        x = torch.rand(6, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(traced(x), model(x))


def _resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


def test_local_compile_timeout_raises_timeout_expired_and_stops_the_compiler(tmp_path):
    workdir = tmp_path / "work"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        kiln.trace(_resnet18(), torch.rand(1, 3, 224, 224), compiler_timeout=0.001,
                   compiler_workdir=workdir)
    assert e.value.timeout == 0.001
    # The compile ran in a child that was killed: no artifact came of it.
    assert not (workdir / "model.kar").exists()
    log = (workdir / "compile.log").read_text()
    assert "child process" in log and "killed" in log


def test_local_compile_with_a_timeout_that_suffices_runs_in_a_child(cnn, tmp_path):
    model, _ = cnn
    x = torch.rand(2, 3, 8, 8)
    traced = kiln.trace(model, x, compiler_timeout=120)
    assert traced.compile_info["mode"] == "local-child"
    with torch.no_grad():
        assert torch.allclose(traced(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_check_trace_mismatch_names_the_output_and_the_max_error():
    def data_dependent(x):
        # The trace records the branch taken for the example input only.
        if x.sum() > 0:
            return x * 2
        return x * -1

    example = torch.ones(4)
    with pytest.raises(kiln.TraceCheckError) as e:
        kiln.trace(data_dependent, example, check_inputs=[(torch.ones(4),),
                                                          (-torch.ones(4),)])
    msg = str(e.value)
    assert "check_inputs[1]" in msg and "output 0 ('output')" in msg, msg
    assert "max abs error of 3" in msg, msg
    assert e.value.output == 0 and e.value.max_error == pytest.approx(3.0)

    # A tolerance that covers the difference, or no check, lets it through.
    kiln.trace(data_dependent, example, check_inputs=[(-torch.ones(4),)],
               check_tolerance=10.0)
    # torch.jit.trace's warning about the branch reaches the user.
    with pytest.warns(torch.jit.TracerWarning, match="Python boolean"):
        traced = kiln.trace(data_dependent, example, check_inputs=[(-torch.ones(4),)],
                            check_trace=False)
    assert torch.equal(traced(-torch.ones(4)), torch.full((4,), -2.0))


# --- tampering -----------------------------------------------------------

def _rewrite(src, dst, member, change):
    """Copy the tar archive src to dst with `member`'s bytes changed."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for info in tin.getmembers():
            data = tin.extractfile(info).read()
            if info.name == member:
                data = change(data)
                info.size = len(data)
            tout.addfile(info, io.BytesIO(data))


def test_a_tampered_saved_artifact_is_refused_by_load(cnn, tmp_path, kiln_env):
    model, traced = cnn
    good = tmp_path / "good.kar"
    traced.save(good)
    keyring = kiln_env / "keys"
    x = torch.rand(2, 3, 8, 8)
    assert torch.equal(kiln.load(good, keyring=keyring)(x), traced(x))

    def flip(data):
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        return bytes(b)

    weights = tmp_path / "weights.kar"
    _rewrite(good, weights, "weights.bin", flip)
    with pytest.raises(kiln.VerifyError, match=r"weights\.kar.*member 'weights\.bin'"):
        kiln.load(weights, keyring=keyring)

    manifest = tmp_path / "manifest.kar"
    _rewrite(good, manifest, "manifest.json",
             lambda d: d.replace(b'"image"', b'"imagf"'))
    with pytest.raises(kiln.VerifyError, match="bad signature"):
        kiln.load(manifest, keyring=keyring)

    # An intact artifact from a key the keyring does not hold is refused too.
    stranger = tmp_path / "stranger"
    subprocess.run([os.path.join(os.environ["KILN_BIN"], "kiln"), "keygen", "--out",
                    str(stranger)], check=True, capture_output=True, timeout=60)
    other_ring = tmp_path / "ring"
    other_ring.mkdir()
    (other_ring / "kiln.pub").write_bytes((stranger / "kiln.pub").read_bytes())
    with pytest.raises(kiln.VerifyError, match="not in keyring"):
        kiln.load(good, keyring=other_ring)


def test_error_messages_from_c_show_control_characters_escaped(tmp_path):
    """A message kiln's C side fills in (here: naming a path with an
    escape sequence, a C1 control and a byte that is not UTF-8) reaches
    Python with those written as \\xNN, as the CLI prints them: an
    exception's text never drives the reader's terminal."""
    name = b"model-\x1b[2J-\xc2\x9b-\xff.kar"
    path = os.path.join(os.fsencode(str(tmp_path)), name)
    with open(path, "wb") as f:
        f.write(b"not an artifact")
    with pytest.raises(kiln.KilnError) as exc:
        kiln.load(os.fsdecode(path))
    text = str(exc.value)
    assert "model-\\x1b[2J-\\x9b-\\xff.kar" in text, text
    assert not any(ord(c) < 0x20 and c not in "\n\t" for c in text), repr(text)
    assert not any(0x7F <= ord(c) <= 0x9F or 0xDC80 <= ord(c) <= 0xDCFF for c in text), repr(text)
