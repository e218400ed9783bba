"""The lowered program: a short list of typed nodes, the data ``lower`` emits and ``codegen``
prints (in the manner of a ``torch.fx`` graph).

Each :class:`Call` names the torch callable it runs (``"F.conv2d"``, a method such as
``".reshape"``, or ``"[]"`` for strided slicing), its inputs and its keyword arguments. The few
other nodes read and check the data's shape (:class:`CheckShape`, :class:`Unpack`, :class:`Let`,
:class:`Require`) and add the bias (:class:`Bias`). Sizes are symbolic (:class:`Size`).

:class:`Builder` appends nodes and tracks each variable's layout (``lower`` builds on it); the
passes (:func:`prune`, :func:`rename`) work on finished node lists.
"""

from __future__ import annotations

import builtins
import keyword
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Sequence, Union

from .ir import Network, is_unit
from .shapes import Size, axis_text


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
    #: builds a weight from cores alone, so runs with autocast off: autocast would cast each
    #: core forward and each core's gradient back; the finished weight is cast once, by the
    #: op that reads it, and is built in the cores' precision
    cores_only: bool = False


@dataclass(frozen=True)
class CheckShape:
    """Raise ValueError unless ``var`` has as many axes as ``expected`` and the given sizes;
    where ``unbatched`` names the flag of an input taken without its batch axis (and given one
    since), the message quotes the shape as the caller gave it."""

    var: str
    tensor: str
    expected: tuple[tuple[str, Size | None], ...]
    unbatched: str | None = None


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
    """``out = var + self.bias.reshape(shape)`` when the module has a bias; ``shape`` empty:
    ``var + self.bias``, the bias's axes ending ``var``'s."""

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


@dataclass(frozen=True)
class Relayout:
    """``var = var.contiguous(...)``: channels-last (``channels_last``) or contiguous; the
    data converted to the layout the program runs in, or the result back to the caller's."""

    var: str
    channels_last: bool
    comment: str = ""


@dataclass(frozen=True)
class CheckIndex:
    """An index input: raise TypeError unless ``var`` holds integers (other than int32 and
    int64, which ``index_select`` takes, they become int64), ValueError unless it has
    ``dims`` axes (None: any number), IndexError unless every index lies in
    ``[0, vocabulary)``. A traced or scripted module cannot read the bounds: there an index
    outside them becomes ``rows`` (the table's rows, one past its last), which
    ``index_select`` refuses; left as it is, a negative one would wrap around to a row."""

    var: str
    tensor: str
    vocabulary: Size
    dims: int | None = None
    rows: Size | None = None


@dataclass(frozen=True)
class Unflatten:
    """``out = var.reshape(list(like.shape) + [dims...])``: per-lookup rows back to the index
    input's shape."""

    out: str
    var: str
    like: str
    dims: tuple[Size, ...]


Node = Union[Call, CheckShape, Unpack, Let, Require, Bias, CompileCopy, Relayout, CheckIndex,
             Unflatten]


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


# ---- building a program -------------------------------------------------------------------

Shape = list  # of Size, or -1 for "the rest"


class Builder:
    """Appends nodes to a program under construction and tracks, for every variable, the index
    name of each axis (``layout``) and its symbolic length (``dims``), so that operands are
    permuted and reshaped only where an op needs another layout."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.name = Namer()
        self.nodes: list[Node] = []
        self.static: dict[str, str] = {}  # variable -> index name, of sizes read from self
        self.layout: dict[Var | Param, tuple[str, ...]] = {}  # index names of its axes
        self.dims: dict[Var | Param, tuple[Size, ...]] = {}  # its shape
        self.reshaped: dict[Var, Var | Param] = {}  # a reshape's result -> its source
        self.made_by: dict[Var, str] = {}  # the callable that made each variable

    # ---- sizes ------------------------------------------------------------------------------

    def size(self, index: str) -> Size:
        """The symbol of an index's size: read from the data, or from the module's sizes."""
        if is_unit(index):
            return Size.of(1)
        if self.net.index(index).runtime:
            c = self.net.conv_of(index)  # an affine source h+kh-1 is read as h_in
            base = c.target + "_in" if c and index == c.source and not index.isidentifier() \
                else index
            return Size.of(self.name("size:" + index, base))
        formula = dict(self.net.derived).get(index)
        if formula is not None and formula[0] == "int":  # a derived constant: folded
            return Size.of(formula[1])
        var = self.name("size:" + index, index)
        self.static[var] = index
        return Size.of(var)

    def product(self, indices: Sequence[str]) -> Size:
        return math.prod((self.size(i) for i in indices), start=Size.of(1))

    def dim(self, holder: Var | Param, index: str) -> Size:
        """The current length of ``index``'s axis in ``holder`` (a spread axis is longer)."""
        return self.dims[holder][self.layout[holder].index(index)]

    # ---- emitting ---------------------------------------------------------------------------

    def call(self, base: str, fn: str, *args: Arg, layout: tuple[str, ...],
             dims: Sequence[Size], comment: str = "", **kwargs: Arg) -> Var:
        out = Var(self.name(f"tensor:{len(self.nodes)}", base))
        self.nodes.append(Call(out.name, fn, args, tuple(kwargs.items()), comment))
        self.made_by[out] = fn
        self.layout[out], self.dims[out] = tuple(layout), tuple(dims)
        return out

    def arrange(self, holder: Var | Param, order: Sequence[str], shape: Shape) -> Var | Param:
        """``holder`` permuted into ``order`` and reshaped to ``shape``, each only if needed."""
        layout = self.layout[holder]
        base = holder.name
        # a core's unit axes (written 1) that ``order`` leaves out go last, where the reshape
        # drops them
        units = [k for k, i in enumerate(layout) if i not in order and is_unit(i)]
        if [i for i in layout if i in order] != list(order):
            perm = tuple(layout.index(i) for i in order) + tuple(units)
            order = (*order, *(layout[k] for k in units))
            holder = self.call(base + "_p", ".permute", holder, *perm, layout=tuple(order),
                               dims=[self.dims[holder][p] for p in perm])
        return self.reshape_to(holder, order, shape, base + "_r")

    def without_units(self, holder: Var | Param) -> Var | Param:
        """``holder`` reshaped without its unit axes (a core's ``1``), where it has any."""
        kept = [i for i in self.layout[holder] if not is_unit(i)]
        return holder if len(kept) == len(self.layout[holder]) else \
            self.reshape_to(holder, kept, [self.dim(holder, i) for i in kept], holder.name + "_s")

    def reshape_to(self, holder: Var | Param, layout: Sequence[str], shape: Shape,
                   base: str) -> Var | Param:
        """``holder`` reshaped to ``shape`` unless it has that shape; a reshape of a reshape
        reshapes the original instead."""
        if _same_shape(self.dims[holder], list(shape)):
            self.layout[holder] = tuple(layout)
            return holder
        source = self.reshaped.get(holder, holder) if isinstance(holder, Var) else holder
        if source is not holder and _same_shape(self.dims[source], list(shape)):
            # reshaped back to what it was made as (a conv's channels split, then merged for
            # the output; a core's unit axes reshaped away, then wanted again): one view op
            # fewer each way, and under torch.compile with dynamic shapes no guard that
            # tnspec's size arithmetic equals the conv's
            self.layout[source] = tuple(layout)
            return source
        out = self.call(base, ".reshape", source, *shape, layout=tuple(layout),
                        dims=[Size.of(0) if d == -1 else d for d in shape])
        self.reshaped[out] = source
        return out

    def merged(self, holder: Var | Param, classes: list[list[str]]) -> Var | Param:
        """``holder`` permuted and reshaped so that each non-empty class is one axis."""
        classes = [c for c in classes if c]
        flat = [i for c in classes for i in c]
        holder = self.arrange(holder, flat, [self.dim(holder, i) for i in flat])
        return self.reshape_to(holder, [axis_text(c) for c in classes],
                               [math.prod((self.dim(holder, i) for i in c), start=Size.of(1))
                                for c in classes], holder.name + "_m")


def _same_shape(dims: Sequence[Size], shape: Sequence[Any]) -> bool:
    """Whether reshaping a tensor of ``dims`` to ``shape`` would change nothing (-1 matches
    the one remaining axis)."""
    return len(dims) == len(shape) and sum(d == -1 for d in shape) <= 1 and all(
        s == -1 or Size.of(s) == d for d, s in zip(dims, shape))


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
    elif isinstance(node, (CompileCopy, Relayout)):
        found.add(node.var)
    elif isinstance(node, CheckIndex):
        found.add(node.var)
        visit([node.vocabulary, node.rows])
    elif isinstance(node, Unflatten):
        found |= {node.var, node.like}
        visit(node.dims)
    return found


def prune(nodes: list[Node], result: str) -> tuple[list[Node], set[str]]:
    """The nodes that ``result`` depends on (a :class:`Call` or :class:`Let` whose result is
    unused is dropped; checks and the bias stay), and the variables they read."""
    used, kept = {result}, []
    for node in reversed(nodes):
        if isinstance(node, (Call, Let, Unflatten)) and node.out not in used:
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
            replace(n, var=new) if isinstance(n, (CompileCopy, Relayout)) and n.var == old else n
            for n in nodes]
