"""Stage 1: text -> AST, and every syntax-level error with its message and position."""

from __future__ import annotations

import pytest

from tnspec import SpecError
from tnspec.language.parse import MAX_EXPR_TERMS, MAX_PAREN_DEPTH, MAX_SOURCE_CHARS, parse


def layer0(text: str):
    return parse(text).layers[0]


def test_expression_is_one_anonymous_layer():
    doc = parse("x[b, c, 2*h+kh-1, (i0 i1)], W[c, kh, i0, i1, o] -> y[b, o, h]")
    assert not doc.is_file
    (lay,) = doc.layers
    assert lay.name is None and len(lay.networks) == 1
    net = lay.networks[0]
    assert [o.name for o in net.operands] == ["x", "W"]
    assert net.output.name == "y"
    kinds = [ix.kind for ix in net.operands[0].indices]
    assert kinds == ["name", "name", "affine", "group"]


def test_affine_terms_carry_signed_coefficients():
    ix = layer0("x[h + 2*kh - 3], W[kh] -> y[h]").networks[0].operands[0].indices[0]
    assert [(t.coef, t.name) for t in ix.terms] == [(1, "h"), (2, "kh"), (-3, None)]
    assert ix.text == "h + 2*kh - 3"
    assert (ix.span.line, ix.span.column, ix.span.end_column) == (1, 3, 15)


def test_scaled_single_term_is_affine():
    ix = layer0("x[2*t], W[c] -> y[t, c]").networks[0].operands[0].indices[0]
    assert ix.kind == "affine" and [(t.coef, t.name) for t in ix.terms] == [(2, "t")]


def test_file_level_layers_params_derived_options():
    doc = parse("""
# a comment
layer first(c=4, o=8) {   # trailing comment
    k = c // 2 + (o - 6) * 1
    init: graph-out
    activation: leaky_relu(0.2)
    bias: false
    x[b, c, t+k-1], W[c, o, k] -> y[b, o, t]
}
layer second { x[b, i], W[i, o] -> y[b, o] }
""")
    assert doc.is_file and [lay.name for lay in doc.layers] == ["first", "second"]
    first = doc.layers[0]
    assert [(p.name, p.default) for p in first.params] == [("c", 4), ("o", 8)]
    assert [d.name for d in first.derived] == ["k"]
    assert [(o.key, o.value, o.arg) for o in first.options] == [
        ("init", "graph-out", None), ("activation", "leaky_relu", 0.2), ("bias", "false", None)]
    assert first.networks[0].span.line == 8


def test_network_may_span_lines():
    doc = parse("layer l(i=2, o=3) {\n  x[b, i],\n    W[i, o]\n    -> y[b, o]\n}")
    assert doc.layers[0].networks[0].output.span.line == 4


@pytest.mark.parametrize("text, message, line, column", [
    ("x[b, c, W[c, o] -> y[b, o]", r"unclosed '\['", 1, 2),
    ("x[b, c]], W[c, o] -> y[b, o]", r"unmatched '\]'", 1, 8),
    ("x[b, (c], W[c, o] -> y[b, o]", r"'\]' closes the '\(' opened at line 1, column 6", 1, 8),
    ("x[b, c], W[c, o]", r"missing '->' and the output operand", 1, 17),
    ("x[b, c],\nW[c, o]\n", r"missing '->'", 2, 8),
    ("x[b, c] W[c, o] -> y[b, o]", r"unexpected 'W'", 1, 9),
    ("x[b, c$], W[c, o] -> y[b, o]", r"unexpected character '\$'", 1, 7),
    ("x[b, c], W[c, o] -> y[b, o] -> z[b]", r"unexpected '->'", 1, 29),
    ("x[b, ((c d) e)], W[c, o] -> y[b, o]", r"groups cannot be nested", 1, 7),
    ("x[b, 99999999999999999999*h+k], W[k] -> y[b, h]", r"number 9+\.\.\. is too large", 1, 6),
    ("layer a {\n  x[b, c], W[c, o] -> y[b, o]\n", r"unclosed '\{'", 1, 9),
])
def test_syntax_errors_are_located(text, message, line, column):
    with pytest.raises(SpecError, match=message) as info:
        parse(text)
    assert (info.value.line, info.value.column) == (line, column)
    assert "^" in info.value.excerpt and info.value.hint


def test_empty_and_comment_only_specs():
    for text in ("", "   \n", "# nothing here\n"):
        with pytest.raises(SpecError, match="empty spec"):
            parse(text)


def test_non_string_is_refused():
    with pytest.raises(SpecError, match="must be a str, not bytes"):
        parse(b"x[i] -> y[i]")  # type: ignore[arg-type]


def test_absurdly_long_input_is_refused_quickly():
    with pytest.raises(SpecError, match="more than the limit"):
        parse("x[" + "a, " * (MAX_SOURCE_CHARS // 3) + "b] -> y[b]")


def test_deep_nesting_gives_spec_error_not_recursion_error():
    deep = "layer a(c=1) { k = " + "(" * 5000 + "1" + ")" * 5000 + "\n x[b], W[b] -> y[b] }"
    with pytest.raises(SpecError, match=f"nested more than {MAX_PAREN_DEPTH} deep"):
        parse(deep)


def test_long_flat_sums_are_flat_up_to_the_limit_and_refused_beyond():
    # flat grammar repetition and a flat AST: no recursion in Lark or in the builder
    text = "layer a(c=1) {{ k = {}\n x[b, t+k-1], W[k] -> y[b, t] }}"
    lay = layer0(text.format(" + ".join(["1"] * MAX_EXPR_TERMS)))
    assert lay.derived[0].expr.op == "chain" and len(lay.derived[0].expr.args) == MAX_EXPR_TERMS
    with pytest.raises(SpecError, match=r"size expression has 20000 operands, more than the "
                       r"limit of 256") as info:
        layer0(text.format(" + ".join(["1"] * 20000)))
    assert (info.value.line, info.value.column) == (1, 20)


def test_many_operands_parse_in_linear_time():
    cores = ", ".join(f"W{i}[r{i}, r{i + 1}]" for i in range(3000))
    doc = parse(f"x[b, r0], {cores} -> y[b, r3000]")
    assert len(doc.layers[0].networks[0].operands) == 3001


def test_a_byte_order_mark_is_not_text():
    doc = parse("\ufefflayer a(i=2) {\n  x[b, i], W[i] -> y[b]\n}\n")
    assert doc.layers[0].name == "a" and doc.layers[0].name_span.column == 7


def test_a_layer_name_given_twice_is_refused_at_the_second():
    text = "layer a(i=2) {\n x[b, i], W[i] -> y[b]\n}\nlayer a(i=3) {\n x[b, i], W[i] -> y[b]\n}"
    with pytest.raises(SpecError, match=r"layer 'a' is defined twice \(first at line 1\)") as info:
        parse(text)
    assert (info.value.line, info.value.column) == (4, 7)


def test_picking_a_layer_does_not_scan_the_file():
    from tnspec.language.check import select_layer
    doc = parse("\n".join(f"layer a{i}(i=2) {{ x[b, i], W[i] -> y[b] }}" for i in range(50)))
    assert select_layer(doc, "a49").name == "a49"  # builds the index once

    class Unscannable(tuple):
        def __iter__(self):
            raise AssertionError("scanned the layers")
    object.__setattr__(doc, "layers", Unscannable(doc.layers))
    assert select_layer(doc, "a7").name == "a7"


def test_many_errors_split_the_source_once_and_show_a_capped_list():
    from tnspec import errors
    from tnspec.nn.api import compile
    errors._lines.cache_clear()
    text = "x[b, " + ", ".join(f"q{i}" for i in range(2000)) + "], W[i] -> y[b]"
    with pytest.raises(SpecError) as info:
        compile(text)
    assert len(info.value.errors) > 2000
    assert errors._lines.cache_info().misses == 1
    shown = str(info.value)
    assert shown.count("\nhint:") == errors.MAX_SHOWN_ERRORS
    assert shown.endswith(f"... and {len(info.value.errors) - errors.MAX_SHOWN_ERRORS} more "
                          "(all of them are in the error's .errors)")
