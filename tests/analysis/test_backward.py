"""The reproducing transformation: executing G_bt reproduces autograd's dx, for the whole zoo."""

from __future__ import annotations

import pytest
import torch

import tnspec
from tnspec.nn.api import example_shape

from ..conftest import EXAMPLES
from ..reference import dense_forward
from ..zoo import CASES, spec

pytestmark = pytest.mark.usefixtures("float64")  # exact comparisons, 1e-10


def backward_dx(module: tnspec.Layer, x_shape, dy: torch.Tensor) -> torch.Tensor:
    """Execute the backward network with the forward cores (flipped as G_bt says)."""
    bwd = tnspec.backward(module.network, x_shape)
    return tnspec.contract(bwd, dy, cores={c.name: getattr(module, c.name) for c in bwd.cores})


def check_against_autograd(module: tnspec.Layer, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    y = module(x)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    got = backward_dx(module, x.shape, dy)
    assert got.shape == x.shape
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-10


@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_backward_network_reproduces_autograd(fmt, dims, stride, pad, dilation):
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    torch.manual_seed(0)
    module = tnspec.layer(text, bias=False, **sizes)
    # an input size that leaves a remainder for strides 2 and 3
    check_against_autograd(module, torch.randn(2, *shape))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_backward(path):
    text = path.read_text()
    for net in tnspec.compile_all(text):
        torch.manual_seed(0)
        module = tnspec.layer(text, name=net.name, bias=False)
        check_against_autograd(module, torch.randn(*example_shape(net, {"b": 2}, default=7)))


def test_subsampling_backward_crops_and_spreads():
    module = tnspec.layer("x[b, c, 3*t-1], D[c, o] -> y[b, o, t]", c=2, o=3, bias=False)
    check_against_autograd(module, torch.randn(2, 2, 10))


def test_backward_structure_is_the_papers_transformation():
    net = tnspec.compile("x[b, c, 2*h+2*kh-1], W[c, o, kh] -> y[b, o, h]", c=2, o=3, kh=3)
    bwd = tnspec.backward(net)
    (conv,) = bwd.convs
    # dy spread by the stride (T), kernel reversed (R), padding d(K-1) - p, stride 1
    assert (conv.source, conv.target, conv.kernel) == ("h", "2*h+2*kh-1", "kh")
    assert (conv.stride, conv.dilation, conv.padding, conv.input_dilation) == (1, 2, 2 * 2 - 1, 2)
    assert bwd.cores[0].flipped == frozenset({"kh"})
    assert bwd.input.name == "dy" and bwd.output.name == "dx"
    assert bwd.input.axes == net.output.axes and bwd.output.axes == net.input.axes


def test_dense_reference_of_the_backward_network_agrees():
    # the reference builds P' from the backward relation (T and R included) independently
    text, sizes, shape = spec("tucker2", 2, 2, "large", 2)
    torch.manual_seed(0)
    module = tnspec.layer(text, bias=False, **sizes)
    x = torch.randn(2, *shape, requires_grad=True)
    y = module(x)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    bwd = tnspec.backward(module.network, x.shape)
    cores = {c.name: getattr(module, c.name) for c in module.network.cores}
    got = dense_forward(bwd, dy, cores, out_sizes=dict(bwd.sizes))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
