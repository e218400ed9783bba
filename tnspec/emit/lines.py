"""Lines of generated Python: statements broken to at most ``WIDTH`` columns in ways Python and
pycodestyle accept (inside brackets, at item boundaries, with hanging indents), comments
wrapped, and long f-string messages split without cutting a ``{...}`` field."""

from __future__ import annotations

import re
import textwrap

INDENT = "    "
WIDTH = 99


def comment(text: str, indent: str) -> list[str]:
    return [indent + "# " + line for line in textwrap.wrap(
        text, WIDTH - len(indent) - 2, break_on_hyphens=False)]


def if_block(cond: str, indent: str) -> list[str]:
    line = f"{indent}if {cond}:"
    if len(line) <= WIDTH:
        return [line]
    inner = indent + INDENT * 2  # a hanging indent, so the condition stands off the body
    return [f"{indent}if ("] + [inner + part for part in textwrap.wrap(
        cond, WIDTH - len(inner), break_long_words=False, break_on_hyphens=False)] + \
        [f"{indent}):"]


def raise_block(message: str, indent: str) -> list[str]:
    """``raise ValueError(f"...")``, the f-string split over lines at spaces if too long."""
    one = f'{indent}raise ValueError(f"{message}")'
    if len(one) <= WIDTH:
        return [one]
    inner = indent + INDENT
    hoisted: list[str] = []  # a {...} too long for one line is computed before the raise
    for n, expr in enumerate(e for e in re.findall(r"\{([^{}]*)\}", message)
                             if len(e) > WIDTH // 2):
        name = f"_expected{n or ''}"  # we raise next: a local of that name is not used again
        hoisted += wrap_line(f"{indent}{name} = {expr}")
        message = message.replace("{" + expr + "}", "{" + name + "}", 1)
    chunks = split_text(message, WIDTH - len(inner) - 3)
    return hoisted + [f"{indent}raise ValueError("] + \
        [f'{inner}f"{c}"' for c in chunks[:-1]] + [f'{inner}f"{chunks[-1]}")']


def split_text(text: str, width: int) -> list[str]:
    """``text`` cut after spaces into pieces of at most ``width`` (never inside ``{...}``)."""
    pieces, depth, start, last_space = [], 0, 0, -1
    for n, ch in enumerate(text):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == " " and depth == 0:
            if n + 1 - start > width and last_space > start:
                pieces.append(text[start:last_space + 1])
                start = last_space + 1
            last_space = n
    if len(text) - start > width and last_space > start:
        pieces.append(text[start:last_space + 1])
        start = last_space + 1
    return pieces + [text[start:]]


def spec_lines(spec: str, width: int) -> list[str]:
    """The spec broken after ", " between operands so that each piece fits ``width``."""
    pieces = []
    for piece in spec.replace("], ", "],\0").split("\0"):
        # an operand longer than a line is cut at its spaces (the pieces are joined by one)
        pieces += [piece] if len(piece) <= width else piece.split(" ")
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return lines


def wrap_line(line: str, _retry: bool = True) -> list[str]:
    """``line`` broken at spaces inside brackets (never inside a string), each continuation
    aligned under the innermost open bracket; an assignment with no bracket to break in gets
    its right-hand side parenthesized."""
    if len(line) <= WIDTH:
        return [line]
    lines: list[str] = []
    start, pad, stack, quote = 0, 0, [], ""
    last: tuple[int, list[int]] | None = None  # a break point and the brackets open there
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(pad + i - start)
        elif ch in ")]}":
            stack.pop()
        elif ch == " " and stack and line[i - 1] not in "([{":
            last = (i, list(stack))
        if pad + i - start >= WIDTH and last is not None:
            cut, stack = last
            lines.append(" " * pad + line[start:cut])
            start, pad, last, i = cut + 1, stack[-1] + 1, None, cut + 1
            continue
        i += 1
    lines.append(" " * pad + line[start:])
    head, eq, rhs = line.partition(" = ")
    if _retry and len(lines) == 1 and eq and not rhs.startswith("("):
        return wrap_line(f"{head} = ({rhs})", False)
    return lines


def wrap_call(start: str, items: list[str], end: str) -> list[str]:
    """``start`` + items joined by ", " + ``end``, continued under the opening bracket."""
    one = start + ", ".join(items) + end
    if len(one) <= WIDTH:
        return [one]
    cont = " " * (max(start.rfind(b) for b in "([{") + 1)
    lines, line = [], start
    for n, item in enumerate(items):
        last = n == len(items) - 1
        piece = item + ("" if last else ", ")
        need = len(piece.rstrip()) + (len(end) if last else 0)
        if len(line) + need > WIDTH and line.strip() not in ("", start.strip()):
            lines.append(line.rstrip())
            line = cont
        line += piece
    lines.append(line.rstrip() + end)
    if any(len(line) > WIDTH for line in lines):  # an item too long: break inside items
        return wrap_line(one)
    return lines


def wrap_assign(indent: str, targets: str, values: str) -> list[str]:
    """``a, b = x, y`` split into as few such lines as fit."""
    pairs = list(zip(targets.split(", "), values.split(", ")))
    out: list[str] = []
    while pairs:
        n = 1
        while n < len(pairs) and len(_assign(indent, pairs[:n + 1])) <= WIDTH:
            n += 1
        out.append(_assign(indent, pairs[:n]))
        pairs = pairs[n:]
    return out


def _assign(indent: str, pairs: list[tuple[str, str]]) -> str:
    return f"{indent}{', '.join(t for t, _ in pairs)} = {', '.join(v for _, v in pairs)}"
