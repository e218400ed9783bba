"""One executor: an inline layer runs the very source ``tnspec compile`` writes. Over the whole
zoo and 200 random networks: the inline layer's source equals ``generate``'s for the same
plan, the module compiles cleanly (pyflakes, pycodestyle), and loaded from a file it gives
bit-identical outputs and gradients."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pycodestyle
import pytest
import torch
from pyflakes.api import check as pyflakes_check
from pyflakes.reporter import Reporter

import tnspec
from tnspec import formats

from .test_codegen import assert_same, class_for, load
from .zoo import CASES, spec

RANDOM = [formats.random(seed, kernel=(1, 3)[seed % 2], stride=1 + seed % 3 // 2)
          for seed in range(200)]


def planned_shape(net: tnspec.Network, shape) -> dict[str, int]:
    """``generate``'s --shape for a data tensor of ``shape``: batch and spatial axes by name."""
    return {axis[0]: n for axis, n in zip(net.input.axes, shape)
            if len(axis) == 1 and net.index(axis[0]).size is None}


def clean(source: str) -> None:
    compile(source, "generated", "exec")
    out = io.StringIO()
    assert pyflakes_check(source, "generated", Reporter(out, out)) == 0, out.getvalue()
    style = pycodestyle.Checker(lines=source.splitlines(True), max_line_length=99,
                                show_source=True, quiet=True)
    with redirect_stdout(io.StringIO()) as report:
        assert style.check_all() == 0, report.getvalue() + source


def same_code_same_numbers(text: str, sizes: dict, shape, tmp_path) -> None:
    torch.manual_seed(0)
    inline = tnspec.layer(text, sizes=sizes)
    source = tnspec.generate(text, shape=planned_shape(inline.network, shape), sizes=sizes)
    assert inline.source(shape) == source
    clean(source)
    generated = class_for(load(source, tmp_path, "one"), inline.network)()
    generated.load_state_dict(inline.state_dict())
    with torch.no_grad():
        if inline.bias is not None:
            for m in (inline, generated):
                m.bias.copy_(torch.linspace(-1, 1, m.bias.numel()).reshape(m.bias.shape))
    assert_same(inline, generated, torch.randn(*shape))


@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_zoo(fmt, dims, stride, pad, dilation, tmp_path):
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    same_code_same_numbers(text, sizes, (2, *shape), tmp_path)


@pytest.mark.parametrize("seed", range(len(RANDOM)))
def test_random_formats(seed, tmp_path):
    text, sizes = RANDOM[seed]
    net = tnspec.compile(text, sizes=sizes)
    shape = tnspec.api.example_shape(net, {}, default=9)
    same_code_same_numbers(text, sizes, (2,) + shape[1:], tmp_path)
