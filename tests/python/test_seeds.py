"""The seeds' examples (../shared/seeds/000 and 001) run as written, with
`kiln` in place of `torch.neuron` / `torch_neuronx`, and give eager
torch's results."""

import warnings

import pytest
import torch
import torch.nn as nn

import kiln


def test_seed_000_function_foo_is_traced_and_runs_compiled():
    def foo(x, y):
        return 2 * x + y

    # Run `foo` with the provided inputs and record the tensor operations
    traced_foo = kiln.trace(foo, (torch.rand(3), torch.rand(3)))

    assert isinstance(traced_foo, kiln.TracedModule)
    assert [s.name for s in traced_foo.input_specs] == ["x", "y"]
    x, y = torch.rand(3), torch.rand(3)
    out = traced_foo(x, y)
    assert isinstance(out, torch.Tensor) and out.shape == (3,)
    assert torch.allclose(out, foo(x, y), rtol=0, atol=1e-6)


def test_seed_001_function_compilation_example():
    def func(x, y):
        return 2 * x + y

    example_inputs = torch.rand(3), torch.rand(3)
    trace = kiln.trace(func, example_inputs)
    a, b = torch.rand(3), torch.rand(3)
    assert torch.allclose(trace(a, b), func(a, b), atol=1e-6)


class Net(nn.Module):
    """Seed 000's Net (its forward indented into the class, as intended)."""

    def __init__(self):
        super(Net, self).__init__()
        self.conv = nn.Conv2d(1, 1, 3)

    def forward(self, x):
        return self.conv(x)


def test_seed_000_net_module_and_its_forward_are_traced():
    n = Net()
    n.eval()
    example_weight = torch.rand(1, 1, 3, 3)  # noqa: F841 (as in the seed)
    example_forward_input = torch.rand(1, 1, 3, 3)

    # Trace a specific method and construct a module with a single forward
    module = kiln.trace(n.forward, example_forward_input)
    x = torch.rand(1, 1, 3, 3)
    with torch.no_grad():
        want = n(x)
    assert module(x).shape == (1, 1, 1, 1)
    assert torch.allclose(module(x), want, atol=1e-6)

    # Trace a module (implicitly traces `forward`)
    module = kiln.trace(n, example_forward_input)
    assert torch.allclose(module(x), want, atol=1e-6)


def test_seed_001_dynamic_batch_runs_batch_8_on_a_batch_1_trace():
    class Net(nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.conv = nn.Conv2d(1, 1, 3)

        def forward(self, x):
            return self.conv(x) + 1

    n = Net()
    n.eval()

    inputs = torch.rand(1, 1, 3, 3)
    inputs_batch_8 = torch.rand(8, 1, 3, 3)

    # Trace a neural network with input batch size of 1
    neuron_net = kiln.trace(n, inputs)

    # Enable the dynamic batch size feature
    neuron_net_dynamic_batch = kiln.dynamic_batch(neuron_net)
    assert neuron_net_dynamic_batch is neuron_net      # in place

    # Run inference on inputs with batch size of 8
    ouput_batch_8 = neuron_net_dynamic_batch(inputs_batch_8)

    with torch.no_grad():
        want = n(inputs_batch_8)
    assert ouput_batch_8.shape == (8, 1, 1, 1)
    assert torch.allclose(ouput_batch_8, want, atol=1e-6)
    # Smaller and odd batches too; each row is its own input's result.
    for size in (1, 3, 5):
        batch = torch.rand(size, 1, 3, 3)
        with torch.no_grad():
            assert torch.allclose(neuron_net(batch), n(batch), atol=1e-6)
    # A mismatch outside dimension 0 is a ValueError naming the input.
    with pytest.raises(ValueError, match=r"input 'x'.*\[N, 1, 3, 3\].*\[8, 1, 4, 3\]"):
        neuron_net(torch.rand(8, 1, 4, 3))


def test_dynamic_batch_refuses_inputs_differing_in_dimension_0():
    def add(a, b):
        return a * b + 1

    m = kiln.dynamic_batch(kiln.trace(add, (torch.rand(2, 3), torch.rand(2, 3))))
    a, b = torch.rand(7, 3), torch.rand(7, 3)
    assert torch.allclose(m(a, b), add(a, b), atol=1e-6)
    with pytest.raises(ValueError, match="'a' has 7, 'b' has 5"):
        m(a, torch.rand(5, 3))


def test_module_in_training_mode_is_returned_as_is_with_a_warning():
    n = Net()       # training mode by default
    x = torch.rand(1, 1, 3, 3)
    with pytest.warns(UserWarning, match="training mode"):
        assert kiln.trace(n, x) is n
    with pytest.warns(UserWarning, match="training mode"):
        assert kiln.trace(n.forward, x) == n.forward


def test_nested_outputs_come_back_nested_in_order():
    class Two(nn.Module):
        def forward(self, x):
            return x + 1, (x * 3, x - 2)

    m = Two().eval()
    x = torch.rand(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # no stray warnings from trace
        traced = kiln.trace(m, x)
    out = traced(torch.ones(2, 2))
    assert isinstance(out, tuple) and len(out) == 2
    assert isinstance(out[1], tuple) and len(out[1]) == 2
    for got, want in zip((out[0],) + out[1], (2.0, 3.0, -1.0)):
        assert torch.equal(got, torch.full((2, 2), want))


def test_runs_do_not_track_gradients_of_inputs():
    m = kiln.trace(lambda x: x * 2, torch.rand(4))
    x = torch.rand(4, requires_grad=True)
    out = m(x)
    assert not out.requires_grad
    assert torch.allclose(out, x.detach() * 2)
