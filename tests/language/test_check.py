"""Stage 2: AST -> ir.Network. Every semantic error class, with message and position."""

from __future__ import annotations

import keyword

import pytest
import torch

import tnspec
from tnspec import Role, SpecError
from tnspec.ir import RESERVED_NAMES
from tnspec.shapes import conv_out

HTK2 = ("x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi]"
        " -> y[b, o, h, w]")
HTK2_SIZES = dict(c=64, o=64, r0=10, r1=10, kh=3, kw=3, phi=4)


def located(text: str, message: str, line: int, column: int, **sizes) -> SpecError:
    with pytest.raises(SpecError, match=message) as info:
        tnspec.compile(text, **sizes)
    err = info.value
    assert (err.line, err.column) == (line, column), err
    assert err.excerpt.splitlines()[-1].strip().startswith("^")
    assert err.hint
    return err


# ---- the IR ---------------------------------------------------------------------------------

def test_htk2_roles_sizes_and_relations():
    net = tnspec.compile(HTK2, **HTK2_SIZES)
    roles = {ix.name: ix.role for ix in net.indices}
    assert roles == {
        "b": Role.BATCH, "c": Role.INPUT_MODE, "h+kh-1": Role.SPATIAL_IN,
        "w+kw-1": Role.SPATIAL_IN, "r0": Role.RANK, "phi": Role.HYPEREDGE, "r1": Role.RANK,
        "kh": Role.KERNEL, "kw": Role.KERNEL, "o": Role.OUTPUT_MODE, "h": Role.SPATIAL_OUT,
        "w": Role.SPATIAL_OUT}
    assert net.sizes == HTK2_SIZES
    assert [(c.source, c.target, c.kernel, c.stride, c.dilation, c.padding) for c in net.convs] \
        == [("h+kh-1", "h", "kh", 1, 1, 1), ("w+kw-1", "w", "kw", 1, 1, 1)]
    assert [c.name for c in net.cores] == ["U", "G", "V"]
    assert net.cores[1].indices == ("r0", "r1", "kh", "kw", "phi")
    assert net.input.name == "x" and net.output.name == "y"


def test_spec_is_canonical_and_round_trips():
    net = tnspec.compile("x[b,(i0 i1), 2 * h + kh - 1], W[ i0,i1 ,kh,o]->y[b, o, h]",
                         i0=2, i1=3, kh=3, o=4)
    assert net.spec == "x[b, (i0 i1), 2*h+kh-1], W[i0, i1, kh, o] -> y[b, o, h]"
    assert tnspec.compile(net.spec, i0=2, i1=3, kh=3, o=4) == net


@pytest.mark.parametrize("affine, stride, dilation, padding", [
    ("h+kh-1", 1, 1, 1), ("2*h+kh-1", 2, 1, 1), ("h+2*kh-2", 1, 2, 2), ("2*t+k", 2, 1, 0),
    ("3*h+2*kh", 3, 2, 0), ("kh+h-1-1", 1, 1, 2)])
def test_affine_terms_give_stride_dilation_padding(affine, stride, dilation, padding):
    tgt = "t" if "t" in affine else "h"
    ker = "k" if tgt == "t" else "kh"
    net = tnspec.compile(f"x[b, {affine}], W[{ker}, o] -> y[b, o, {tgt}]", **{ker: 3, "o": 2})
    (conv,) = net.convs
    assert (conv.stride, conv.dilation, conv.padding) == (stride, dilation, padding)


def test_subsampling_without_kernel_and_parallel_index():
    net = tnspec.compile("x[b, c, 2*h], D[c, o] -> y[b, c, o, h]", c=3, o=2)
    assert net.convs[0].kernel is None and net.index("c").role == Role.PARALLEL


def test_pytorch_output_size_formula():
    net = tnspec.compile("x[b, 2*h+2*kh-3], W[kh] -> y[b, h]", kh=3)
    # floor((in + 2p - d(K-1) - 1)/s) + 1 with s=2, d=2, p=3, K=3
    c = net.convs[0]
    assert conv_out(32, 3, c.stride, c.dilation, c.padding) == (32 + 6 - 4 - 1) // 2 + 1


def test_file_sizes_defaults_overrides_and_derived():
    # derived sizes are evaluated in written order; the network may stand anywhere
    text = "layer l(c=4, r=2) {\n x[b, c], A[c, r2], B[r2, o2] -> y[b, o2]\n r2 = o2 - r\n o2 = 5\n}"
    with pytest.raises(SpecError, match="size 'o2' is not defined here"):
        tnspec.compile(text)
    text = "layer l(c=4, r=2) {\n x[b, c], A[c, r2], B[r2, o2] -> y[b, o2]\n o2 = 5\n r2 = o2 - r\n}"
    assert tnspec.compile(text).sizes["r2"] == 3
    text = "layer l(c=4, r=2) {\n r2 = r * 3 - 1\n o2 = c // 2\n x[b, c], A[c, r2], B[r2, o2] -> y[b, o2]\n}"
    assert tnspec.compile(text).sizes == {"c": 4, "r2": 5, "o2": 2}
    assert tnspec.compile(text, r=3, c=8).sizes == {"c": 8, "r2": 8, "o2": 4}


def test_options_are_read():
    text = "layer l(i=2, o=2) {\n init: graph-out\n activation: leaky_relu(0.1)\n bias: false\n x[b, i], W[i, o] -> y[b, o]\n}"
    opts = tnspec.compile(text).options
    assert (opts.init, opts.activation, opts.activation_param, opts.bias) == \
        ("graph-out", "leaky_relu", 0.1, False)
    assert tnspec.compile(text.replace("leaky_relu(0.1)", "0.5")).options.activation == 0.5


def test_layer_selection():
    text = "layer a(i=2) { x[b, i], W[i, j] -> y[b, j] j = 2 }\nlayer b(i=2, j=3) { x[b, i], W[i, j] -> y[b, j] }"
    with pytest.raises(SpecError, match=r"the file has 2 layers \(a, b\); say which one"):
        tnspec.compile(text)
    with pytest.raises(SpecError, match="no layer named 'c'"):
        tnspec.compile(text, name="c")
    assert tnspec.compile(text, name="b").sizes == {"i": 2, "j": 3}


def test_reserved_names_cover_every_module_attribute():
    public = {n for n in dir(torch.nn.Module()) if not n.startswith("_")}
    assert public <= RESERVED_NAMES
    layer = tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=2, o=2)
    own = {n for n in dir(layer) if not n.startswith("_")} - {"W"}
    assert own <= RESERVED_NAMES


def test_python_keywords_are_allowed_as_core_names():
    # registered under their own name; generated code mangles them (back end)
    net = tnspec.compile("x[b, i], lambda[i, o] -> y[b, o]", i=2, o=3)
    assert net.cores[0].name == "lambda" and keyword.iskeyword("lambda")


# ---- every bad-input class, with message and position ---------------------------------------

def test_output_index_no_operand_provides():
    located("x[b, c], W[c, o] -> y[b, o, q]", "output index 'q' is provided by no operand",
            1, 29, c=2, o=3)


def test_core_index_without_size_inline_and_in_file():
    err = located("x[b, c], W[c, o] -> y[b, o]", "core index 'o' has no size", 1, 15, c=2)
    assert "pass o=<size>" in err.hint
    err = located("layer l(c=2) {\n  x[b, c], W[c, o] -> y[b, o]\n}", "core index 'o' has no size",
                  2, 17)
    assert "layer's parameters" in err.hint


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True, None])
def test_size_not_a_positive_integer(bad):
    with pytest.raises(SpecError, match=r"size o=.* must be a positive integer"):
        tnspec.compile("x[b, c], W[c, o] -> y[b, o]", c=2, o=bad)


def test_size_zero_in_file_and_derived():
    located("layer l(c=0) {\n x[b, c], W[c] -> y[b]\n}", "size c=0 must be a positive integer",
            1, 9)
    located("layer l(c=2) {\n k = c - 2\n x[b, c], W[c, k] -> y[b, k]\n}",
            "size k evaluates to 0", 2, 2)


def test_numpy_integer_sizes_are_accepted():
    np = pytest.importorskip("numpy")
    assert tnspec.compile("x[b, c], W[c, o] -> y[b, o]", c=np.int64(2), o=3).sizes["c"] == 2


def test_unknown_size_keyword():
    with pytest.raises(SpecError, match=r"size oo=3 names no index of the spec") as info:
        tnspec.compile("x[b, c], W[c, o] -> y[b, o]", c=2, o=3, oo=3)
    assert "did you mean 'o'" in info.value.hint


def test_affine_outside_input():
    located("x[b, c], W[c, o] -> y[b, o, h+k-1]",
            "affine index 'h\\+k-1' outside the input operand", 1, 29, c=2, o=3)
    located("x[b, c], W[c, o, 2*k] -> y[b, o]", "affine index '2\\*k' outside the input operand",
            1, 18, c=2, o=3)


def test_affine_with_two_output_indices():
    located("x[b, c, h+w], W[c, o] -> y[b, o, h, w]",
            r"affine index 'h\+w' has 2 output indices \(h, w\)", 1, 9, c=2, o=3)


def test_affine_with_no_output_index():
    located("x[b, c, k-1], W[c, o, k] -> y[b, o]", r"affine index 'k-1' has no output index",
            1, 9, c=2, o=3, k=3)


def test_kernel_index_no_core_carries():
    located("x[b, c, h+kq-1], W[c, o] -> y[b, o, h]",
            "kernel index 'kq' of 'h\\+kq-1' is carried by no core", 1, 11, c=2, o=3)


def test_positive_constant_is_negative_padding():
    located("x[b, c, h+k+1], W[c, o, k] -> y[b, o, h]",
            r"constant \+1 in 'h\+k\+1' means negative padding", 1, 9, c=2, o=3, k=3)


def test_stride_zero_and_dilation_zero():
    located("x[b, c, 0*h+k], W[c, o, k] -> y[b, o, h]", "stride 0 in '0\\*h\\+k'", 1, 9,
            c=2, o=3, k=3)
    located("x[b, c, h+0*k], W[c, o, k] -> y[b, o, h]", "dilation 0 in 'h\\+0\\*k'", 1, 11,
            c=2, o=3, k=3)


def test_negative_dilation():
    located("x[b, c, h-k], W[c, o, k] -> y[b, o, h]", "dilation -1 in 'h-k'", 1, 11,
            c=2, o=3, k=3)


def test_duplicate_operand_names():
    located("x[b, c], W[c, r], W[r, o] -> y[b, o]", "operand name 'W' is used twice", 1, 19,
            c=2, r=2, o=3)


def test_core_named_like_input_or_output():
    located("x[b, c], x[c, o] -> y[b, o]", r"a core named like the input", 1, 10, c=2, o=3)
    located("x[b, c], y[c, o] -> y[b, o]", "operand name 'y' is used twice", 1, 21, c=2, o=3)


def test_kernel_index_in_output():
    located("x[b, c, h+k-1], W[c, o, k] -> y[b, o, h, k]", "kernel index 'k' appears in the output",
            1, 11, c=2, o=3, k=3)


def test_group_in_core():
    located("x[b, (c d)], W[(c d), o] -> y[b, o]",
            r"group \(c d\) in core 'W': cores take single indices", 1, 16, c=2, d=2, o=3)


def test_group_with_one_name_and_empty_group():
    located("x[b, (c)], W[c, o] -> y[b, o]", r"group \(c\) needs at least two names", 1, 6,
            c=2, o=3)
    located("x[b, ()], W[b] -> y[b]", r"group \(\) needs at least two names", 1, 6, b=2)


def test_nested_group():
    located("x[b, ((c d) e)], W[c, o] -> y[b, o]", "groups cannot be nested", 1, 7)


def test_dangling_core_index():
    err = located("x[b, c], W[c, o, z] -> y[b, o]",
                  "core index 'z' appears in no other operand and not in the output", 1, 18,
                  c=2, o=3, z=2)
    assert "summed away silently" in str(err)


def test_two_dangling_indices_that_look_alike_are_one_typo_with_a_did_you_mean():
    # 'rl' typed for 'r1': one error at the later one, naming both cores, not two errors
    with pytest.raises(tnspec.SpecError) as info:
        tnspec.compile("x[b, c], U[c, r1], V[rl, o] -> y[b, o]", c=4, o=4, r1=2, rl=2)
    err = info.value
    assert len(err.errors) == 1 and (err.line, err.column) == (1, 22)
    assert "core index 'rl' of 'V' and 'r1' of 'U' each appear once" in str(err)
    assert "hint: did you mean 'r1'? One name joins 'U' and 'V'" in str(err)
    # one dangling index next to an index it looks like elsewhere: a did-you-mean in its hint
    with pytest.raises(tnspec.SpecError, match=r"did you mean 'oo'\? If not, connect 'o'"):
        tnspec.compile("x[b, c], U[c, r], V[r, o] -> y[b, oo]", c=4, o=4, r=2)
    # single letters are never guessed at: 'r' and 's' stay two errors without a guess
    with pytest.raises(tnspec.SpecError) as info:
        tnspec.compile("x[b, c], U[c, r], V[s, o] -> y[b, o]", c=4, o=4, r=2, s=2)
    assert len(info.value.errors) == 2 and "did you mean" not in str(info.value)


def test_input_index_summed_away():
    located("x[b, c, t], W[c, o] -> y[b, o]", "input index 't' is used by no core", 1, 9,
            c=2, o=3)


def test_index_twice_in_one_operand():
    located("x[b, c], W[c, c] -> y[b]", "index 'c' appears twice in 'W'", 1, 15, c=2)


@pytest.mark.parametrize("name", ["forward", "training", "to", "bias", "reset_parameters",
                                  "spec", "_hidden", "__init__", "state_dict"])
def test_core_names_that_clash_with_module_attributes(name):
    col = 10
    located(f"x[b, c], {name}[c, o] -> y[b, o]", f"core name '{name}' clashes", 1, col, c=2, o=3)


def test_core_beyond_size_limit_is_refused_before_allocation():
    located("x[b, c], W[c, o] -> y[b, o]", r"core 'W' would have 1,099,511,627,776 elements",
            1, 10, c=2**20, o=2**20)
    with pytest.raises(SpecError, match="more than the limit of 100"):
        tnspec.compile("x[b, c], W[c, o] -> y[b, o]", c=20, o=20, max_elements=100)


def test_spatial_output_on_a_core():
    err = located("x[b, h+k-1], W[k, h] -> y[b, h]", "spatial output index 'h' cannot be carried",
                  1, 19, k=3)
    assert len(err.errors) == 1


def test_index_used_by_two_affine_terms():
    located("x[b, h+k-1, w+k-1], W[k] -> y[b, h, w]", "index 'k' is used by two affine indices",
            1, 13, k=3)


def test_group_with_two_unsized_members():
    located("x[(b t), c], W[c, o] -> y[b, t, o]",
            r"group \(b t\) has 2 members without a size", 1, 3, c=2, o=3)


def test_network_without_core():
    located("x[b, c] -> y[b, c]", "the network has no core", 1, 1)


def test_options_errors():
    base = "layer l(i=2, o=2) {{\n {}\n x[b, i], W[i, o] -> y[b, o]\n}}"
    located(base.format("init: grph-in"), "invalid init: 'grph-in'", 2, 2)
    located(base.format("initt: graph-in"), "unknown option 'initt'", 2, 2)
    located(base.format("activation: -1"), r"activation scale -1.0 is outside \[1e-06, 1e\+06\]",
            2, 2)
    located(base.format("bias: maybe"), "invalid bias: 'maybe'", 2, 2)
    located(base.format("init: graph-in\n init: graph-out"), "option 'init' is given twice", 3, 2)


def test_layer_needs_exactly_one_network():
    located("layer l(i=2) {\n x[b, i], W[i] -> y[b]\n x[b, i], V[i] -> y[b]\n}",
            "layer 'l' has 2 networks", 3, 2)


def test_size_expression_errors():
    base = "layer l(c=2) {{\n {}\n x[b, c], W[c, k] -> y[b, k]\n}}"
    located(base.format("k = c // 0"), "division by zero", 2, 6)
    located(base.format("k = q + 1"), "size 'q' is not defined here", 2, 6)
    located(base.format("c = 3"), "size 'c' is defined twice", 2, 2)


def test_all_errors_are_reported_at_once():
    with pytest.raises(SpecError) as info:
        tnspec.compile("x[b, c, h+k+1], W[c, o, k, z] -> y[b, o, h, q]", c=2, o=3, z=2, k=3)
    messages = [e.message for e in info.value.errors]
    assert len(messages) == 3
    assert str(info.value).startswith("3 errors in spec:")
    assert any("negative padding" in m for m in messages)
    assert any("'z'" in m for m in messages) and any("'q'" in m for m in messages)


# ---- inputs that used to pass the checks and crash later -----------------------------------


@pytest.mark.parametrize("name", ["__class__", "__c"])
def test_names_python_would_mangle_are_refused(name):
    located(f"x[b, {name}], W[{name}, o] -> y[b, o]", f"index '{name}': names starting with "
            "'__' are reserved", 1, 6, sizes={name: 2}, o=3)
    located(f"layer a({name}=2, o=3) {{\n  k = {name}\n  x[b, c], W[c, o, k] -> y[b, o]\n}}",
            f"size '{name}': names starting with '__' are reserved", 1, 9, c=2)


@pytest.mark.parametrize("text", ["x[b, c, h], W[c, o] -> y[b, (o h)]",
                                  "x[b, c], W[c, o] -> y[(b o)]"])
def test_an_output_group_may_not_mix_core_and_input_indices(text):
    located(text, r"output group \(.*\) mixes 'o', carried by a core, with '[bh]', which comes "
            "from the input", 1, text.index("(") + 1, c=2, o=3)


@pytest.mark.parametrize("activation, message", [
    ("leaky_relu(1e200)", r"leaky_relu slope 1e\+200 is outside \[-1000, 1000\]"),
    ("leaky_relu(1e308)", r"leaky_relu slope 1e\+308 is outside"),
    ("leaky_relu(1e400)", r"leaky_relu slope inf is outside"),
    ("1e-320", r"activation scale 1e-320 is outside \[1e-06, 1e\+06\]"),
])
def test_activation_parameters_that_overflow_the_init_are_refused(activation, message):
    located(f"layer a(i=2, o=2) {{\n activation: {activation}\n x[b, i], W[i, o] -> y[b, o]\n}}",
            message, 2, 2)


@pytest.mark.parametrize("init", ["graph-in", "kaiming-in", "xavier", "orthogonal"])
def test_tiny_leaky_slopes_give_finite_nonzero_cores(init):
    layer = tnspec.layer("x[b, c], A[c, r], B[r, o] -> y[b, o]", c=64, r=8, o=64, init=init,
                         activation="leaky_relu(1e-320)")
    for core in (layer.A, layer.B):
        assert torch.isfinite(core).all() and core.abs().max() > 0


def test_a_bias_too_large_to_allocate_is_refused_before_allocating():
    located("x[b, i], A[i, o1], B[o2], C[o3] -> y[b, o1, o2, o3]", "the bias over the output's "
            "core indices would have 2,199,023,255,552 elements, more than the limit", 1, 36,
            i=2, o1=2, o2=2**20, o3=2**20)
    net = tnspec.compile("x[b, i], A[i, o1], B[o2] -> y[b, o1, o2]", i=2, o1=2, o2=8,
                         max_elements=16)
    assert net.sizes["o2"] == 8


def chain(n: int) -> tuple[str, dict[str, int]]:
    cores = ", ".join(f"A{i}[r{i}, r{i + 1}]" for i in range(n))
    return f"x[b, r0], {cores} -> y[b, r{n}]", {f"r{i}": 2 for i in range(n + 1)}


def test_more_than_max_cores_is_refused():
    from tnspec.language.check import MAX_CORES
    text, sizes = chain(MAX_CORES + 1)
    located(text, f"the network has {MAX_CORES + 1} cores, more than the limit of {MAX_CORES}",
            1, text.index(f"A{MAX_CORES}[") + 1, sizes=sizes)
    text, sizes = chain(MAX_CORES)
    assert len(tnspec.compile(text, sizes=sizes).cores) == MAX_CORES


def test_a_size_for_a_spatial_index_is_refused_not_ignored():
    located("x[b, c, h+k-1], W[c, k] -> y[b, h]", "size h=5 is given for a spatial index; it "
            "would be ignored", 1, 9, c=2, k=3, h=5)


def test_a_layer_name_for_an_expression_says_so():
    with pytest.raises(SpecError, match="name='foo' picks a layer of a .tn file, but this spec "
                       "is a single expression"):
        tnspec.layer("x[b, i], W[i, o] -> y[b, o]", name="foo", i=2, o=3)
