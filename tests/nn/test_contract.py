"""``tnspec.contract``: the functional form of a layer, and the executor of backward networks."""

from __future__ import annotations

import pytest
import torch

import tnspec

from ..zoo import CASES, spec

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", CASES[::7])
def test_contract_equals_the_layer(fmt, dims, stride, pad, dilation):
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    torch.manual_seed(0)
    layer = tnspec.layer(text, bias=False, sizes=sizes)
    x = torch.randn(2, *shape)
    cores = {c.name: getattr(layer, c.name) for c in layer.network.cores}
    assert torch.equal(tnspec.contract(text, x, cores), layer(x))  # sizes from the cores
    assert torch.equal(tnspec.contract(layer.network, x, cores), layer(x))
    with_bias = tnspec.layer(text, sizes=sizes)
    with torch.no_grad():
        with_bias.bias.normal_()
    assert torch.equal(tnspec.contract(text, x, dict(with_bias.named_parameters())),
                       with_bias(x))


def test_readme_backward_example():
    layer = tnspec.layer("x[b, c, 2*h+kh-1], U[c, r], K[r, kh, o] -> y[b, o, h]",
                         c=4, r=2, kh=3, o=5)
    x = torch.randn(2, 4, 11, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    got = tnspec.contract(tnspec.backward(layer.network, x.shape), dy,
                          cores=dict(layer.named_parameters()))
    assert torch.allclose(got, dx, rtol=1e-10, atol=1e-12)


def test_contract_errors_say_which_core():
    x = torch.randn(2, 4)
    with pytest.raises(tnspec.SpecError, match="cores= lacks 'B'"):
        tnspec.contract("x[b, i], A[i, r], B[r, o] -> y[b, o]", x, {"A": torch.ones(4, 2)},
                        o=3)
    with pytest.raises(tnspec.SpecError, match="'C', which is not a core"):
        tnspec.contract("x[b, i], A[i, o] -> y[b, o]", x, {"A": torch.ones(4, 2),
                                                           "C": torch.ones(1)})
    with pytest.raises(tnspec.SpecError, match=r"core 'A' has shape \[4, 2\], but A\[i, o\] is "
                                                r"\[4, 3\]"):
        tnspec.contract("x[b, i], A[i, o] -> y[b, o]", x, {"A": torch.ones(4, 2)}, o=3)
    with pytest.raises(tnspec.SpecError, match="index 'r' has size 2 in one core and 3 in 'B'"):
        tnspec.contract("x[b, i], A[i, r], B[r, o] -> y[b, o]", x,
                        {"A": torch.ones(4, 2), "B": torch.ones(3, 5)})


def test_cores_that_are_not_tensors_get_a_clear_error():
    with pytest.raises(TypeError, match=r"contract: cores\['W'\] is a list, not a "
                                        r"torch.Tensor; convert it with torch.as_tensor"):
        tnspec.contract("x[b, i], W[i, o] -> y[b, o]", torch.ones(2, 4), {"W": [[1.0] * 3] * 4})
