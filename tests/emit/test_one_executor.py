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

from ..generated import assert_same, class_for, load
from ..zoo import CASES, spec

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
    shape = tnspec.nn.api.example_shape(net, {}, default=9)
    same_code_same_numbers(text, sizes, (2,) + shape[1:], tmp_path)


# ---- inputs whose generated module used to fail to compile or to run ------------------------


def test_a_14_mode_tensorized_linear_wraps_its_long_init_lines_validly(tmp_path):
    text, sizes = formats.tt(2**14, 2**14, (), in_modes=14, out_modes=14, rank=2)
    source = tnspec.generate(text, sizes=sizes)
    assert max(map(len, source.splitlines())) <= 99
    same_code_same_numbers(text, sizes, (2, 2**14), tmp_path)


def test_a_scalar_output(tmp_path):
    same_code_same_numbers("x[c], W[c] -> y[]", {"c": 3}, (3,), tmp_path)


def test_a_size_expression_at_the_operand_limit_compiles(tmp_path):
    from tnspec.language.parse import MAX_EXPR_TERMS
    terms = " + ".join(f"a{i}" for i in range(MAX_EXPR_TERMS - 2)) + " - a0 // 2"
    params = ", ".join(f"a{i}=1" for i in range(MAX_EXPR_TERMS - 2))
    text = f"layer s({params}, o=2) {{\n  i = {terms}\n  x[b, i], W[i, o] -> y[b, o]\n}}\n"
    source = tnspec.generate(text)
    clean(source)
    module = load(source, tmp_path, "sum")
    assert module.S().sizes["i"] == MAX_EXPR_TERMS - 2
    assert module.S(a0=4).sizes["i"] == MAX_EXPR_TERMS - 2 + 3 - 2


@pytest.mark.parametrize("name, cls", [("f", "FLayer"), ("value_error", "ValueErrorLayer"),
                                       ("exception", "ExceptionLayer"), ("conv", "Conv")])
def test_class_names_never_shadow_the_module_imports_or_builtins(name, cls, tmp_path):
    text = f"layer {name}(i=2, o=3) {{\n  x[b, i], W[i, o] -> y[b, o]\n}}\n"
    source = tnspec.generate(text)
    clean(source)
    module = load(source, tmp_path, "names")
    assert getattr(module, cls)()(torch.ones(2, 2)).shape == (2, 3)


def test_two_layers_that_would_share_a_class_name_are_refused():
    text = "".join(f"layer {n}(i=2) {{\n  x[b, i], W[i] -> y[b]\n}}\n"
                   for n in ("foo_bar", "fooBar"))
    with pytest.raises(tnspec.SpecError, match="layers 'foo_bar' and 'fooBar' would both be class "
                       "FooBar"):
        tnspec.generate(text)


def test_a_step_with_more_than_52_indices_merges_them(tmp_path):
    n = 30
    names = {c: [f"{c}{k}" for k in range(n)] for c in "ijo"}
    text = (f"x[b, ({' '.join(names['i'])})], A[{', '.join(names['i'] + names['j'])}, p], "
            f"B[{', '.join(names['j'] + names['o'])}, p] -> y[b, ({' '.join(names['o'])})]")
    sizes = {k: 1 for v in names.values() for k in v} | dict(i0=2, i1=3, j0=2, o0=2, o2=3, p=2)
    torch.manual_seed(0)
    layer = tnspec.layer(text, sizes=sizes, planner="dense-first").double()
    assert layer.plan((4, 6)).steps[0].op == "einsum"  # A * B: 91 distinct indices
    x = torch.randn(4, 6, dtype=torch.double)
    weight = torch.einsum("iajp,jobp->iaob", layer.A.reshape(2, 3, 2, 2),
                          layer.B.reshape(2, 2, 3, 2)).reshape(6, 6)
    torch.testing.assert_close(layer(x), x @ weight + layer.bias)
    source = layer.source((4, 6))
    clean(source)
    generated = class_for(load(source, tmp_path, "wide"), layer.network)
    assert generated.spec == layer.spec
    with pytest.raises(ValueError, match=r"x: expected shape \[b, \(i0 i1 .* i29\)=6\], got "
                       r"\[4, 7\]"):
        layer(torch.randn(4, 7, dtype=torch.double))
