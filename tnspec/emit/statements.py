"""One node of a lowered :class:`~tnspec.program.Program` as lines of Python: the body of a
generated ``forward``.

``codegen`` lays out the module and its class and calls :func:`statement` for each node. Every
value is printed through :func:`arg` (variables by name, parameters through :func:`attr`, sizes as
their expressions, text as ``repr`` literals), so nothing from the spec is printed raw.
"""

from __future__ import annotations

import keyword
from typing import Any, Sequence

from ..program import (Bias, Call, CheckIndex, CheckShape, CompileCopy, Let, Node, Param,
                       Relayout, Require, Unflatten, Unpack, Var)
from ..shapes import Size
from .lines import INDENT, WIDTH, comment, if_block, raise_block, wrap_call, wrap_line


def attr(name: str) -> str:
    """A parameter of the generated module: ``self.name``, or ``getattr`` where the name is not
    an identifier."""
    return f"self.{name}" if name.isidentifier() and not keyword.iskeyword(name) else \
        f"getattr(self, {name!r})"


def arg(a: Any) -> str:
    """Python text of a node argument."""
    if isinstance(a, Var):
        return a.name
    if isinstance(a, Param):
        return attr(a.name)
    if isinstance(a, Size):
        return str(a)
    if isinstance(a, tuple):
        return "(" + ", ".join(map(arg, a)) + ("," if len(a) == 1 else "") + ")"
    if isinstance(a, list):
        return "[" + ", ".join(map(arg, a)) + "]"
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _fstring(parts: Sequence[str | Size]) -> str:
    return "".join(p.replace("{", "{{").replace("}", "}}") if isinstance(p, str)
                   else "{" + str(p) + "}" for p in parts)


def statement(node: Node, indent: str) -> list[str]:
    """The lines of one node."""
    if isinstance(node, Call):
        return _call(node, indent)
    if isinstance(node, CheckShape):
        checks = [f"{node.var}.shape[{n}] != {d}" for n, (_, d) in enumerate(node.expected)
                  if d is not None]
        cond = " or ".join([f"{node.var}.dim() != {len(node.expected)}"] + checks)
        want = [f"{t}={{{d}}}" if d is not None else t.replace("{", "{{")
                for t, d in node.expected]
        given: list[str] = []
        if node.unbatched:  # quote the shape as given, before the batch axis was added
            want = [f"{', '.join(want)}] or, unbatched, [{', '.join(want[1:])}"]
            given = [f"{indent}{INDENT}if {node.unbatched}:",
                     f"{indent}{INDENT * 2}{node.var} = {node.var}.squeeze(0)  # as given"]
        msg = f"{node.tensor}: expected shape [{', '.join(want)}], got {{list({node.var}.shape)}}"
        return if_block(cond, indent) + given + raise_block(msg, indent + INDENT)
    if isinstance(node, Unpack):
        names = ", ".join(n if n is not None else "_" for n in node.names)
        return [f"{indent}{names}{',' if len(node.names) == 1 else ''} = {node.var}.shape"]
    if isinstance(node, Let):
        tail = f"  # {node.comment}" if node.comment else ""
        line = f"{indent}{node.out} = {node.value}"
        if len(line + tail) <= WIDTH:
            return [line + tail]
        return comment(node.comment, indent) + wrap_line(line)
    if isinstance(node, Require):
        if node.divisor is None:
            cond = f"{node.value} < 1"
        else:
            den = str(node.divisor) if node.divisor.is_atomic() else f"({node.divisor})"
            cond = f"{node.value} % {den}"
        return if_block(cond, indent) + raise_block(_fstring(node.message), indent + INDENT)
    if isinstance(node, Bias):
        shape = ", ".join(str(d) for d in node.shape)
        head = f"{indent}if self.bias is not None:"
        noted = [f"{head}  # {node.comment}"]
        if len(noted[0]) > WIDTH:
            noted = comment(node.comment, indent) + [head]
        # .to: under autocast the contraction runs in lower precision and, as nn.Conv2d's
        # output, so does the sum (a no-op otherwise)
        bias = f"self.bias.reshape({shape})" if shape else "self.bias"
        return noted + wrap_line(f"{indent}{INDENT}{node.out} = {node.var} + "
                                 f"{bias}.to({node.var}.dtype)")
    if isinstance(node, CompileCopy):
        v = node.var
        return comment(node.comment, indent) + [f"{indent}if torch.compiler.is_compiling():"] + \
            wrap_line(f"{indent}{INDENT}{v} = {v}.contiguous(memory_format=torch.channels_last "
                      f"if {v}.is_contiguous() else torch.contiguous_format)")
    if isinstance(node, Relayout):
        layout = "memory_format=torch.channels_last" if node.channels_last else ""
        line = f"{indent}{node.var} = {node.var}.contiguous({layout})"
        tail = f"  # {node.comment}" if node.comment else ""
        return [line + tail] if len(line + tail) <= WIDTH else \
            comment(node.comment, indent) + [line]
    if isinstance(node, CheckIndex):
        return _check_index(node, indent)
    if isinstance(node, Unflatten):
        dims = ", ".join(str(d) for d in node.dims)
        return wrap_line(f"{indent}{node.out} = {node.var}.reshape(list({node.like}.shape) + "
                         f"[{dims}])")
    raise TypeError(f"codegen cannot print {type(node).__name__}")  # pragma: no cover


def _check_index(node: CheckIndex, indent: str) -> list[str]:
    v, i2, i3 = node.var, indent + INDENT, indent + INDENT * 2
    lines = [f"{indent}if {v}.is_floating_point() or {v}.is_complex() or "
             f"{v}.dtype == torch.bool:",
             f'{i2}raise TypeError(f"{node.tensor}: expected integer indices, got '
             f'{{{v}.dtype}}")']
    if node.dims is not None:
        lines += if_block(f"{v}.dim() != {node.dims}", indent) + raise_block(
            f"{node.tensor}: expected {node.dims} axes of indices, got {{{v}.dim()}}", i2)
    vocab = str(node.vocabulary)
    lines += [
        f"{indent}if {v}.dtype != torch.int64 and {v}.dtype != torch.int32:",
        f"{i2}{v} = {v}.long()  # index_select takes these two (and uint8 would wrap the bound)",
        f"{indent}if not torch.jit.is_scripting() and not torch.compiler.is_compiling():",
        f"{i2}# eager: reading the bounds would stop a trace",
        f"{i2}if {v}.numel() and (bool({v}.min() < 0) or bool({v}.max() >= {vocab})):",
        f'{i3}raise IndexError(f"{node.tensor}: indices lie in [0, {{{vocab}}}), got "',
        f'{i3}                 f"{{int({v}.min())}}..{{int({v}.max())}}")']
    if node.rows is None:
        return lines
    rows = str(node.rows)
    return lines + [
        f"{indent}else:",
        f"{i2}# traced: an index out of bounds goes one past the table, which index_select",
        f"{i2}# refuses (a negative one would wrap around to a row)",
        *wrap_line(f"{i2}{v} = torch.where(({v} < 0) | ({v} >= {vocab}), {rows}, {v})")]


def _call(node: Call, indent: str) -> list[str]:
    note = comment(node.comment, indent) if node.comment else []
    args = [arg(a) for a in node.args]
    if node.fn == "[]":  # x[:, :, ::stride]
        var, axis, step = args
        index = ", ".join([":"] * int(axis) + [f"::{step}"])
        return note + [f"{indent}{node.out} = {var}[{index}]"]
    kwargs = [f"{k}={arg(v)}" for k, v in node.kwargs]
    if node.fn.startswith("."):
        rest = args[1:] + kwargs
        if node.fn == ".reshape" and not rest:
            rest = ["()"]  # a scalar
        return note + wrap_call(f"{indent}{node.out} = {args[0]}{node.fn}(", rest, ")")
    return note + wrap_call(f"{indent}{node.out} = {node.fn}(", args + kwargs, ")")
