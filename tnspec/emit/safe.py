"""What codegen may print: every name and text of a Network and of a Program, checked where it
is printed, whatever stage built it.

The generated source is executed (``runtime``), and a :class:`~tnspec.ir.Network` need not
come from the parser: the dataclasses are public, so ``tnspec.Layer(net)`` and
``tnspec.contract(net, ...)`` take one built by hand. A name is printed as code (``self.W``, a
class name, a local), inside a docstring, a comment, or an f-string message, so each must stay
inside the alphabet the grammar gives it: ``[A-Za-z_][A-Za-z0-9_]*`` for names, and the
affine text ``2*h+kh-1`` for the two sides of a conv relation. Anything else is refused with a
:class:`SpecError` before a line is printed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import SpecError
from ..ir import (ACTIVATIONS, DISTRIBUTIONS, INITS, STRIDE_COUNTS, Network, Role, Tensor,
                  clashes, is_unit)
from ..program import (Bias, Call, CheckIndex, CheckShape, CompileCopy, Let, Param, Program,
                       Relayout, Require, Unflatten, Unpack, Var)
from ..shapes import Size

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
UNIT = re.compile(r"1\.[A-Za-z_][A-Za-z0-9_]*\.[0-9]+\Z")  # a core's unit axis: ir.unit_name
AFFINE = re.compile(r"[A-Za-z0-9_]+(?:[*+-][A-Za-z0-9_]+)*\Z")  # a conv side: 2*h+kh-1
#: text of a generated f-string message: printable ASCII without quotes and backslashes
TEXT = re.compile(r"[ !#-&(-\[\]-~]*\Z")
COMMENT = re.compile(r"[^\x00-\x1f\x7f-\x9f\u2028\u2029]*\Z")  # one line, whatever it says
#: what a Call may run: F.conv2d, torch.einsum, a method (.reshape), strided slicing ([])
FUNCTION = re.compile(r"(?:F|torch)(?:\.[A-Za-z_][A-Za-z0-9_]*)+\Z|\.[A-Za-z_][A-Za-z0-9_]*\Z"
                      r"|\[\]\Z")
SIZE = re.compile(r"[A-Za-z0-9_ +\-*/()]*\Z")  # a Size printed as an expression

_HINT = ("names are [A-Za-z_][A-Za-z0-9_]* as the grammar has them; build the Network with "
         "tnspec.compile rather than by hand")


def _name(value: Any, what: str, pattern: re.Pattern = NAME) -> None:
    if not (isinstance(value, str) and pattern.match(value)):
        raise SpecError(f"{what} {value!r} is not a name tnspec can print into code", hint=_HINT)
    if value.startswith("__"):  # Python mangles self.__W inside the generated class
        raise SpecError(f"{what} {value!r}: names starting with '__' are reserved",
                        hint=f"rename it, e.g. {value.strip('_') or 'n'}")


def _int(value: Any, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int:
        raise SpecError(f"{what} {value!r} is not an int", hint="sizes and strides are ints")


def _tensor(t: Any, what: str, sides: set[str]) -> None:
    if not isinstance(t, Tensor):
        raise SpecError(f"{what} is a {type(t).__name__}, not a tnspec Tensor", hint=_HINT)
    _name(t.name, f"{what} name")
    if not isinstance(t.axes, tuple) or not all(isinstance(a, tuple) and a for a in t.axes):
        raise SpecError(f"{what} {t.name}: axes {t.axes!r} are not tuples of index names",
                        hint=_HINT)
    for n in (*t.indices, *t.flipped):
        _name(n, f"index of {t.name}", AFFINE if n in sides else
              UNIT if is_unit(n) and what == "core" else NAME)


def network(net: Any) -> None:
    """Raise :class:`SpecError` unless every name, text and number of ``net`` is one codegen
    may print: names in the grammar's alphabet, known options, int sizes."""
    if not isinstance(net, Network):
        raise SpecError(f"expected a tnspec Network, got {type(net).__name__}", hint=_HINT)
    if net.name is not None:
        _name(net.name, "layer name")
    sides = {s for c in net.convs for s in (c.source, c.target)}
    for c in net.convs:
        _name(c.source, "conv source", AFFINE)
        _name(c.target, "conv target", AFFINE)
        if c.kernel is not None:
            _name(c.kernel, "conv kernel")
        for field in ("stride", "dilation", "padding", "input_dilation"):
            _int(getattr(c, field), f"conv {field}")
    for n, t in enumerate((net.input, *net.cores, net.output)):
        _tensor(t, "input" if n == 0 else "output" if t is net.output else "core", sides)
    names = [t.name for t in (net.input, *net.cores, net.output)]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:  # the check stage's rule: one name, one operand (a variable each)
        raise SpecError(f"operand name {twice!r} is used twice in the Network",
                        hint="give every operand its own name")
    for t in net.cores:  # the check stage's rule: each core is an attribute of the module
        if clashes(t.name):
            raise SpecError(f"core name {t.name!r} clashes with an attribute of the generated "
                            "module", hint=f"rename it, e.g. {t.name.strip('_')}_w")
    for ix in net.indices:
        _name(ix.name, "index", AFFINE if ix.name in sides else
              UNIT if ix.role is Role.UNIT else NAME)
        if (ix.role is Role.UNIT) != is_unit(ix.name) or ix.role is Role.UNIT and ix.size != 1:
            raise SpecError(f"index {ix.name!r}: only a unit axis has role unit, and size 1",
                            hint=_HINT)
        _int(ix.size, f"size of index {ix.name}", allow_none=True)
    known = [ix.name for ix in net.indices]
    used = [n for t in (net.input, *net.cores, net.output) for n in (*t.indices, *t.flipped)]
    used += [n for c in net.convs for n in (c.source, c.target, c.kernel) if n is not None]
    twice = {n for n in known if known.count(n) > 1}
    if twice:
        raise SpecError(f"index {sorted(twice)[0]!r} is declared twice in the Network's indices",
                        hint=_HINT)
    for name in used:
        if name not in known:
            raise SpecError(f"index {name!r} is used but not declared in the Network's indices",
                            hint=_HINT)
    for name, value in net.params:
        _name(name, "size parameter")
        _int(value, f"size parameter {name}")
    for name, formula in net.derived:
        _name(name, "derived size")
        _formula(formula)
    # each size is printed once (a parameter of __init__, or folded), as the index has it
    bound = {ix.name: ix.size for ix in net.indices}
    sized = [n for n, _ in net.params] + [n for n, _ in net.derived]
    for name in sized:
        if sized.count(name) > 1:
            raise SpecError(f"size {name!r} is given twice in the Network's params and derived "
                            "sizes", hint=_HINT)
    for name, value in [*net.params, *((n, f[1]) for n, f in net.derived if f[0] == "int")]:
        if bound.get(name) not in (None, value):
            raise SpecError(f"size {name!r} is {value} in the Network's sizes but its index "
                            f"has size {bound[name]}", hint=_HINT)
    o = net.options
    choices = ((o.init, INITS, "init"), (o.distribution, DISTRIBUTIONS, "distribution"),
               (o.stride_count, STRIDE_COUNTS, "stride_count"))
    for value, allowed, what in choices:
        if value not in allowed:
            raise SpecError(f"unknown {what} {value!r}", hint=f"one of {', '.join(allowed)}")
    if isinstance(o.activation, str):
        if o.activation not in ACTIVATIONS:
            raise SpecError(f"unknown activation {o.activation!r}",
                            hint=f"one of {', '.join(ACTIVATIONS)}, or a number")
    else:
        _number(o.activation, "activation")
    if o.activation_param is not None:
        _number(o.activation_param, "activation_param")
    if not isinstance(o.bias, bool):
        raise SpecError(f"bias {o.bias!r} is not a bool", hint="bias=True or bias=False")
    for core, share in o.init_weights:
        _name(core, "init_weights core")
        _number(share, f"init_weights[{core!r}]")
    _int(o.padding_idx, "padding_idx", allow_none=True)
    _int(o.num_embeddings, "num_embeddings", allow_none=True)
    if not isinstance(net.lookup, bool):
        raise SpecError(f"lookup {net.lookup!r} is not a bool", hint=_HINT)


def _number(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise SpecError(f"{what} {value!r} is not a finite number")


def _formula(f: Any) -> None:
    ok = isinstance(f, tuple) and len(f) in (2, 3)
    if ok and f[0] == "int":
        return _int(f[1], "derived size term")
    if ok and f[0] == "name":
        return _name(f[1], "derived size term")
    if ok and f[0] == "chain" and len(f) == 3 and len(f[2]) == len(f[1]) + 1 and \
            all(op in ("+", "-", "*", "//") for op in f[1]):
        for arg in f[2]:
            _formula(arg)
        return None
    raise SpecError(f"derived size formula {f!r} is malformed", hint=_HINT)


def program(p: Program) -> None:
    """Raise :class:`SpecError` unless every node of ``p`` prints as the code it stands for."""
    network(p.network)
    for v in (p.data, p.result, *(v for v, _ in p.sizes)):
        _name(v, "variable")
    if p.unbatched is not None:
        _name(p.unbatched, "variable")
    for node in p.nodes:
        _node(node)


def _node(node: Any) -> None:
    if isinstance(node, Call):
        _name(node.out, "variable")
        if not FUNCTION.match(node.fn):
            raise SpecError(f"call of {node.fn!r} is not a torch function or method")
        for a in node.args:
            _arg(a)
        for key, a in node.kwargs:
            _name(key, "keyword")
            _arg(a)
        _comment(node.comment)
    elif isinstance(node, CheckShape):
        _name(node.var, "variable")
        _name(node.tensor, "tensor")
        if node.unbatched is not None:
            _name(node.unbatched, "variable")
        for text, size in node.expected:
            literal(text)
            if size is not None:
                _size(size)
    elif isinstance(node, Unpack):
        _name(node.var, "variable")
        for n in node.names:
            if n is not None:
                _name(n, "variable")
    elif isinstance(node, Let):
        _name(node.out, "variable")
        _size(node.value)
        _comment(node.comment)
    elif isinstance(node, Require):
        _size(node.value)
        if node.divisor is not None:
            _size(node.divisor)
        for part in node.message:
            literal(part) if isinstance(part, str) else _size(part)
    elif isinstance(node, Bias):
        _name(node.out, "variable")
        _name(node.var, "variable")
        for size in node.shape:
            _size(size)
        _comment(node.comment)
    elif isinstance(node, (CompileCopy, Relayout)):
        _name(node.var, "variable")
        _comment(node.comment)
    elif isinstance(node, CheckIndex):
        _name(node.var, "variable")
        _name(node.tensor, "tensor")
        _size(node.vocabulary)
        if node.rows is not None:
            _size(node.rows)
        if not (node.dims is None or type(node.dims) is int):
            raise SpecError(f"codegen cannot print the axis count {node.dims!r}")
    elif isinstance(node, Unflatten):
        for v in (node.out, node.var, node.like):
            _name(v, "variable")
        for size in node.dims:
            _size(size)
    else:
        raise SpecError(f"codegen cannot print a {type(node).__name__}")


def _arg(a: Any) -> None:
    if isinstance(a, (Var, Param)):
        _name(a.name, "variable" if isinstance(a, Var) else "core")
    elif isinstance(a, Size):
        _size(a)
    elif isinstance(a, (tuple, list)):
        for item in a:
            _arg(item)
    elif not (a is None or isinstance(a, (str, int, float))):  # str is printed repr'd
        raise SpecError(f"codegen cannot print the argument {a!r}")


def _size(s: Any) -> None:
    if not (isinstance(s, (Size, int)) and SIZE.match(str(s))):
        raise SpecError(f"size {s!r} is not an expression codegen can print")


def literal(value: Any) -> None:
    """Raise :class:`SpecError` unless ``value`` can go into a generated string literal."""
    if not (isinstance(value, str) and TEXT.match(value)):
        raise SpecError(f"text {value!r} cannot be printed into a generated message or comment",
                        hint=_HINT)


def _comment(text: Any) -> None:
    if not (isinstance(text, str) and COMMENT.match(text)):
        raise SpecError(f"comment {text!r} is not one line of text", hint=_HINT)
