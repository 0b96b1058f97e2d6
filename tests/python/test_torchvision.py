"""torchvision's resnet18 and mobilenet_v2 (random weights, nothing
downloaded) traced through a broker and two workers started by the test,
compared with eager torch."""

import pytest
import torch
import torchvision

import kiln


def _randomize_batchnorm(model, seed):
    """Random BatchNorm statistics and affine parameters, so that the
    activations are far from the degenerate ones of a fresh init (a fresh
    mobilenet_v2 outputs values around 1e-9, which any tolerance accepts)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
    return model.eval()


def _compare(traced, model, x):
    with torch.no_grad():
        want = model(x)
    got = traced(x)
    assert got.shape == want.shape == (1, 1000)
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert scale > 1e-3, f"degenerate reference (max |y| = {scale})"
    assert err <= 1e-4 * max(1.0, scale), f"max abs error {err} at scale {scale}"
    assert torch.equal(got.argmax(1), want.argmax(1))


def test_resnet18_traced_through_the_farm(farm):
    torch.manual_seed(0)
    model = _randomize_batchnorm(torchvision.models.resnet18(), 0)
    image = torch.rand(1, 3, 224, 224)
    # seed 000 passes example_inputs as a list
    traced = kiln.trace(model, example_inputs=[image], broker=farm.endpoint,
                        keyring=farm.keyring)
    info = traced.compile_info
    assert info["mode"] == "farm"
    assert info["worker"] in ("worker-1", "worker-2"), (info, farm.logs())
    _compare(traced, model, torch.rand(1, 3, 224, 224))


def test_mobilenet_v2_traced_through_the_farm_named_by_env(farm, monkeypatch):
    torch.manual_seed(1)
    model = _randomize_batchnorm(torchvision.models.mobilenet_v2(), 1)
    monkeypatch.setenv("KILN_BROKER", farm.endpoint)
    monkeypatch.setenv("KILN_KEYRING", farm.keyring)
    traced = kiln.trace(model, torch.rand(1, 3, 224, 224))
    assert traced.compile_info["mode"] == "farm"
    assert traced.compile_info["worker"] in ("worker-1", "worker-2")
    _compare(traced, model, torch.rand(1, 3, 224, 224))


def test_a_second_trace_of_the_same_model_is_served_from_the_action_cache(farm):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.rand(1, 3, 16, 16)
    first = kiln.trace(model, x, broker=farm.endpoint, keyring=farm.keyring)
    second = kiln.trace(model, x, broker=farm.endpoint, keyring=farm.keyring)
    assert first.compile_info["cached"] is False
    assert second.compile_info["cached"] is True
    assert second.artifact == first.artifact
    assert torch.equal(first(x), second(x))


def test_farm_build_without_the_farm_key_is_refused_with_a_hint(farm, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    empty = tmp_path / "ring"
    empty.mkdir()
    with pytest.raises(kiln.VerifyError, match="farm's kiln.pub"):
        kiln.trace(model, torch.rand(1, 4), broker=farm.endpoint, keyring=empty)


def test_farm_compile_timeout_raises_timeout_expired(farm):
    import subprocess
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        kiln.trace(model, torch.rand(1, 3, 224, 224), broker=farm.endpoint,
                   keyring=farm.keyring, compiler_timeout=0.001)
    assert e.value.timeout == 0.001

