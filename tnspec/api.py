"""The public entry points: text in, network (or module) out."""

from __future__ import annotations

from typing import Any

from .check import DEFAULT_MAX_ELEMENTS, check
from .ir import Network
from .parse import parse


def compile(text: str, *, name: str | None = None, max_elements: int = DEFAULT_MAX_ELEMENTS,
            **sizes: Any) -> Network:
    """Parse and check ``text`` (an expression or a ``.tn`` file) into a :class:`Network`.

    ``name`` picks a layer of a file; keyword ``sizes`` bind or override index sizes. Cores with
    more than ``max_elements`` elements are refused. Raises :class:`tnspec.SpecError`.

    >>> net = compile("x[b, i], W[i, o] -> y[b, o]", i=4, o=3)
    >>> net.sizes
    {'i': 4, 'o': 3}
    """
    return check(parse(text), layer=name, sizes=sizes, max_elements=max_elements)


def compile_all(text: str, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[Network]:
    """Every layer of ``text``, each with its default sizes."""
    doc = parse(text)
    return [check(doc, layer=lay.name, max_elements=max_elements) for lay in doc.layers]
