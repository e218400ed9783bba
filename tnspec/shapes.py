"""Shapes: symbolic sizes, the output-size formula, and binding a network to a data shape.

Every stage that reasons about sizes uses this module: ``bind_shape`` (run-time sizes from the
data's shape, for planning), ``check_shape`` (the error for a wrong shape), ``guard_bytes``
(the memory guard on a bound network), ``geometry`` (the network as ``nn.ConvNd`` or
``nn.Linear``) and :func:`conv_out` (PyTorch's output-size formula). ``conv_out`` is written
once and evaluated both on ints (binding) and on :class:`Size` symbols (the code lowering
emits), so the generated module computes sizes exactly as the planner did.

A :class:`Size` is an integer polynomial in named sizes, with ``(...) // n`` kept as an atom
when it does not divide exactly. Arithmetic folds constants as it goes, so a stride-1 conv with
padding 1 gives ``h_in + 3 - kh``, and ``h_in`` once the kernel size is a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

from .errors import SpecError
from .ir import Conv, Network, Role, Tensor, is_unit

Atom = Union[str, "FloorDiv"]
Monomial = tuple  # sorted tuple of atoms; () is the constant term


@dataclass(frozen=True)
class FloorDiv:
    """``num // den`` that does not simplify (an atom of a :class:`Size`)."""

    num: "Size"
    den: "int | Size"

    def __str__(self) -> str:
        den = self.den if isinstance(self.den, int) else num_text(self.den)
        return f"{num_text(self.num)} // {den}"


def num_text(s: "Size") -> str:
    """``s`` parenthesized unless it is a single name or number."""
    text = str(s)
    return text if s.is_atomic() else f"({text})"


@dataclass(frozen=True)
class Size:
    """A polynomial over named sizes: ``terms`` maps monomials to integer coefficients."""

    terms: tuple[tuple[Monomial, int], ...] = ()

    @staticmethod
    def of(value: "int | str | Size") -> "Size":
        if isinstance(value, Size):
            return value
        if isinstance(value, str):
            return Size((((value,), 1),))
        return Size((((), int(value)),)) if value else Size()

    @staticmethod
    def _make(acc: dict) -> "Size":
        return Size(tuple(sorted(((m, c) for m, c in acc.items() if c),
                                 key=lambda mc: [str(a) for a in mc[0]])))

    def __add__(self, other: "int | str | Size") -> "Size":
        acc = dict(self.terms)
        for m, c in Size.of(other).terms:
            acc[m] = acc.get(m, 0) + c
        return Size._make(acc)

    __radd__ = __add__

    def __neg__(self) -> "Size":
        return Size(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: "int | str | Size") -> "Size":
        return self + -Size.of(other)

    def __rsub__(self, other: "int | str | Size") -> "Size":
        return Size.of(other) - self

    def __mul__(self, other: "int | str | Size") -> "Size":
        acc: dict = {}
        for m1, c1 in self.terms:
            for m2, c2 in Size.of(other).terms:
                m = tuple(sorted(m1 + m2, key=str))
                acc[m] = acc.get(m, 0) + c1 * c2
        return Size._make(acc)

    __rmul__ = __mul__

    def __floordiv__(self, den: "int | Size") -> "Size":
        if isinstance(den, Size):
            if den.constant is None:
                return Size((((FloorDiv(self, den),), 1),))
            den = den.constant
        if den == 1:
            return self
        if all(c % den == 0 for _, c in self.terms):
            return Size(tuple((m, c // den) for m, c in self.terms))
        const = self.constant
        if const is not None:
            return Size.of(const // den)
        # (A + q*den) // den == A // den + q for any integer q: move the multiple out
        q = dict(self.terms).get((), 0) // den
        return Size((((FloorDiv(self - q * den, den),), 1),)) + q

    @property
    def constant(self) -> int | None:
        """The value, if the size is a number."""
        if not self.terms:
            return 0
        if len(self.terms) == 1 and self.terms[0][0] == ():
            return self.terms[0][1]
        return None

    def is_atomic(self) -> bool:
        if self.constant is not None:
            return self.constant >= 0
        if len(self.terms) != 1:
            return False
        m, c = self.terms[0]
        return c == 1 and len(m) == 1 and isinstance(m[0], str)

    def atoms(self) -> set[str]:
        """Every name the size reads."""
        names: set[str] = set()
        for m, _ in self.terms:
            for a in m:
                names |= {a} if isinstance(a, str) else a.num.atoms() | (
                    a.den.atoms() if isinstance(a.den, Size) else set())
        return names

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        # positive terms first, the constant last: h_in - kh + 3
        ordered = sorted(self.terms, key=lambda mc: (mc[0] == (), mc[1] < 0))
        text = ""
        for m, c in ordered:
            mag = abs(c)
            alone = len(m) == 1 and mag == 1  # // binds like *: parenthesize inside a product
            parts = [str(a) if isinstance(a, str) or alone else f"({a})" for a in m]
            body = " * ".join(([str(mag)] if mag != 1 or not parts else []) + parts)
            if not text:
                text = ("-" if c < 0 else "") + body
            else:
                text += (" - " if c < 0 else " + ") + body
        return text

    def evaluate(self, env: Mapping[str, int]) -> int:
        total = 0
        for m, c in self.terms:
            v = c
            for a in m:
                v *= env[a] if isinstance(a, str) else a.num.evaluate(env) // (
                    a.den if isinstance(a.den, int) else a.den.evaluate(env))
            total += v
        return total


def conv_out(n, k, stride: int, dilation: int, padding, input_dilation: int = 1):
    """PyTorch's output size of a convolution over ``n`` positions (after spreading the data by
    ``input_dilation``, the reproducing transformation's T): ints or :class:`Size` alike."""
    spread = (n - 1) * input_dilation + 1
    return (spread + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def axis_text(axis: Sequence[str]) -> str:
    """An axis as the spec writes it: ``c`` or ``(c0 c1)``."""
    if len(axis) == 1:
        return "1" if is_unit(axis[0]) else axis[0]
    return "(" + " ".join(axis) + ")"


def shape_message(name: str, expected: Sequence[tuple[str, int | None]],
                  shape: Sequence[int], unbatched: bool | None = None) -> str:
    """``x: expected shape [b, c=3, h], got [...]``; where ``unbatched`` is not None (the
    layer also takes its input without the batch axis), that form too."""
    def text(axes: Sequence[tuple[str, int | None]]) -> str:
        return "[" + ", ".join(f"{t}={d}" if d is not None else t for t, d in axes) + "]"
    also = f" or, unbatched, {text(expected[1:])}" if unbatched is not None else ""
    return f"{name}: expected shape {text(expected)}{also}, got {list(shape)}"


def check_shape(name: str, expected: Sequence[tuple[str, int | None]],
                shape: Sequence[int], unbatched: bool | None = None) -> None:
    """Raise ValueError unless ``shape`` has the expected rank and static axis sizes. Where the
    layer also takes an input without its (first) batch axis, ``unbatched`` says whether
    ``shape`` is one; the message quotes the shape as given either way."""
    full = (1, *shape) if unbatched else tuple(shape)
    if len(full) != len(expected) or any(
            d is not None and full[n] != d for n, (_, d) in enumerate(expected)):
        raise ValueError(shape_message(name, expected, shape, unbatched))


def expected_axes(t: Tensor, sizes: Mapping[str, int]) -> list[tuple[str, int | None]]:
    """Each axis of ``t`` as (text, its size if every member's size is known)."""
    return [(axis_text(a), math.prod(sizes[i] for i in a) if all(i in sizes for i in a)
             else None) for a in t.axes]


def bind_shape(net: Network, shape: Sequence[int]) -> Network:
    """``net`` with its run-time sizes bound from the data's ``shape``: batch and spatial
    sizes, the one unsized member of a group, and every conv target. Raises ValueError naming
    the expected size."""
    t = net.input
    sizes = net.sizes
    check_shape(t.name, expected_axes(t, sizes), shape)
    bound: dict[str, int] = {}
    for axis, n in zip(t.axes, shape):
        unknown = [i for i in axis if i not in sizes]
        if len(axis) == 1 and unknown:
            bound[axis[0]] = int(n)
        elif unknown:
            known = math.prod(sizes[i] for i in axis if i in sizes)
            if n % known:
                raise ValueError(f"{t.name}: axis {axis_text(axis)} has size {n}, not a "
                                 f"multiple of {known}")
            bound[unknown[0]] = int(n) // known
    for c in net.convs:
        if c.target not in sizes:
            k = sizes[c.kernel] if c.kernel else 1
            bound[c.target] = conv_out(bound[c.source], k, c.stride, c.dilation, c.padding,
                                       c.input_dilation)
            if bound[c.target] < 1:
                raise ValueError(f"{t.name}: axis {c.text} of size {bound[c.source]} is too "
                                 f"small for kernel {k} (dilation {c.dilation}, padding "
                                 f"{c.padding}): the output size would be {bound[c.target]}")
    return net.bind(bound)


def example_shape(net: Network, given: Mapping[str, int], default: int = 32) -> tuple[int, ...]:
    """An input shape for planning: static axes from the sizes, the others from ``given``
    (spatial axes by their output index or their affine text), else ``default``."""
    sizes = net.sizes
    known = set(sizes) | {c.source for c in net.convs} | {c.target for c in net.convs} | \
        set(net.input.indices)
    for key, value in given.items():
        if key not in known:
            raise SpecError(f"shape {key}={value!r} names no index of the input",
                            hint="name batch indices and spatial output indices, e.g. b=32,h=32")
        if key in sizes and not net.index(key).runtime:
            raise SpecError(f"shape {key}={value!r}: the spec fixes {key}={sizes[key]}",
                            hint="the shape gives batch and spatial sizes; set other sizes "
                            "with --set (sizes= in Python)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"shape {key}={value!r} must be a positive int",
                            hint="plan for a typical input, e.g. b=32,h=32")
    by_source = {c.source: c.target for c in net.convs}
    dims = []
    for axis in net.input.axes:
        n = 1
        for i in axis:
            n *= sizes.get(i) or given.get(i) or given.get(by_source.get(i, i)) or default
        dims.append(n)
    return tuple(dims)


def guard_bytes(net: Network, intermediates: Sequence[tuple[str, int]], max_bytes: int,
                itemsize: int) -> None:
    """Raise SpecError if a tensor of the forward pass of ``net`` (bound to a shape) would take
    more than ``max_bytes``: the padded input, each of ``intermediates`` (name, elements), the
    output."""
    sizes = net.sizes
    # an index input is never built one-hot: its modes are not an axis of any tensor
    data = _padded_input(net) // (math.prod(sizes[i] for i in net.input.axes[-1])
                                  if net.lookup else 1)
    tensors = [*intermediates, (f"the padded input {net.input.name}", data),
               (f"the output {net.output.name}", math.prod(sizes[i] for i in net.output.indices))]
    for what, elements in tensors:
        if elements * itemsize > max_bytes:
            raise SpecError(f"{what} would take {_bytes(elements * itemsize)} "
                            f"({elements:,} elements at the batch {_batch(net)}), more than "
                            f"the limit of {_bytes(max_bytes)}",
                            hint="use a smaller batch, input or sizes, or raise max_bytes")


def _padded_input(net: Network) -> int:
    """Elements of the input once padded (and spread by an input dilation) for its convs."""
    sizes, total = net.sizes, 1
    for i in net.input.indices:
        c = net.conv_of(i)
        if c is None or c.source != i:
            total *= sizes[i]
            continue
        spread = (sizes[i] - 1) * c.input_dilation + 1
        k = sizes[str(c.kernel)] if c.kernel is not None else 1
        window = (sizes[c.target] - 1) * c.stride + c.dilation * (k - 1) + 1
        total *= max(spread + 2 * max(c.padding, 0), window)
    return total


def _batch(net: Network) -> str:
    batch = [f"{i}={net.sizes[i]}" for i in net.with_role(Role.BATCH)]
    return ", ".join(batch) if batch else "1"


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class Geometry:
    """How a network stands for ``nn.ConvNd`` (``kind`` "conv") or ``nn.Linear`` ("linear"):
    the index names of its input and output channel axes, the parallel indices leading both
    (the groups), and the relation of each spatial axis."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    groups: tuple[str, ...]
    convs: tuple[Conv, ...]


def geometry(net: Network) -> Geometry | None:
    """The network as a conv or linear layer: ``x[b, C, spatial...] -> y[b, O, spatial...]``
    with C of input modes, O of output modes (parallel indices first in both), each spatial
    axis a zero-padded conv; None for any other network."""
    axes, out = net.input.axes, net.output.axes
    if len(axes) < 2 or len(out) != len(axes) or len(axes[0]) != 1 or out[0] != axes[0] or \
            net.index(axes[0][0]).role is not Role.BATCH:
        return None
    roles = {ix.name: ix.role for ix in net.indices}
    groups = tuple(i for i in axes[1] if roles[i] is Role.PARALLEL)
    if any(roles[i] not in (Role.INPUT_MODE, Role.PARALLEL) for i in axes[1]) or \
            any(roles[i] not in (Role.OUTPUT_MODE, Role.PARALLEL) for i in out[1]) or \
            axes[1][:len(groups)] != groups or out[1][:len(groups)] != groups:
        return None
    convs = []
    for a, b in zip(axes[2:], out[2:]):
        c = net.conv_of(a[0]) if len(a) == 1 else None
        if c is None or c.source != a[0] or b != (c.target,) or c.padding < 0 or \
                c.input_dilation != 1:
            return None
        convs.append(c)
    if not convs and groups:
        return None  # nn.Linear has no groups
    return Geometry("conv" if convs else "linear", axes[1], out[1], groups, tuple(convs))


def nn_attributes(g: Geometry, size: Callable[[str], Any]) -> dict[str, Any]:
    """The attributes ``nn.ConvNd`` (or ``nn.Linear``) has for this geometry, each built from
    ``size(index name)``: ints for a layer, source text for generated code."""
    def prod(names: Sequence[str]) -> Any:
        values = [size(n) for n in names]
        return values[0] if len(values) == 1 else _product(values)
    if g.kind == "linear":
        return {"in_features": prod(g.inputs), "out_features": prod(g.outputs)}
    return {"in_channels": prod(g.inputs), "out_channels": prod(g.outputs),
            "kernel_size": tuple(size(str(c.kernel)) if c.kernel else 1 for c in g.convs),
            "stride": tuple(c.stride for c in g.convs),
            "padding": tuple(c.padding for c in g.convs),
            "dilation": tuple(c.dilation for c in g.convs),
            "groups": prod(g.groups) if g.groups else 1}


def embedding_attributes(net: Network, size: Callable[[str], Any]) -> dict[str, Any]:
    """The attributes ``nn.Embedding`` has, for a network with an index input (as
    :func:`nn_attributes`: ints for a layer, source text for generated code)."""
    dims = [size(i) for i in net.embedded]
    modes = [size(i) for i in net.input.axes[-1]]
    vocabulary = net.options.num_embeddings
    return {"num_embeddings": _product(modes) if vocabulary is None else vocabulary,
            "embedding_dim": _product(dims), "padding_idx": net.options.padding_idx}


def _product(values: list[Any]) -> Any:
    if all(isinstance(v, int) for v in values):
        return math.prod(values)
    return " * ".join(map(str, values))


def lookup_shape(network: Network, shape: Sequence[int]) -> tuple[int, ...]:
    """The planned shape of an index input of ``shape`` (an embedding's): its axes (any number
    where the spec writes one: their product) and the modes' one-hot axis."""
    written = len(network.input.axes) - 1
    modes = network.table_rows
    if written == 1:
        return (math.prod(shape), modes)
    if len(shape) != written:
        raise ValueError(f"{network.input.name}: expected {written} axes of indices, "
                         f"got {len(shape)}")
    return (*shape, modes)
