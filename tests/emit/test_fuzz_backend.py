"""Differential fuzzing of the back end: random valid networks (the paper's random generator
and the named formats in random geometries, with indices and cores renamed to Python keywords,
builtins and the generated code's own temporaries) give the same values and gradients inline,
in the generated module, and in the independent dense reference."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tnspec
from tnspec import formats
from tnspec.nn.api import example_shape, generate

from ..generated import class_for, compare, load

pytestmark = [pytest.mark.usefixtures("float64"),  # tiny random layers, said in warnings:
              pytest.mark.filterwarnings("ignore:.*of the dense layer it stands for"),
              pytest.mark.filterwarnings("ignore:.*has too few factors")]
HOSTILE = ["lambda", "def", "class", "self", "print", "sum", "len", "input", "os", "sys",
           "math", "t1", "t2", "t3", "x_r", "std", "F", "nn", "kh_in", "b_", "None"]
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])


@st.composite
def networks(draw) -> tuple[str, dict[str, int]]:
    if draw(st.booleans()):
        fmt = formats.random(draw(st.integers(0, 10**6)), vertices=(2, 5), mode_size=(1, 3),
                             rank_size=(1, 3), kernel=draw(st.sampled_from([1, 3])),
                             stride=draw(st.sampled_from([1, 2])))
    else:
        name = draw(st.sampled_from([n for n in formats.NAMES if n != "odd"]))
        kernel = draw(st.sampled_from([(), (3,), (2, 3), (3, 1, 2)]))
        dims = len(kernel)
        groups = draw(st.sampled_from([1, 2])) if name != "depthwise_separable" else 1
        assume(kernel or name != "depthwise_separable")
        fmt = formats.build(
            name, 2 * draw(st.integers(1, 3)), 2 * draw(st.integers(1, 3)), kernel,
            rank=draw(st.integers(1, 3)), groups=groups,
            stride=tuple(draw(st.integers(1, 2)) for _ in range(dims)),
            padding=tuple(draw(st.integers(0, 2)) for _ in range(dims)),
            dilation=tuple(draw(st.integers(1, 2)) for _ in range(dims)))
    spec, sizes = fmt
    words = sorted(set(re.findall(r"[A-Za-z_]\w*", spec)))
    renamed = draw(st.dictionaries(st.sampled_from(words), st.sampled_from(HOSTILE),
                                   max_size=4))
    if len(set(renamed.values())) < len(renamed) or set(renamed.values()) & set(words):
        renamed = {}  # two words onto one name would change the network

    def rename(text: str) -> str:
        return re.sub(r"[A-Za-z_]\w*", lambda m: renamed.get(m.group(), m.group()), text)
    return rename(spec), {rename(k): v for k, v in sizes.items()}


@FUZZ
@given(networks())
def test_inline_generated_and_dense_reference_agree(tmp_path, case):
    spec, sizes = case
    try:
        net = tnspec.compile(spec, **sizes)
    except tnspec.SpecError as exc:  # only the names the checker refuses on purpose
        assert "clashes" in exc.message or "reserved" in exc.message or \
            "starts with" in exc.message, exc.message
        assume(False)
    shape = example_shape(net, {}, default=7)
    shape = (2,) + shape[1:]
    torch.manual_seed(0)
    inline = tnspec.layer(spec, dtype=torch.float64, **sizes)
    with torch.no_grad():
        if inline.bias is not None:
            inline.bias.normal_()
    batch = net.input.axes[0][0]
    module = load(generate(spec, shape={batch: 2}, **sizes), tmp_path, "fuzzed")
    generated = class_for(module, net)(dtype=torch.float64)
    generated.load_state_dict(inline.state_dict())
    x = torch.randn(shape, requires_grad=True)
    y_inline, y_generated = inline(x), generated(x)
    # planned for different input shapes, the two may sum in different orders
    assert torch.allclose(y_inline, y_generated, rtol=1e-9, atol=1e-11), spec
    compare(inline, x.detach(), rtol=1e-9)  # values and gradients against the dense reference
    g = torch.randn_like(y_inline)
    got = torch.autograd.grad((y_generated * g).sum(), [x, *generated.parameters()])
    want = torch.autograd.grad((inline(x) * g).sum(), [x, *inline.parameters()])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), spec


# ---- random .tn files: names, parameters, derived sizes and options from the grammar -------

LAYER_NAMES = ["f", "F", "nn", "torch", "value_error", "exception", "conv", "my_layer",
               "myLayer", "layer2", "x", "self", "print", "a_b_c", "Tensor"]
OPTIONS = {"init": ["graph-in", "graph-out", "graph-avg", "kaiming-in", "xavier", "orthogonal"],
           "activation": ["relu", "linear", "tanh", "gelu", "leaky_relu(0.2)", "0.7"],
           "bias": ["true", "false"], "distribution": ["normal", "uniform"],
           "stride_count": ["paper", "exact"]}


@st.composite
def tn_files(draw) -> str:
    """A .tn file of 1 to 3 layers: each network's sizes become parameters (renamed at times),
    some of them derived from the others, with random options."""
    names = draw(st.lists(st.sampled_from(LAYER_NAMES), min_size=1, max_size=3, unique=True))
    layers = []
    for name in names:
        spec, sizes = draw(networks())
        items = list(sizes.items())
        derived = draw(st.sets(st.sampled_from([k for k, _ in items]), max_size=2))
        params = [f"{k}={v}" for k, v in items if k not in derived]
        lines = []
        for k in derived:  # k = v written as an expression of a new parameter
            base = f"{k}_base"
            form = draw(st.sampled_from([  # each is d + b
                "{b} + {d}", "{b} * 2 - {b} + {d}", "({b} + {d}) // 1", "{d} + {b} * 1"]))
            params.append(f"{base}={draw(st.integers(1, 3))}")
            lines.append(f"{k} = " + form.format(b=base, d=sizes[k]) + f" - {base}")
        for key, values in OPTIONS.items():
            if draw(st.booleans()):
                lines.append(f"{key}: {draw(st.sampled_from(values))}")
        body = "\n    ".join(lines + [spec])
        layers.append(f"layer {name}({', '.join(params)}) {{\n    {body}\n}}\n")
    return "\n".join(layers)


@FUZZ
@given(tn_files())
def test_random_tn_files_compile_import_and_equal_the_inline_layers(tmp_path, text):
    try:
        source = generate(text)
    except tnspec.SpecError as exc:  # only what the checker refuses on purpose
        assert re.search("clashes|reserved|starts with|would both be class", exc.message), \
            exc.message
        assume(False)
    module = load(source, tmp_path, "tnfile")
    for net in tnspec.compile_all(text):
        torch.manual_seed(0)
        inline = tnspec.layer(text, name=net.name, dtype=torch.float64)
        generated = class_for(module, net)(dtype=torch.float64)
        generated.load_state_dict(inline.state_dict())
        shape = (2,) + example_shape(net, {}, default=7)[1:]
        x = torch.randn(shape)
        assert torch.allclose(inline(x), generated(x), rtol=1e-9, atol=1e-11), text
