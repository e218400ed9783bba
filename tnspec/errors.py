"""The one error class of tnspec, and source spans.

Every problem with a user's spec, from a missing bracket to a core too large to allocate, is a
:class:`SpecError`. It carries the position of the offending item, renders the source line with a
caret under it, and says how to fix it::

    line 1, column 27: output index 'q' is provided by no operand
      x[b, c], W[c, o] -> y[b, q]
                              ^
    hint: add 'q' to a core, or remove it from the output

When the checker finds several problems at once, the first one is the error and all of them are in
``errors``; ``str()`` shows them all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: errors shown by ``str()`` (all of them stay in ``errors``)
MAX_SHOWN_ERRORS = 20


@dataclass(frozen=True)
class Span:
    """A region of the source text: 1-based line and column, end column exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(line: int, column: int) -> "Span":
        return Span(line, column, line, column + 1)


class SpecError(ValueError):
    """A problem with a tensor-network spec, located in its source.

    Attributes: ``message`` (what is wrong, quoting the offending item), ``line`` and
    ``column`` (1-based, 0 when unknown), ``hint`` (how to fix it), ``excerpt`` (the source line
    with a caret), ``filename`` (or None) and ``errors`` (every error found in the same pass,
    this one first).
    """

    def __init__(
        self,
        message: str,
        *,
        span: Span | None = None,
        source: str | None = None,
        hint: str | None = None,
        filename: str | None = None,
        errors: "list[SpecError] | None" = None,
    ) -> None:
        self.message = message
        self.span = span
        self.line = span.line if span else 0
        self.column = span.column if span else 0
        self.hint = hint
        self.source = source
        self.filename = filename
        self.excerpt = _excerpt(source, span)
        self.errors: list[SpecError] = errors if errors else [self]
        super().__init__(self._render_all())

    def with_filename(self, filename: str) -> "SpecError":
        """The same error(s), reported against ``filename``."""
        errs = [
            SpecError(e.message, span=e.span, source=e.source, hint=e.hint, filename=filename)
            for e in self.errors
        ]
        first = errs[0]
        return SpecError(
            first.message, span=first.span, source=first.source, hint=first.hint,
            filename=filename, errors=errs,
        )

    def render(self) -> str:
        """This one error as ``FILE:LINE:COL: error: message``, excerpt and hint."""
        if self.filename:
            where = f"{self.filename}:{self.line}:{self.column}: " if self.span else \
                f"{self.filename}: "
            where += "error: "
        else:
            where = f"line {self.line}, column {self.column}: " if self.span else ""
        text = where + self.message
        if self.excerpt:
            text += "\n" + self.excerpt
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text

    def _render_all(self) -> str:
        if len(self.errors) == 1:
            return self.render()
        rest = "\n".join(e.render() for e in self.errors[:MAX_SHOWN_ERRORS])
        more = len(self.errors) - MAX_SHOWN_ERRORS
        if more > 0:
            rest += f"\n... and {more} more (all of them are in the error's .errors)"
        return f"{len(self.errors)} errors in spec:\n{rest}"


_EXCERPT_WIDTH = 100


@functools.lru_cache(maxsize=8)
def _lines(source: str) -> list[str]:
    """The source's lines, split once for all the errors in it (a str caches its hash)."""
    return source.split("\n")


def _excerpt(source: str | None, span: Span | None) -> str:
    """The span's source line (shortened around the span if long) with carets under the span."""
    if source is None or span is None or span.line < 1:
        return ""
    lines = _lines(source)
    if span.line > len(lines):
        return ""
    text = lines[span.line - 1]
    start = max(span.column - 1, 0)
    end = span.end_column - 1 if span.end_line == span.line else len(text)
    end = min(max(end, start + 1), max(len(text), start + 1))
    # long lines (or hostile one-line inputs): show a window around the span
    offset = 0
    if len(text) > _EXCERPT_WIDTH:
        offset = max(0, min(start - _EXCERPT_WIDTH // 3, len(text) - _EXCERPT_WIDTH))
        text = ("..." if offset else "") + text[offset:offset + _EXCERPT_WIDTH]
        shift = 3 if offset else 0
        start, end = start - offset + shift, min(end - offset, _EXCERPT_WIDTH) + shift
    width = max(1, min(end - start, _EXCERPT_WIDTH))
    text = text.replace("\t", " ")  # one column per character, as the caret counts
    return f"  {text}\n  {' ' * start}{'^' * width}"
