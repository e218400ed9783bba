"""The lowered program: a short list of typed nodes, the data ``lower`` emits and ``codegen``
prints (in the manner of a ``torch.fx`` graph).

Each :class:`Call` names the torch callable it runs (``"F.conv2d"``, a method such as
``".reshape"``, or ``"[]"`` for strided slicing), its inputs and its keyword arguments. The few
other nodes read and check the data's shape (:class:`CheckShape`, :class:`Unpack`, :class:`Let`,
:class:`Require`) and add the bias (:class:`Bias`). Sizes are symbolic (:class:`Size`).
"""

from __future__ import annotations

import builtins
import keyword
import re
from dataclasses import dataclass, replace
from typing import Any, Union

from .ir import Network
from .shapes import Size


@dataclass(frozen=True)
class Var:
    """A local variable of the generated ``forward``."""

    name: str


@dataclass(frozen=True)
class Param:
    """A core read from the module: ``self.<name>``."""

    name: str


Arg = Union[Var, Param, Size, int, str, tuple, list, None]


@dataclass(frozen=True)
class Call:
    """``out = fn(*args, **kwargs)``; a method when ``fn`` starts with ``.``
    (``args[0].reshape(*args[1:])``)."""

    out: str
    fn: str
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...] = ()
    comment: str = ""


@dataclass(frozen=True)
class CheckShape:
    """Raise ValueError unless ``var`` has as many axes as ``expected`` and the given sizes."""

    var: str
    tensor: str
    expected: tuple[tuple[str, Size | None], ...]


@dataclass(frozen=True)
class Unpack:
    """``names = var.shape`` (None: not needed)."""

    var: str
    names: tuple[str | None, ...]


@dataclass(frozen=True)
class Let:
    """``out = value``, a size."""

    out: str
    value: Size
    comment: str = ""


@dataclass(frozen=True)
class Require:
    """Raise ValueError with ``message`` unless ``value`` is a positive multiple of ``divisor``
    (divisor None: unless ``value >= 1``). ``message`` mixes text and sizes to print."""

    value: Size
    divisor: Size | None
    message: tuple[str | Size, ...]


@dataclass(frozen=True)
class Bias:
    """``out = var + self.bias.reshape(shape)`` when the module has a bias."""

    out: str
    var: str
    shape: tuple[Size, ...]
    comment: str = ""


@dataclass(frozen=True)
class CompileCopy:
    """Only while ``torch.compile`` or ``torch.export`` traces: ``var`` replaced by a copy in
    the other memory format (channels-last if it is contiguous, else contiguous), so that the
    copy is real whatever the strides."""

    var: str
    comment: str = ""


Node = Union[Call, CheckShape, Unpack, Let, Require, Bias, CompileCopy]


@dataclass(frozen=True)
class Program:
    network: Network
    data: str                            # variable of the data input
    sizes: tuple[tuple[str, str], ...]   # (variable, index name) of every static size read
    nodes: tuple[Node, ...]
    result: str
    unbatched: str | None = None         # flag variable where an unbatched input is taken


# names the generated code uses, builtins, and the names pycodestyle calls ambiguous (E741)
_TAKEN = {"self", "torch", "F", "nn", "math", "sizes", "l", "O", "I"} | set(dir(builtins))


class Namer:
    """Safe, unique Python identifiers for spec names (keywords and builtins get a suffix)."""

    def __init__(self) -> None:
        self.used: set[str] = set(_TAKEN)
        self.names: dict[str, str] = {}

    def __call__(self, key: str, base: str | None = None) -> str:
        if key in self.names:
            return self.names[key]
        name = re.sub(r"\W", "_", base if base is not None else key) or "v"
        if name[0].isdigit():
            name = "v" + name
        if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in self.used:
            stem, n = name + "_", 2
            name = stem
            while name in self.used or keyword.iskeyword(name):
                name, n = f"{stem}{n}", n + 1
        self.used.add(name)
        self.names[key] = name
        return name


# ---- passes over nodes --------------------------------------------------------------------

def reads(node: Node) -> set[str]:
    """Every variable a node reads."""
    found: set[str] = set()

    def visit(arg: Any) -> None:
        if isinstance(arg, Var):
            found.add(arg.name)
        elif isinstance(arg, Size):
            found.update(arg.atoms())
        elif isinstance(arg, (tuple, list)):
            for a in arg:
                visit(a)
    if isinstance(node, Call):
        visit(node.args)
        visit([v for _, v in node.kwargs])
    elif isinstance(node, CheckShape):
        found.add(node.var)
        visit([d for _, d in node.expected])
    elif isinstance(node, Unpack):
        found.add(node.var)
    elif isinstance(node, Let):
        visit(node.value)
    elif isinstance(node, Require):
        visit([node.value, node.divisor, list(node.message)])
    elif isinstance(node, Bias):
        found.add(node.var)
        visit(node.shape)
    elif isinstance(node, CompileCopy):
        found.add(node.var)
    return found


def prune(nodes: list[Node], result: str) -> tuple[list[Node], set[str]]:
    """The nodes that ``result`` depends on (a :class:`Call` or :class:`Let` whose result is
    unused is dropped; checks and the bias stay), and the variables they read."""
    used, kept = {result}, []
    for node in reversed(nodes):
        if isinstance(node, (Call, Let)) and node.out not in used:
            continue
        if isinstance(node, Bias):
            used.discard(node.out)
        used |= reads(node)
        kept.append(node)
    kept.reverse()
    return kept, used


def rename(nodes: list[Node], old: str, new: str) -> list[Node]:
    """``nodes`` with the variable ``old`` called ``new``, where it is made and where read."""
    def swap(arg: Any) -> Any:
        if isinstance(arg, Var):
            return Var(new) if arg.name == old else arg
        if isinstance(arg, (tuple, list)):
            return type(arg)(swap(a) for a in arg)
        return arg
    return [replace(n, out=new if n.out == old else n.out, args=swap(n.args),
                    kwargs=swap(n.kwargs)) if isinstance(n, Call) else
            replace(n, var=new) if isinstance(n, CompileCopy) and n.var == old else n
            for n in nodes]
