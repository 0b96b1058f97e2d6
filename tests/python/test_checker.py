"""Torchvision models through kiln.trace with default arguments (nothing
downloaded: random weights, with BatchNorm statistics and zero-initialised
heads randomised so the outputs are not degenerate), and the default
check_trace in both directions: it passes every classifier it is given and
fails on a validly signed artifact whose program has one weight changed."""

import warnings

import pytest
import torch
import torchvision

import kiln
import sys

kiln_trace = sys.modules["kiln.trace"]
from kiln import check


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
        for p in model.parameters():
            if p.dim() >= 1 and float(p.abs().max()) == 0.0:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def _classifier(name, seed=0):
    kw = {"aux_logits": False, "init_weights": True} if name in ("inception_v3",
                                                                 "googlenet") else {}
    torch.manual_seed(seed)
    return _randomize(getattr(torchvision.models, name)(**kw), seed)


def _close(got, want, rel=1e-4):
    err, scale = check.output_error(got, want)
    assert scale > 1e-3, f"degenerate reference (max |y| = {scale})"
    assert err <= rel * scale, f"max abs error {err} at scale {scale}"


# Every classifier here traces whole with check_trace at its defaults: the
# trace itself is the assertion, and its outputs are compared once more
# here.  swin_t (shifted-window attention; its attention dropout exported
# in training mode with p = 0) was partitioned until the importer took
# that Dropout as the identity.
@pytest.mark.parametrize("name", ["resnet50", "vit_b_16", "convnext_tiny",
                                  "efficientnet_b0", "inception_v3", "regnet_y_400mf",
                                  "densenet121", "mobilenet_v3_large", "swin_t"])
def test_default_check_passes_torchvision_classifiers(name):
    model = _classifier(name)
    size = 299 if name == "inception_v3" else 224
    x = torch.rand(1, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = kiln.trace(model, x)
    assert not traced.partitioned
    y = torch.rand(1, 3, size, size)
    with torch.no_grad():
        _close(traced(y), model(y))


def test_deeplabv3_dict_output_comes_back_as_a_dict():
    torch.manual_seed(0)
    model = _randomize(torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=5, aux_loss=True), 0)
    x = torch.rand(1, 3, 128, 128)
    traced = kiln.trace(model, x)
    got = traced(x)
    with torch.no_grad():
        want = model(x)
    assert isinstance(got, dict) and list(got) == list(want) == ["out", "aux"]
    for k in want:
        _close(got[k], want[k])


def test_default_check_fails_on_an_artifact_with_one_weight_changed(monkeypatch):
    """A miscompile that is validly signed: the ONNX handed to the compiler
    has one weight of one convolution changed, as a compiler bug would
    change it; the default check must refuse the module."""
    import onnx
    import onnx.numpy_helper

    real = kiln_trace.compile_onnx

    def miscompile(onnx_bytes, **kw):
        m = onnx.load_from_string(onnx_bytes)
        for init in m.graph.initializer:
            a = onnx.numpy_helper.to_array(init).copy()
            if a.ndim == 4 and a.size > 1000:       # a convolution's weight
                a.flat[a.size // 2] += 0.5
                init.CopyFrom(onnx.numpy_helper.from_array(a, init.name))
                break
        else:
            raise AssertionError("no convolution weight found")
        return real(m.SerializeToString(), **kw)

    model = _classifier("resnet18", seed=3)
    x = torch.rand(1, 3, 224, 224)
    kiln.trace(model, x)            # the honest compile passes
    monkeypatch.setattr(kiln_trace, "compile_onnx", miscompile)
    with pytest.raises(kiln.TraceCheckError, match="output 0"):
        kiln.trace(model, x)
    # Without the check, the wrong module would have been returned.
    wrong = kiln.trace(model, x, check_trace=False)
    with torch.no_grad():
        err, scale = check.output_error(wrong(x), model(x))
    assert err > 1e-5 * scale
