"""Unit axes (``1`` in a core, as einops writes an axis of length 1): the language's way to store
a core in the layout its op reads, e.g. a 1x1 conv's weight ``U[r, c, 1, 1]``. The layer computes
what the same spec without them computes; a conv or linear takes such a core as stored."""

from __future__ import annotations

import random
import re

import pytest
import torch
from torch import nn

import tnspec
from tnspec import Role, SpecError

from ..generated import compare
from ..zoo import CASES, spec

pytestmark = pytest.mark.usefixtures("float64")  # exact comparisons, 1e-10


def with_units(text: str, seed: str) -> str:
    """``text`` with one or two unit axes put at drawn places in every core."""
    rng = random.Random(seed)
    lhs, rhs = text.split("->")
    operands = re.findall(r"(\w+)\[([^\]]*)\]", lhs)
    out = [f"{operands[0][0]}[{operands[0][1]}]"]
    for name, indices in operands[1:]:
        axes = [i.strip() for i in indices.split(",")]
        for _ in range(rng.choice((1, 2))):
            axes.insert(rng.randrange(len(axes) + 1), "1")
        out.append(f"{name}[{', '.join(axes)}]")
    return ", ".join(out) + " ->" + rhs


SOME = CASES[::5]  # every format and geometry: all cases ran at once took minutes


@pytest.mark.parametrize("op", [None, "conv1x1", "einsum"])
@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", SOME,
                         ids=["-".join(map(str, c)) for c in SOME])
def test_unit_axes_anywhere_in_the_zoo_match_the_dense_reference(fmt, dims, stride, pad,
                                                                   dilation, op, monkeypatch):
    if op is not None:  # channel mixing forced to 1x1 convs or to products
        monkeypatch.setattr(tnspec.planning.calibration, "chooser",
                            lambda *a, **k: lambda step: op)
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    united = with_units(text, text)
    torch.manual_seed(0)
    module = tnspec.layer(united, dtype=torch.float64, **sizes)
    x = torch.randn(2, *shape)
    compare(module, x)
    if dims == 2:
        compare(module, x.contiguous(memory_format=torch.channels_last))
    # the same layer as the spec without them: the same init, the cores only reshaped
    torch.manual_seed(0)
    plain = tnspec.layer(text, dtype=torch.float64, **sizes)
    for core in plain.network.cores:
        assert getattr(module, core.name).squeeze().shape == \
            getattr(plain, core.name).squeeze().shape
    assert module.network.params == plain.network.params


def test_a_unit_axis_is_an_axis_of_the_core_and_no_index():
    net = tnspec.compile("x[b, c], W[o, 1, c] -> y[b, o]", c=3, o=4)
    assert net.spec == "x[b, c], W[o, 1, c] -> y[b, o]"
    (unit,) = [ix for ix in net.indices if ix.role is Role.UNIT]
    assert unit.size == 1
    layer = tnspec.Layer(net)
    assert layer.W.shape == (4, 1, 3)
    assert "1." not in repr(layer)
    source = layer.source((2, 3))
    assert "torch.empty(o, 1, c," in source and "'1." not in source
    # the init is the one of W[o, c]: a unit axis sums one term
    assert "0.5 * c) ** (-1 / 2)" in source
    report = tnspec.explain(net)  # the core as written, the unit axes by core
    assert "unit axes    W (1)" in report and "W        [o, 1, c]" in report
    assert "1.W" not in report


def test_a_1x1_conv_and_a_linear_take_a_core_with_unit_axes_as_stored(monkeypatch):
    """Tucker-2's factors laid out as nn.Conv2d's weights: where channel mixing runs as 1x1
    convs (the choice on a GPU), forward reads no view of them."""
    monkeypatch.setattr(tnspec.planning.calibration, "chooser",
                        lambda *a, **k: lambda step: "conv1x1")
    layer = tnspec.layer("x[b, c, h+kh-1, w+kw-1], U[r0, c, 1, 1], G[r1, r0, kh, kw], "
                         "V[o, r1, 1, 1] -> y[b, o, h, w]", c=8, o=8, r0=4, r1=4, kh=3, kw=3,
                         planner="left-to-right")
    source = layer.source((2, 8, 6, 6))
    assert "F.conv2d(x, self.U)" in source and "self.V, bias=self.bias)" in source
    assert ".reshape(" not in source
    linear = tnspec.layer("x[b, c], U[r, c], V[o, r] -> y[b, o]", c=8, o=8, r=2)
    assert "F.linear(x, self.U)" in linear.source((2, 8))


@pytest.mark.parametrize("text, message, column", [
    ("x[b, 1, c], W[o, c] -> y[b, o]", r"unit axis 1 in 'x': only cores hold unit axes", 6),
    ("x[b, c], W[o, c] -> y[b, o, 1]", r"unit axis 1 in 'y': only cores hold unit axes", 29),
    ("x[b, c], W[o, c, 2] -> y[b, o]",
     r"axis 2 of core 'W': the one number an axis can be is 1 \(a unit axis\)", 18),
    ("x[b, c], W[o, c, ()] -> y[b, o]", r"group \(\) in core 'W'", 18),
])
def test_unit_axes_where_they_do_not_belong_are_clear_errors(text, message, column):
    with pytest.raises(SpecError, match=message) as info:
        tnspec.compile(text, c=3, o=4)
    assert info.value.column == column and info.value.hint
    if "()" in text:
        assert "write 1 for an axis of length 1" in info.value.hint


def test_tucker2_conv_checkpoints_from_before_unit_axes_load():
    """Tucker-2's 1x1 factors were 2-D: a state dict saved so loads into today's layer."""
    layer = tnspec.formats.tucker2(8, 8, 3, rank=4, padding=1).layer()
    old = {k: v.squeeze() if k in ("U", "V") else v for k, v in layer.state_dict().items()}
    assert old["U"].shape == (4, 8)
    fresh = tnspec.formats.tucker2(8, 8, 3, rank=4, padding=1).layer()
    fresh.load_state_dict(old)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 layer.state_dict().values()))
    with pytest.raises(RuntimeError, match="size mismatch for U"):
        fresh.load_state_dict({**old, "U": torch.zeros(8, 4)})


@pytest.mark.parametrize("geometry", [dict(kernel_size=(3,), padding=1),
                                      dict(kernel_size=3, stride=2, padding=1, dilation=2),
                                      dict(kernel_size=(3, 3, 3), padding=1)],
                         ids=["1-D", "2-D strided dilated", "3-D"])
def test_a_kernel_built_first_from_1x1_factors_is_two_transposed_convs(geometry):
    """Tucker-2's kernel built first (``dense-first``): V[o, r1, 1, 1] into G[r1, r0, kh, kw]
    and that into U[r0, c, 1, 1], each a transposed conv of the two as stored (a 1x1 input
    spreads the weight's kernel; a 1x1 weight mixes the input's channels), in every layout."""
    fmt = tnspec.formats.tucker2(8, 6, rank=3, **geometry)
    torch.manual_seed(0)
    layer = tnspec.layer(fmt.spec, sizes=fmt.sizes, planner="dense-first", autotune=False)
    n = len(layer.kernel_size)
    x = torch.randn(2, 8, *[7] * n)
    source = layer.source(tuple(x.shape))
    assert f"F.conv_transpose{n}d(self.V, self.G)" in source, source
    assert source.count(f"F.conv_transpose{n}d(") == 2 and "torch.matmul" not in source
    compare(layer, x)
    if n == 2:
        compare(layer, x.contiguous(memory_format=torch.channels_last))
    grouped = tnspec.formats.tucker2(8, 6, 3, rank=3, padding=1, groups=2)  # a g axis first:
    layer = tnspec.layer(grouped.spec, sizes=grouped.sizes, planner="dense-first")  # products
    assert "conv_transpose" not in layer.source((2, 8, 7, 7))
    compare(layer, torch.randn(2, 8, 7, 7))


@pytest.mark.parametrize("init", ["graph-in", "kaiming-in", "xavier", "orthogonal"])
def test_a_core_with_unit_axes_is_drawn_as_the_core_without_them(init):
    """A unit axis is storage: every init draws the same numbers as for the core without it,
    wherever the unit axes sit (an orthogonal core is drawn as the matrix it is without them,
    not as ``(1, o * c)``)."""
    sizes = dict(c=6, o=4, r=3)
    plain = "x[b, c], U[r, c], W[o, r] -> y[b, o]"
    for united in ("x[b, c], U[1, r, c], W[o, 1, r, 1] -> y[b, o]",
                   "x[b, c], U[r, c, 1], W[1, 1, o, r] -> y[b, o]"):
        torch.manual_seed(0)
        a = tnspec.layer(plain, init=init, **sizes)
        torch.manual_seed(0)
        b = tnspec.layer(united, init=init, **sizes)
        for name in ("U", "W"):
            assert torch.equal(getattr(b, name).reshape(getattr(a, name).shape),
                               getattr(a, name)), (init, united, name)


@pytest.mark.parametrize("fmt", ["low_rank", "cp", "tucker2"])
def test_loading_a_wrong_unit_axis_core_leaves_the_model_as_it_was(fmt):
    """The conv formats' cores hold unit axes: adapters whose state gives one of them another
    shape are refused before anything is set; the model (values, requires_grad, a frozen
    bias, a tied weight, the structure) is exactly as it was."""
    from ..model_state import snapshot, unchanged

    def net() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))
        model[5].weight = model[4].weight  # tied (not adapted)
        model[0].bias.requires_grad_(False)
        return model
    adapted, _ = tnspec.adapt(net(), fmt, rank=2, include=["0", "2"])
    state = tnspec.adapter_state_dict(adapted)
    key = next(k for k, v in state.items() if k.startswith("2.adapters.") and v.dim() == 4
               and v.shape[-1] == 1 and v.shape[-2] == 1)  # a 1x1 factor: [., ., 1, 1]
    state = {**state, key: torch.zeros(state[key].shape[1], state[key].shape[0])}
    target = net()
    before = snapshot(target)
    with pytest.raises(tnspec.SpecError, match="layer '2'"):
        tnspec.load_adapters(target, state, tnspec.adapter_config(adapted))
    assert unchanged(before, target)
