"""Helpers for tests of generated modules: load a source as a module, find a layer's class in
it, compare it with the inline layer, and compare a layer with the independent dense reference.
"""

from __future__ import annotations

import importlib.util

import torch

import tnspec
from tnspec.emit.codegen import class_name

from .reference import dense_forward


def load(source: str, tmp_path, name: str = "generated"):
    """``source`` written to ``tmp_path`` and imported as a module."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def class_for(module, net):
    """The class ``codegen`` printed for ``net`` in the loaded ``module``."""
    return getattr(module, class_name(net))


def assert_same(inline: torch.nn.Module, generated: torch.nn.Module, x: torch.Tensor) -> None:
    """Same parameters, and bit-identical outputs and gradients on ``x``."""
    for (n1, p1), (n2, p2) in zip(inline.named_parameters(), generated.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    y1, y2 = inline(x1), generated(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for (n, p1), (_, p2) in zip(inline.named_parameters(), generated.named_parameters()):
        assert torch.equal(p1.grad, p2.grad), n


def compare(module: tnspec.Layer, x: torch.Tensor, rtol: float = 1e-10) -> None:
    """``module``'s outputs and gradients on ``x`` within ``rtol`` of the dense reference."""
    net = module.network
    x = x.clone().requires_grad_(True)
    cores = {c.name: getattr(module, c.name) for c in net.cores}
    y = module(x)
    ref = dense_forward(net, x, cores)
    if module.bias is not None:
        ref = ref + module.bias.reshape([s if any(
            net.index(i).role.value in ("output-mode", "parallel") for i in a) else 1
            for a, s in zip(net.output.axes, ref.shape)])
    assert y.shape == ref.shape
    scale = ref.abs().max().clamp_min(1e-30)
    assert ((y - ref).abs().max() / scale).item() < rtol
    g = torch.randn_like(y)
    params = [x, *cores.values()]
    got = torch.autograd.grad((y * g).sum(), params)
    want = torch.autograd.grad((ref * g).sum(), params)
    for a, b in zip(got, want):
        assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < rtol
