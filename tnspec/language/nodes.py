"""The parse tree of a spec: frozen dataclasses, each carrying the source span it came from.

``parse`` builds them from Lark's tree; ``settings`` and ``check`` read them. Nothing here knows
the grammar or what the syntax means.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import Span


@dataclass(frozen=True)
class Term:
    """One term of an affine index: ``coef * name``, or the constant ``coef`` when name is None."""

    coef: int
    name: str | None
    span: Span


@dataclass(frozen=True)
class IndexNode:
    """An index as written: ``kind`` is "name" (``c``), "group" (``(i0 i1)``), "affine" or
    "unit" (``1``: an axis of length 1, no index)."""

    kind: str
    names: tuple[str, ...]
    terms: tuple[Term, ...]
    text: str
    span: Span


@dataclass(frozen=True)
class OperandNode:
    name: str
    name_span: Span
    indices: tuple[IndexNode, ...]
    span: Span


@dataclass(frozen=True)
class NetworkNode:
    """``operands[0]`` is the data input, ``operands[1:]`` the cores, ``output`` after ``->``.
    ``lookup``: the modes of an index input (``x[b] in (v0 v1)``), also appended to the data
    operand's indices, so that the checker sees the one-hot input the network contracts."""

    operands: tuple[OperandNode, ...]
    output: OperandNode
    span: Span
    lookup: IndexNode | None = None


@dataclass(frozen=True)
class SizeExpr:
    """A size expression: ``op`` is "int", "name", or "chain": ``args`` joined left to right by
    the operators in ``value`` (+ - in a sum, * // in a product; one fewer than ``args``). A
    chain is flat, so a long sum is not a deep tree."""

    op: str
    value: int | str | tuple[str, ...]
    args: tuple["SizeExpr", ...]
    span: Span


@dataclass(frozen=True)
class Param:
    name: str
    default: int
    span: Span


@dataclass(frozen=True)
class Derived:
    name: str
    expr: SizeExpr
    span: Span


@dataclass(frozen=True)
class Option:
    """``key: value``; value is a word (``graph-in``, ``true``) or a number; ``arg`` a number in
    parentheses after a word (``leaky_relu(0.1)``)."""

    key: str
    value: str | float
    arg: float | None
    span: Span


@dataclass(frozen=True)
class LayerNode:
    """One layer; an inline expression is a layer with ``name=None`` and nothing but a network."""

    name: str | None
    name_span: Span | None
    params: tuple[Param, ...]
    derived: tuple[Derived, ...]
    options: tuple[Option, ...]
    networks: tuple[NetworkNode, ...]
    span: Span


@dataclass(frozen=True)
class Document:
    layers: tuple[LayerNode, ...]
    source: str
    is_file: bool

    @functools.cached_property
    def by_name(self) -> dict[str | None, LayerNode]:
        """The layers by name (names are unique: the builder refuses a repeated one)."""
        return {lay.name: lay for lay in self.layers}
