"""The format library: every named format in every geometry computes what the dense reference
computes, the standard format is exactly torch's conv, and bad arguments are refused clearly."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

import tnspec
from tnspec import formats
from tnspec.nn import axes

from ..reference import dense_forward

pytestmark = pytest.mark.usefixtures("float64")

GEOMETRIES = {  # kernel_size, keyword arguments, input spatial shape
    "linear": ((), {}, ()),
    "1d": ((3,), {"padding": "same"}, (9,)),
    "2d-strided": ((3, 2), {"stride": (2, 1), "padding": (1, 0)}, (9, 8)),
    "2d-dilated": (3, {"dilation": 2, "padding": "same", "groups": 2}, (9, 9)),
    "3d": ((3, 3, 3), {"stride": 2}, (7, 7, 7)),
}
FORMATS = formats.NAMES


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", FORMATS)
def test_every_format_matches_the_dense_reference(name, geometry):
    kernel, kwargs, spatial = GEOMETRIES[geometry]
    if name == "depthwise_separable" and (not kernel or "groups" in kwargs):
        pytest.skip("depthwise_separable needs a kernel and takes no groups")
    fmt = getattr(formats, name)(12, 8, kernel, rank=2, **kwargs)
    torch.manual_seed(0)
    module = fmt.layer(dtype=torch.float64, bias=False)
    x = torch.randn(2, 12, *spatial)
    cores = {c.name: getattr(module, c.name) for c in module.network.cores}
    y = module(x)
    ref = dense_forward(module.network, x, cores)
    assert y.shape == ref.shape
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel, kwargs", [
    ((3, 5), {"stride": (2, 1), "padding": (1, 2), "dilation": (1, 2)}),
    (3, {"padding": "same", "groups": 4}),
    ((4,), {"stride": 3, "padding": 2}),
    ((3, 2, 3), {"padding": 1, "dilation": (2, 1, 1)}),
])
def test_the_standard_format_is_torchs_convolution(kernel, kwargs):
    fmt = formats.standard(8, 12, kernel, **kwargs)
    module = fmt.layer(dtype=torch.float64)
    with torch.no_grad():
        module.bias.normal_()
    dims = 2 if isinstance(kernel, int) else len(kernel)
    x = torch.randn(2, 8, *(10,) * dims)
    weight = module.W.reshape(12, 8 // kwargs.get("groups", 1), *module.W.shape[-dims:])
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    want = conv(x, weight, module.bias.reshape(-1), **kwargs)
    assert torch.allclose(module(x), want, rtol=1e-10, atol=1e-12)


def test_htk2_is_the_examples_network():
    fmt = formats.htk2(64, 64, 3, rank=10, phi=4, padding=1)
    example = tnspec.compile(open("examples/htk2.tn").read())
    net = tnspec.compile(fmt.spec, **fmt.sizes)
    assert [c.indices for c in net.cores] == [c.indices for c in example.cores]
    assert net.sizes == example.sizes


def test_modes_split_near_equally_and_as_given():
    sizes = formats.tt(64, 36, 3, rank=4).sizes
    assert (sizes["c0"], sizes["c1"], sizes["o0"], sizes["o1"]) == (8, 8, 6, 6)
    sizes = formats.tr(96, 96, 3, in_modes=(6, 4, 4), out_modes=3, rank=5).sizes
    assert [sizes[k] for k in ("c0", "c1", "c2")] == [6, 4, 4]
    assert sorted(sizes[k] for k in ("o0", "o1", "o2")) == [4, 4, 6]


@pytest.mark.parametrize("channels, modes", [
    (768, [12, 8, 8]), (3072, [16, 16, 12]), (4096, [16, 16, 16]), (1024, [16, 8, 8]),
    (256, [16, 16]), (64, [8, 8]), (10, [5, 2]), (17, [17]), (68, [17, 2, 2]), (1, [1])])
@pytest.mark.filterwarnings("ignore:tt_lora with rank=2 has")
def test_auto_modes_are_the_fewest_of_at_most_16(channels, modes):
    sizes = formats.tt_lora(channels, 8, rank=2, out_modes=1).sizes  # "auto": the default
    names = ["c"] if len(modes) == 1 else [f"c{i}" for i in range(len(modes))]
    assert [sizes[k] for k in names] == modes and f"c{len(modes)}" not in sizes
    assert axes.split_modes(channels, axes.small_modes(channels), "in", chosen=False) == modes


def test_auto_modes_give_tt_the_same_count_on_both_sides():
    sizes = formats.tt(768, 64, rank=2, in_modes="auto", out_modes="auto").sizes
    assert [sizes[k] for k in ("c0", "c1", "c2", "o0", "o1", "o2")] == [12, 8, 8, 4, 4, 4]


def test_a_fractional_rank_fits_the_parameter_budget():
    fmt = formats.tucker2(64, 64, 3, rank=0.25)
    params = tnspec.compile(fmt.spec, **fmt.sizes).num_parameters
    assert params <= 0.25 * 64 * 64 * 9
    bigger = formats.tucker2(64, 64, 3, rank=fmt.sizes["r0"] + 1)
    assert tnspec.compile(bigger.spec, **bigger.sizes).num_parameters > 0.25 * 64 * 64 * 9


@pytest.mark.parametrize("fn, channels, share, multiple, expected", [
    (formats.tucker2, 128, 0.25, 16, 48),  # 51 within the share, rounded down
    (formats.tucker2, 256, 0.25, 16, 96),  # 102
    (formats.tucker2, 64, 0.25, 8, 24),  # 25
    (formats.cp, 64, 0.25, 16, 64),  # already a multiple within the share
    (formats.tucker2, 16, 0.25, 16, 6),  # no multiple fits: the share's own rank
])
def test_rank_multiple_rounds_a_shares_rank_down(fn, channels, share, multiple, expected):
    fmt = fn(channels, channels, 3, rank=share, padding=1, rank_multiple=multiple)
    ranks = {v for k, v in fmt.sizes.items() if k.startswith("r")}
    assert ranks == {expected}
    assert tnspec.compile(fmt.spec, **fmt.sizes).num_parameters <= share * channels ** 2 * 9
    plain = fn(channels, channels, 3, rank=share, padding=1).sizes
    assert min(v for k, v in plain.items() if k.startswith("r")) >= expected


@pytest.mark.parametrize("call, match", [
    (lambda: formats.tucker2(64, 64, 3, rank=8, rank_multiple=16),
     "(?s)rank_multiple=16 with rank=8.*rounds the rank of a share"),
    (lambda: formats.tucker2(64, 64, 3, rank=0.25, rank_multiple=0),
     "(?s)rank_multiple=0 must be a positive int"),
])
def test_rank_multiple_needs_a_share_and_a_positive_int(call, match):
    with pytest.raises(tnspec.SpecError, match=match):
        call()


def test_rank_tuples_name_each_edge():
    fmt = formats.tucker2(16, 16, 3, rank=(3, 5))
    assert (fmt.sizes["r0"], fmt.sizes["r1"]) == (3, 5)
    assert "r" in formats.cp(16, 16, 3, rank=4).sizes


@pytest.mark.parametrize("call, match", [
    (lambda: formats.build("ttt", 4, 4), "(?s)unknown format 'ttt'.*choose one of.*htk2"),
    (lambda: formats.tucker2(4, 4, 3, rank=(1, 2, 3)), "(?s)has 2 rank edge.*rank=\\(1, 2, 3\\)"),
    (lambda: formats.tt(12, 8, 3, in_modes=(3, 3)), "multiply to 9, not 12"),
    (lambda: formats.tt(12, 8, 3, in_modes=(3, 4), out_modes=(8,)), "pairs input and output"),
    (lambda: formats.cp(4, 4, 3, stride=2, padding="same"), "padding='same' needs stride 1"),
    (lambda: formats.cp(4, 4, 4, padding="same"), "odd dilated kernel"),
    (lambda: formats.cp(4, 4, 3, padding="valid"), "unknown padding 'valid'"),
    (lambda: formats.cp(4, 4, (3, 3), stride=(1, 2, 3)), "stride \\(1, 2, 3\\) does not fit"),
    (lambda: formats.cp(6, 4, 3, groups=4), "groups=4 does not divide"),
    (lambda: formats.cp(4, 4, (1, 1, 1, 1)), "is not 1 to 3 positive sizes"),
    (lambda: formats.odd(16, 16, 3, in_modes=(2, 2, 4)), "2 input and 2 output modes"),
    (lambda: formats.tr(64, 64, 3, rank=0.0001), "even rank 1 has"),
    (lambda: formats.cp(64, 64, 3, rank=1.5), "share of the dense parameters"),
    (lambda: formats.cp(0, 8, 3), "in_channels=0 must be a positive int"),
    (lambda: formats.tucker2(8, -4, 3), "out_channels=-4 must be a positive int"),
    (lambda: formats.htk2(8, 8, 3, phi=0), "phi=0 must be a positive int"),
    (lambda: formats.cp(8, 8, 3, groups=0), "groups=0 must be a positive int"),
    (lambda: formats.cp(8.0, 8, 3), "in_channels=8.0 must be a positive int"),
    (lambda: formats.cp(8, 8, 3, rank=2.0), "share of the dense parameters"),
    (lambda: formats.tucker2(8, 8, 3, rank=(2, True)), "rank=\\(2, True\\)"),
    (lambda: formats.tt(8, 8, in_modes="many"), "in_modes='many' is not a number of modes"),
    (lambda: formats.tt(67, 64, 3, in_modes=2), "in_channels=67 has no split into 2 modes "
                                                "above 1 \\(factors: 67\\)"),
])
def test_bad_arguments_are_refused_clearly(call, match):
    with pytest.raises(tnspec.SpecError, match=match):
        call()


def test_random_formats_are_reproducible_and_valid():
    assert formats.random(3) == formats.random(3)
    for seed in range(30):
        fmt = formats.random(seed)
        net = tnspec.compile(fmt.spec, **fmt.sizes)
        assert 4 <= len(net.cores) <= 8
        assert len(net.input.axes[1]) in (2, 3) and len(net.output.axes[1]) in (2, 3)


def test_docstring_examples_run():
    result = doctest.testmod(formats)
    assert result.attempted > 0 and result.failed == 0


def test_a_rank_beyond_the_dense_layer_is_said():
    with pytest.warns(UserWarning, match="cp with rank=100000 has 13,400,000 parameters, more "
                      "than the 36,864 of the dense layer"):
        fmt = formats.cp(64, 64, 3, rank=100000)
    assert fmt.sizes["r"] == 100000  # said, not refused: over-parameterizing can be on purpose


def test_a_default_mode_split_that_needs_a_mode_of_1_is_said():
    with pytest.warns(UserWarning, match=r"in_channels=67 has too few factors for 2 modes: "
                      r"using \(67, 1\)"):
        fmt = formats.tt(67, 64, 3)
    assert (fmt.sizes["c0"], fmt.sizes["c1"]) == (67, 1)
    assert formats.tr(1, 64, 3).sizes["c1"] == 1  # one channel: nothing to split


def test_a_large_prime_factor_left_by_trial_division_is_a_mode():
    sizes = formats.tt(2 * 1_000_003, 4, (), rank=1).sizes  # division stops at sqrt(n)
    assert (sizes["c0"], sizes["c1"]) == (1_000_003, 2)


CONV_ATTRS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
              "groups")


@pytest.mark.parametrize("fmt", ["standard", "cp", "tucker2", "tt", "tr", "htk2"])
@pytest.mark.parametrize("kernel, kwargs", [
    ((3,), dict(stride=2, padding=1)),
    ((3, 5), dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2)),
    ((3, 1, 3), dict(padding=1)),
])
def test_conv_like_layers_have_nn_conv_attributes_and_take_unbatched_input(fmt, kernel, kwargs,
                                                                             tmp_path):
    from ..generated import class_for, load
    fmt_ = formats.build(fmt, 8, 12, kernel, rank=2, **kwargs)
    dense = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[len(kernel) - 1](
        8, 12, kernel, **kwargs)
    inline = fmt_.layer()
    module = load(tnspec.generate(fmt_.spec, sizes=fmt_.sizes), tmp_path, "attrs")
    generated = class_for(module, inline.network)()
    tensorized, _ = tnspec.tensorize(torch.nn.Sequential(dense), fmt, rank=2)
    for layer in (inline, generated, tensorized[0]):
        assert {a: getattr(layer, a) for a in CONV_ATTRS} == \
            {a: getattr(dense, a) for a in CONV_ATTRS}
    generated.load_state_dict(inline.state_dict())
    x = torch.randn(8, *[7] * len(kernel))
    for layer in (inline, generated):
        y = layer(x)
        assert y.shape == dense(x).shape
        assert torch.allclose(y, layer(x.unsqueeze(0))[0])


@pytest.mark.parametrize("fmt", ["standard", "low_rank", "tt", "tr", "odd"])
def test_linear_like_layers_have_nn_linear_attributes(fmt, tmp_path):
    from ..generated import class_for, load
    fmt_ = formats.build(fmt, 16, 36, (), rank=2)
    inline = fmt_.layer()
    module = load(tnspec.generate(fmt_.spec, sizes=fmt_.sizes), tmp_path, "lin")
    generated = class_for(module, inline.network)()
    for layer in (inline, generated):
        assert (layer.in_features, layer.out_features) == (16, 36)
        assert layer(torch.randn(16)).shape == (36,)
    assert not hasattr(tnspec.layer("x[b, c, h], W[c, o] -> y[b, o, h]", c=2, o=3),
                       "in_channels")  # not a conv: no spatial relation


@pytest.mark.parametrize("fmt", ["standard", "low_rank", "cp", "tucker", "tucker2", "htk2", "tt",
                                 "tr", "block_term", "odd", "hypernet", "depthwise_separable"])
@pytest.mark.parametrize("kernel, kwargs", [
    ((3,), dict(stride=2, padding=1)),
    ((3, 5), dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2)),
    ((3, 1, 3), dict(padding=1)),
    ((), {}),
])
@pytest.mark.filterwarnings("ignore:.*of the dense layer it stands for")
def test_dense_weight_is_the_layer_as_torch_runs_it(fmt, kernel, kwargs):
    if fmt == "depthwise_separable":
        if not kernel:
            return
        kwargs = {k: v for k, v in kwargs.items() if k != "groups"}
    layer = formats.build(fmt, 8, 12, kernel, rank=2, **kwargs).layer()
    with torch.no_grad():
        layer.bias.normal_()
    weight = layer.dense_weight()
    x = torch.randn(3, 8, *[9] * len(kernel))
    if kernel:
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
        assert weight.shape == (12, 8 // layer.groups, *kernel)
        want = conv(x, weight, layer.bias.reshape(-1), layer.stride, layer.padding,
                    layer.dilation, layer.groups)
    else:
        assert weight.shape == (12, 8)
        want = F.linear(x, weight, layer.bias.reshape(-1))
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-10)
    weight.sum().backward()  # differentiable in the cores
    assert all(p.grad is not None for n, p in layer.named_parameters() if n != "bias")


def test_dense_weight_of_a_network_that_is_no_conv_says_why():
    layer = tnspec.layer("x[b, t, c], W[c, o] -> y[b, t, o]", c=2, o=3)
    with pytest.raises(tnspec.SpecError, match="is not a conv or linear layer, so it has no "
                       "dense weight"):
        layer.dense_weight()
