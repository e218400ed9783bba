"""Parse: source text -> the parse tree of ``nodes`` (frozen dataclasses with
source spans).

The grammar lives in ``grammar/tnspec.lark`` (installed as the package data ``tnspec.grammar``).
This module only turns text into syntax; what the syntax *means* is decided in ``check``.

Before Lark sees the text, a linear scan checks the brackets so that an unbalanced or nested
bracket is reported at the bracket itself, and bounds the input (length, nesting depth), so that
hostile input cannot cause a hang or a RecursionError.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput

from ..errors import Span, SpecError
from .nodes import (Derived, Document, IndexNode, LayerNode, NetworkNode, Option, OperandNode,
                    Param, SizeExpr, Term)

MAX_SOURCE_CHARS = 1_000_000
MAX_PAREN_DEPTH = 32
MAX_INT_DIGITS = 18
MAX_EXPR_TERMS = 256  # operands of one size expression: Python compiles the formula


# ---- entry point ----------------------------------------------------------------------------


def parse(source: str) -> Document:
    """Parse an expression or the text of a ``.tn`` file. Raises :class:`SpecError`."""
    if not isinstance(source, str):
        raise SpecError(f"a spec must be a str, not {type(source).__name__}",
                        hint="pass the spec text; read a file with open(path).read()")
    if source.startswith("\ufeff"):  # a UTF-8 byte-order mark, as some editors write
        source = source[1:]
    if len(source) > MAX_SOURCE_CHARS:
        raise SpecError(
            f"spec is {len(source):,} characters long, more than the limit of "
            f"{MAX_SOURCE_CHARS:,}",
            hint="split it into several layers or files",
        )
    if not source.strip() or not _strip_comments(source).strip():
        raise SpecError("empty spec", hint="write a network such as 'x[b, i], W[i, o] -> y[b, o]'")
    _scan_brackets(source)
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(exc, source) from None
    return _Builder(source).document(tree)


@functools.lru_cache(maxsize=None)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", propagate_positions=True,
                     maybe_placeholders=False)


def grammar_text() -> str:
    """The grammar: installed package data, or ``grammar/`` beside a source checkout."""
    try:
        return resources.files("tnspec.grammar").joinpath("tnspec.lark").read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parents[2] / "grammar" / "tnspec.lark").read_text(
            "utf-8")


def _strip_comments(source: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in source.split("\n"))


# ---- bracket scan ---------------------------------------------------------------------------

_CLOSER = {"[": "]", "(": ")", "{": "}"}
_OPENER = {v: k for k, v in _CLOSER.items()}


def _scan_brackets(source: str) -> None:
    stack: list[tuple[str, Span]] = []
    line, col, in_comment = 1, 0, False
    for ch in source:
        col += 1
        if ch == "\n":
            line, col, in_comment = line + 1, 0, False
            continue
        if in_comment:
            continue
        if ch == "#":
            in_comment = True
        elif ch in _CLOSER:
            here = Span.point(line, col)
            if ch == "(" and stack and stack[-1][0] == "(" and any(b == "[" for b, _ in stack):
                raise SpecError(
                    "groups cannot be nested", span=here, source=source,
                    hint="write one flat group such as (i0 i1 i2)",
                )
            if ch == "(" and sum(b == "(" for b, _ in stack) >= MAX_PAREN_DEPTH:
                raise SpecError(
                    f"parentheses nested more than {MAX_PAREN_DEPTH} deep", span=here,
                    source=source, hint="simplify the size expression",
                )
            stack.append((ch, here))
        elif ch in _OPENER:
            here = Span.point(line, col)
            if not stack:
                raise SpecError(f"unmatched '{ch}'", span=here, source=source,
                                hint=f"remove it, or add the '{_OPENER[ch]}' that opens it")
            opener, where = stack.pop()
            if opener != _OPENER[ch]:
                raise SpecError(
                    f"'{ch}' closes the '{opener}' opened at line {where.line}, column "
                    f"{where.column}", span=here, source=source,
                    hint=f"close it with '{_CLOSER[opener]}' first",
                )
    if stack:
        opener, where = stack[-1]
        raise SpecError(f"unclosed '{opener}'", span=where, source=source,
                        hint=f"add the matching '{_CLOSER[opener]}'")


# ---- syntax errors --------------------------------------------------------------------------

_TOKEN_WORDS = {
    "ARROW": "'->'", "COMMA": "','", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('", "RPAR": "')'",
    "LBRACE": "'{'", "RBRACE": "'}'", "EQUAL": "'='", "COLON": "':'", "NAME": "a name",
    "INT": "an integer", "NUMBER": "a number", "OPTWORD": "a word", "ADDOP": "'+' or '-'",
    "MULOP": "'*' or '//'", "STAR": "'*'", "LAYER": "'layer'", "$END": "the end of the spec",
}


def _syntax_error(exc: UnexpectedInput, source: str) -> SpecError:
    line, col = max(getattr(exc, "line", 1) or 1, 1), max(getattr(exc, "column", 1) or 1, 1)
    expected = set(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    words = sorted({_TOKEN_WORDS.get(t, t.lower()) for t in expected})
    want = " or ".join(words) if len(words) <= 4 else ", ".join(words[:4]) + ", ..."
    if isinstance(exc, UnexpectedCharacters):
        ch = source[exc.pos_in_stream] if exc.pos_in_stream < len(source) else "?"
        return SpecError(f"unexpected character {ch!r}", span=Span.point(line, col),
                         source=source, hint=f"expected {want}" if words else None)
    token = getattr(exc, "token", None)
    at_end = isinstance(exc, UnexpectedEOF) or (token is not None and token.type == "$END")
    if at_end:
        last = source.rstrip()
        end_line = last.count("\n") + 1
        end_col = len(last.rsplit("\n", 1)[-1]) + 1
        span = Span.point(end_line, end_col)
        if "ARROW" in expected:
            return SpecError("missing '->' and the output operand", span=span, source=source,
                             hint="end the network with '-> y[...]', naming the output's indices")
        return SpecError("the spec ends too early", span=span, source=source,
                         hint=f"expected {want}" if words else None)
    assert token is not None
    tspan = Span(token.line or line, token.column or col,
                 token.end_line or line, token.end_column or col + 1)
    text = str(token)
    if token.type == "ARROW" and "ARROW" not in expected:
        msg = "a second '->'" if "COMMA" in expected else f"unexpected {text!r}"
        return SpecError(msg, span=tspan, source=source,
                         hint="a network has one '->', before its single output operand")
    hint = f"expected {want}" if words else None
    if token.type in ("NAME", "INT") and "COMMA" in expected:
        hint = "separate operands and indices with ','"
    return SpecError(f"unexpected {text!r}", span=tspan, source=source, hint=hint)


# ---- tree -> AST ----------------------------------------------------------------------------


def _operands(e: SizeExpr) -> int:
    return sum(_operands(a) for a in e.args) if e.op == "chain" else 1


def _span(node: lark.Tree | lark.Token) -> Span:
    if isinstance(node, lark.Token):
        return Span(node.line or 1, node.column or 1, node.end_line or 1, node.end_column or 1)
    m = node.meta
    if getattr(m, "empty", True):
        return Span(1, 1, 1, 2)
    return Span(m.line, m.column, m.end_line, m.end_column)


class _Builder:
    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.split("\n")  # Lark counts lines by "\n" only

    def int_(self, tok: lark.Token) -> int:
        if len(tok) > MAX_INT_DIGITS:
            raise SpecError(f"number {str(tok)[:20]}... is too large", span=_span(tok),
                            source=self.source, hint="sizes and coefficients are small integers")
        return int(tok)

    def document(self, tree: lark.Tree) -> Document:
        children = tree.children
        if len(children) == 1 and isinstance(children[0], lark.Tree) \
                and children[0].data == "network":
            net = self.network(children[0])
            layer = LayerNode(None, None, (), (), (), (net,), net.span)
            return Document((layer,), self.source, is_file=False)
        layers: dict[str, LayerNode] = {}
        for child in children:
            lay = self.layer(child)
            first = layers.setdefault(str(lay.name), lay)
            if first is not lay:
                assert first.name_span is not None
                raise SpecError(f"layer {lay.name!r} is defined twice (first at line "
                                f"{first.name_span.line})", span=lay.name_span,
                                source=self.source, hint="give each layer its own name")
        return Document(tuple(layers.values()), self.source, is_file=True)

    def layer(self, tree: lark.Tree) -> LayerNode:
        name_tok = tree.children[0]
        params: list[Param] = []
        derived: list[Derived] = []
        options: list[Option] = []
        networks: list[NetworkNode] = []
        for child in tree.children[1:]:
            if child.data == "params":
                params += [Param(str(p.children[0]), self.int_(p.children[1]), _span(p))
                           for p in child.children]
            elif child.data == "derived":
                expr = self.size_expr(child.children[1])
                if _operands(expr) > MAX_EXPR_TERMS:
                    raise SpecError(f"size expression has {_operands(expr)} operands, more "
                                    f"than the limit of {MAX_EXPR_TERMS}", span=expr.span,
                                    source=self.source, hint="split it into several derived "
                                    "sizes (each may use the ones above it)")
                derived.append(Derived(str(child.children[0]), expr, _span(child)))
            elif child.data == "option":
                options.append(self.option(child))
            else:
                networks.append(self.network(child))
        return LayerNode(str(name_tok), _span(name_tok), tuple(params), tuple(derived),
                         tuple(options), tuple(networks), _span(tree))

    def option(self, tree: lark.Tree) -> Option:
        key, value = tree.children
        span = _span(tree)
        if value.data == "number_value":
            return Option(str(key), self.number(value.children[0]), None, span)
        word = str(value.children[0])
        arg = self.number(value.children[1]) if len(value.children) > 1 else None
        return Option(str(key), word, arg, span)

    def number(self, tok: lark.Token) -> float:
        if len(tok) > 40:
            raise SpecError(f"number {str(tok)[:20]}... is too long", span=_span(tok),
                            source=self.source)
        return float(tok)

    def size_expr(self, tree: lark.Tree | lark.Token) -> SizeExpr:
        if isinstance(tree, lark.Token):
            if tree.type == "INT":
                return SizeExpr("int", self.int_(tree), (), _span(tree))
            return SizeExpr("name", str(tree), (), _span(tree))
        # sum / product: operand (OP operand)*, kept flat
        items = tree.children
        if len(items) == 1:
            return self.size_expr(items[0])
        args = tuple(self.size_expr(t) for t in items[::2])
        span = Span(args[0].span.line, args[0].span.column, args[-1].span.end_line,
                    args[-1].span.end_column)
        return SizeExpr("chain", tuple(str(op) for op in items[1::2]), args, span)

    def network(self, tree: lark.Tree) -> NetworkNode:
        *operands, _arrow, output = tree.children
        nodes = [self.operand(o) for o in operands if o.data == "operand"]
        lookup = None
        if len(operands) > 1 and operands[1].data == "lookup":
            names = tuple(str(t) for t in operands[1].children)
            span = _span(operands[1])
            lookup = IndexNode("name" if len(names) == 1 else "group", names, (),
                               self.source_text(span), span)
            data = nodes[0]
            nodes[0] = OperandNode(data.name, data.name_span, data.indices + (lookup,),
                                   data.span)
        return NetworkNode(tuple(nodes), self.operand(output), _span(tree), lookup)

    def operand(self, tree: lark.Tree) -> OperandNode:
        name_tok, *indices = tree.children
        return OperandNode(str(name_tok), _span(name_tok), tuple(self.index(i) for i in indices),
                           _span(tree))

    def index(self, tree: lark.Tree) -> IndexNode:
        span = _span(tree)
        text = self.source_text(span)
        if tree.data == "plain":
            return IndexNode("name", (str(tree.children[0]),), (), text, span)
        if tree.data == "group":
            return IndexNode("group", tuple(str(t) for t in tree.children), (), text, span)
        if tree.data == "unit":  # a core's axis of length 1, as einops writes it
            return IndexNode("unit", (), (), text, span)
        # affine: either "INT * NAME" directly, or term (ADDOP term)+
        kids = tree.children
        if isinstance(kids[0], lark.Token) and kids[0].type == "INT" and len(kids) == 2:
            terms = [Term(self.int_(kids[0]), str(kids[1]), span)]
        else:
            terms = [self.term(kids[0], +1)]
            for op, t in zip(kids[1::2], kids[2::2]):
                terms.append(self.term(t, -1 if str(op) == "-" else +1))
        return IndexNode("affine", tuple(t.name for t in terms if t.name), tuple(terms),
                         text, span)

    def term(self, tree: lark.Tree, sign: int) -> Term:
        span = _span(tree)
        kids = tree.children
        if len(kids) == 2:
            return Term(sign * self.int_(kids[0]), str(kids[1]), span)
        tok = kids[0]
        if tok.type == "INT":
            return Term(sign * self.int_(tok), None, span)
        return Term(sign, str(tok), span)

    def source_text(self, span: Span) -> str:
        lines = self.lines
        if span.line != span.end_line:
            return " ".join(lines[span.line - 1:span.end_line]).strip()
        return lines[span.line - 1][span.column - 1:span.end_column - 1]
