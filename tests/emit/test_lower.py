"""Stage 5, lower (and the code it becomes): typed nodes, folded sizes, no needless copies."""

from __future__ import annotations

import traceback

import pytest
import torch

import tnspec
from tnspec.emit.lower import lower
from tnspec.planning.plan import plan
from tnspec.program import Bias, Call, Let, Param, Require, Var
from tnspec.shapes import Size, bind_shape, conv_out


def program(text: str, shape, planner: str = "left-to-right", **sizes):
    return lower(plan(bind_shape(tnspec.compile(text, **sizes), shape), planner))


def test_nodes_name_the_torch_callable_and_pass_cores_directly():
    p = program("x[b, c, h+kh-1, w+kw-1], W[o, c, kh, kw] -> y[b, o, h, w]", (2, 3, 8, 8),
                c=3, o=4, kh=3, kw=3)
    (conv,) = [n for n in p.nodes if isinstance(n, Call)]
    assert conv.fn == "F.conv2d" and conv.args == (Var("x"), Param("W"))
    # stride, dilation and groups left at default; the bias added by the conv, as nn.Conv2d
    assert dict(conv.kwargs) == {"bias": Param("bias"), "padding": 1}
    assert conv.out == "y" and p.result == "y"
    assert not [n for n in p.nodes if isinstance(n, Bias)]


def test_the_last_conv_adds_the_bias_only_when_its_channels_are_the_bias_axis():
    """A bias over (o0 o1) is folded into a last conv over (o0 o1) channels; a bias over two
    output axes stays a separate add. Both equal the dense computation with a random bias."""
    grouped = tnspec.layer("x[b, (c0 c1), h+kh-1, w+kw-1], A[c0, r], K[r, c1, kh, kw, o0, o1] "
                           "-> y[b, (o0 o1), h, w]", c0=2, c1=3, r=2, o0=2, o1=2, kh=3, kw=3)
    two_axes = tnspec.layer("x[b, c, h+kh-1, w+kw-1], W[o, p, c, kh, kw] -> y[b, o, p, h, w]",
                            c=6, o=2, p=2, kh=3, kw=3)
    x = torch.randn(2, 6, 8, 8)
    for layer, folded in ((grouped, True), (two_axes, False)):
        nodes = layer.program(x.shape).nodes
        last = [n for n in nodes if isinstance(n, Call) and n.fn == "F.conv2d"][-1]
        assert ("bias" in dict(last.kwargs)) is folded
        assert any(isinstance(n, Bias) for n in nodes) is not folded
        with torch.no_grad():
            layer.bias.normal_()
        weight = layer.dense_weight() if folded else layer.W.reshape(4, 6, 3, 3)
        want = torch.nn.functional.conv2d(x, weight, layer.bias.reshape(-1), padding=1)
        torch.testing.assert_close(layer(x).reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_sizes_are_folded():
    h, k = Size.of("h_in"), Size.of("kh")
    assert str(conv_out(h, k, 1, 1, 1)) == "h_in - kh + 3"
    assert conv_out(h, 3, 1, 1, 1) == h  # padding-preserving with a constant kernel
    assert str(conv_out(h, k, 2, 1, 1)) == "(h_in - kh) // 2 + 2"
    assert conv_out(h, k, 2, 1, 1).evaluate({"h_in": 9, "kh": 3}) == conv_out(9, 3, 2, 1, 1)
    text = "layer l(c=2, o=3) {\n kh = 3\n x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]\n}"
    # h = h_in: nothing to compute or check, so the forward holds no size arithmetic at all
    assert not [n for n in program(text, (2, 2, 7)).nodes if isinstance(n, (Let, Require))]
    lets = [n for n in program(text.replace("kh = 3", "kh = c + 1"), (2, 2, 7)).nodes
            if isinstance(n, Let)]
    assert [(n.out, str(n.value)) for n in lets] == [("h", "h_in - kh + 3")]


def test_grouped_modes_are_reshaped_once_each_way():
    text = "x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]"
    p = program(text, (4, 6), i0=2, i1=3, o0=2, o1=2, r=2)
    reshapes = [n for n in p.nodes if isinstance(n, Call) and n.fn == ".reshape"]
    sources = [n.args[0] for n in reshapes]
    assert len(set(sources)) == len(sources)  # no reshape of a reshape


def test_backward_network_prints_spread_flip_and_explicit_padding():
    layer = tnspec.layer("x[b, c, 2*h+kh-1], W[o, c, kh] -> y[b, o, h]", c=2, o=3, kh=3,
                         bias=False)
    x = torch.randn(2, 2, 9)
    bwd = tnspec.backward(layer.network, x.shape)
    fns = [n.fn for n in lower(plan(bind_shape(bwd, (2, 3, 5)))).nodes if isinstance(n, Call)]
    assert {".flip", "F.pad", "F.conv1d"} <= set(fns)


def test_tracebacks_show_the_generated_line():
    layer = tnspec.layer("x[b, c], W[c, o] -> y[b, o]", c=2, o=3)
    with pytest.raises(RuntimeError) as info:  # torch refuses integer data inside forward
        layer(torch.ones(2, 2, dtype=torch.int64))
    text = "".join(traceback.format_exception(info.value))
    assert "<tnspec-generated-" in text
    assert "y = torch.matmul(x, self.W)" in text  # W taken as stored, inputs first


def test_a_weight_stored_inputs_first_is_multiplied_as_it_is():
    """``W[c, o]`` is ``x @ W``, as one would write it: F.linear would read it through a
    permute and a transpose (views forward and back); the bias, ending the output, is added
    as stored. ``W[o, c]`` keeps ``F.linear`` with the bias in it."""
    x = torch.randn(5, 4)
    for text, fn in [("x[b, c], W[c, o] -> y[b, o]", "torch.matmul(x, self.W)"),
                     ("x[b, c], W[o, c] -> y[b, o]", "F.linear(x, self.W, self.bias)")]:
        layer = tnspec.layer(text, c=4, o=3)
        with torch.no_grad():
            layer.bias.normal_()
        source = layer.source(tuple(x.shape))
        assert fn in source and ".permute" not in source and ".reshape" not in source, source
        w = layer.W if text.startswith("x[b, c], W[c") else layer.W.t()
        torch.testing.assert_close(layer(x), x @ w + layer.bias)
    assert "y = y + self.bias.to(y.dtype)" in tnspec.layer(
        "x[b, c], W[c, o] -> y[b, o]", c=4, o=3).source((5, 4))


def test_source_of_the_inline_layer_is_what_generate_writes():
    text = "x[b, c, h+kh-1], U[c, r], V[r, o, kh] -> y[b, o, h]"
    sizes = dict(c=4, r=2, o=3, kh=3)
    layer = tnspec.layer(text, **sizes)
    assert layer.source((5, 4, 11)) == tnspec.generate(text, shape={"b": 5, "h+kh-1": 11},
                                                       **sizes)


def test_a_pointwise_layer_mixes_channels_with_a_1x1_conv_across_its_plain_axes():
    """x[b, C, h, w] -> y[b, O, h, w] without a kernel: h and w are plain axes, and the data
    step is a 1x1 conv over them (no permuted copy for an F.linear), bias included: 2-D
    eagerly (the same kernel as 1-D, without the reshapes), and in the form torch.compile
    traces 1-D over the flattened axes for a contiguous input (Inductor wraps the 2-D form in
    copies), 2-D for a channels-last one (where flattening would copy)."""
    from tnspec.emit.lower import lower
    layer = tnspec.layer("x[b, (c0 c1), h, w], A[c0, o0, r], B[r, c1, o1] -> y[b, (o0 o1), h, w]",
                         c0=12, c1=8, o0=12, o1=8, r=4, planner="dense-first", autotune=False)
    plan = layer.plan((32, 96, 32, 32))
    for channels_last, compiled, conv in ((False, False, "F.conv2d"), (True, False, "F.conv2d"),
                                          (False, True, "F.conv1d"), (True, True, "F.conv2d")):
        program = lower(plan, channels_last, compiled=compiled)
        calls = [n for n in program.nodes if isinstance(n, Call)]
        assert [c.fn for c in calls if c.fn.startswith("F.")] == [conv]
        assert not [c for c in calls if c.fn == ".permute" and Var("x") in c.args]
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(2, 96, 5, 4)
    weight = torch.einsum("aor,rcp->opac", layer.A, layer.B).reshape(96, 96)
    want = torch.einsum("oc,bchw->bohw", weight, x) + layer.bias.reshape(1, 96, 1, 1)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


def test_the_last_conv_gives_the_output_channels_in_the_outputs_order():
    """A core (or a kernel built among cores) may hold the output modes in any order; the
    kernel is permuted (small), never the conv's output (data-sized)."""
    layer = tnspec.layer("x[b, c, h+kh-1, w+kw-1], W[o1, o0, c, kh, kw] -> y[b, (o0 o1), h, w]",
                         c=4, o0=2, o1=3, kh=3, kw=3)
    nodes = [n for n in layer.program((2, 4, 10, 10)).nodes if isinstance(n, Call)]
    conv = next(k for k, n in enumerate(nodes) if n.fn == "F.conv2d")
    assert [n.fn for n in nodes[conv + 1:]] in ([], [".reshape"])
    x = torch.randn(2, 4, 10, 10)
    want = torch.nn.functional.conv2d(x, layer.dense_weight(), layer.bias.reshape(-1),
                                      padding=1)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True])
def test_channel_mixing_by_einsum_keeps_no_copy_of_the_data_for_backward(monkeypatch,
                                                                          channels_last):
    """A mixing step that runs as an einsum multiplies views of the data: over a contiguous
    input a torch.bmm of the (r, c) weight expanded over the batch and the (b, c, h*w) data
    (an einsum would copy the data channels-last and keep that copy for backward), over a
    channels-last one a torch.mm of the (b*h*w, c) matrix the data is stored as (a view) and
    the weight's transpose. Either way nothing input-sized but the input itself is saved,
    and the result is the dense conv's."""
    monkeypatch.setattr(tnspec.planning.calibration, "chooser",
                        lambda *a, **k: lambda step: "einsum")
    layer = tnspec.layer("x[b, c, h+kh-1, w+kw-1], A[c, r], KH[kh, r], KW[kw, r], B[r, o] "
                         "-> y[b, o, h, w]", c=24, o=24, r=3, kh=3, kw=3, planner="left-to-right",
                         autotune=False)
    x = torch.randn(4, 24, 9, 9, requires_grad=True)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    saved = []

    def keep(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = layer(x)
    source = tnspec.emit.runtime.source_of(layer._last_class.forward)
    assert ("torch.bmm(A_e, x_r)" in source) is not channels_last
    assert ("torch.mm(x_r, " in source) is channels_last
    assert "torch.einsum('abcd" not in source
    copies = [t for t in saved if t.numel() >= x.numel() and
              t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]
    assert not copies
    want = torch.nn.functional.conv2d(x, layer.dense_weight(), layer.bias, padding=1)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(want))
    (gw,) = torch.autograd.grad(want, x, torch.ones_like(want))
    torch.testing.assert_close(gx, gw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("spec", [
    "x[b, c, h+kh-1, w+kw-1], A[r, c], KH[r, kh], KW[r, kw], B[o, r] -> y[b, o, h, w]",
    "x[b, c, h+kh-1, w+kw-1], A[c, r], KH[kh, r], KW[kw, r], B[r, o] -> y[b, o, h, w]",
    "x[b, c, 2*h+kh-1, w+kw-1], A[c, r], K[kh, kw, r], B[o, r] -> y[b, o, h, w]",
])
def test_a_kernel_built_by_outer_products_is_the_dense_layers(spec, channels_last):
    """Outer products of cores (CP's kernels) are one broadcast multiply of the cores viewed
    as stored, in the order the conv reads or the nearest that reads both cores as stored:
    forward and gradients equal the independent dense reference's, in every order a planner
    gives, contiguous and channels-last."""
    from ..reference import dense_forward
    multiplied = []
    for planner in ("auto", "dense-first", "left-to-right"):
        torch.manual_seed(0)
        layer = tnspec.layer(spec, c=6, o=5, r=3, kh=3, kw=2, bias=False, planner=planner,
                             autotune=False).double()
        x = torch.randn(2, 6, 9, 8, dtype=torch.float64)
        if channels_last:
            layer = layer.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        y = layer(x)
        source = tnspec.emit.runtime.source_of(layer._last_class.forward)
        if "torch.mul(" in source:
            multiplied.append(planner)
        cores = {c.name: getattr(layer, c.name) for c in layer.network.cores}
        want = dense_forward(layer.network, x, cores)
        torch.testing.assert_close(y, want)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, *cores.values()], g)
        expected = torch.autograd.grad(want, [x, *cores.values()], g)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
    assert multiplied, "no order built a kernel by a broadcast multiply"


def test_unit_axes_go_into_the_factors_of_an_outer_product():
    """A product of two reshaped tensors, reshaped only to insert unit axes, takes them in
    its factors' reshapes (the last reshape goes); any other reshape of it stays."""
    from tnspec.emit.products import fold_unit_axes
    from tnspec.shapes import Size
    r, c, kw = Size.of("r"), Size.of("c"), Size.of("kw")

    def nodes(*last):
        return [Call("A_v", ".reshape", (Param("A"), r, c, 1)),
                Call("C_v", ".reshape", (Param("C"), r, 1, kw)),
                Call("t", "torch.mul", (Var("A_v"), Var("C_v"))),
                Call("t_r", ".reshape", (Var("t"), *last))]
    folded = fold_unit_axes(nodes(r, c, 1, kw))
    assert folded == [Call("A_v", ".reshape", (Param("A"), r, c, 1, 1)),
                      Call("C_v", ".reshape", (Param("C"), r, 1, 1, kw)),
                      Call("t_r", "torch.mul", (Var("A_v"), Var("C_v")))]
    for other in [(r * c, 1, kw), (r, kw, 1, c)]:  # a merge; another order
        assert fold_unit_axes(nodes(*other)) == nodes(*other)
    shared = nodes(r, c, 1, kw) + [Call("u", ".sum", (Var("t"),))]  # t read twice
    assert fold_unit_axes(shared) == shared
