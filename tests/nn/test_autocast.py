"""Under autocast, tnspec layers (inline and generated) give the output dtype that nn.Conv2d and
nn.Linear give, with and without a bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tnspec

from ..generated import load

CONV = "x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]"
CONV_SIZES = dict(c=8, o=6, r0=3, r1=2, kh=3, kw=3)
LINEAR = "x[b, c], A[c, r], B[r, o] -> y[b, o]"
LINEAR_SIZES = dict(c=8, o=6, r=2)

DEVICES = [("cpu", torch.bfloat16)] + [
    pytest.param("cuda", dtype, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))
    for dtype in (torch.float16, torch.bfloat16)]


def _cases(device: str):
    return [(CONV, CONV_SIZES, nn.Conv2d(8, 6, 3, padding=1).to(device),
             torch.randn(2, 8, 7, 7, device=device)),
            (LINEAR, LINEAR_SIZES, nn.Linear(8, 6).to(device), torch.randn(4, 8, device=device))]


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_inline_layers_give_the_dtype_of_the_dense_layer(device, dtype, bias):
    for text, sizes, dense, x in _cases(device):
        layer = tnspec.layer(text, device=device, **sizes)
        if not bias:
            layer.bias = None
            dense.bias = None
        with torch.autocast(device, dtype):
            y, want = layer(x), dense(x)
        assert y.dtype == want.dtype == dtype
        y.float().sum().backward()  # the backward runs too
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in layer.parameters())
        with torch.no_grad():  # and the value is the float32 one, to bfloat16's precision
            torch.testing.assert_close(y.float(), layer(x), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_generated_layers_give_the_dtype_of_the_dense_layer(device, dtype, tmp_path):
    for n, (text, sizes, dense, x) in enumerate(_cases(device)):
        source = tnspec.generate(text, **sizes)
        module = load(source, tmp_path, f"autocast{n}")
        cls = [v for k, v in vars(module).items() if isinstance(v, type)
               and issubclass(v, nn.Module) and v.__module__ == module.__name__][0]
        layer = cls().to(device)
        assert layer.bias is not None
        with torch.autocast(device, dtype):
            assert layer(x).dtype == dense(x).dtype == dtype


def test_under_autocast_a_layer_is_planned_for_autocasts_dtype(monkeypatch):
    """The cost model (and the timed order, where autotuning is on) is that of the dtype the
    contraction runs in: planned once for float32 and once for bfloat16, each kept."""
    asked = []
    real = tnspec.planning.calibration.cost_model
    monkeypatch.setattr(tnspec.planning.calibration, "cost_model",
                        lambda device, dtype: asked.append(dtype) or real(device, dtype))
    layer = tnspec.layer(CONV, **CONV_SIZES)
    x = torch.randn(2, 8, 7, 7)
    layer(x)
    with torch.autocast("cpu", torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
        layer(x)
    assert layer(x).dtype == torch.float32
    assert asked == [torch.float32, torch.bfloat16]
    assert len(layer._classes) == 2
