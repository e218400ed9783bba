"""Tensor formats as spec text: the named formats of the paper's experiments and its random
generator (Pan et al. 2022, appendix "Random Generator").

Every function returns a :class:`Format`, a ``(spec, sizes)`` pair; ``fmt.layer(**options)``
(or ``tnspec.layer(fmt.spec, sizes=fmt.sizes)``) builds the module::

    >>> fmt = tucker2(64, 64, 3, rank=16, padding=1)
    >>> fmt.spec
    'x[b, c, h+kh-1, w+kw-1], U[r0, c, 1, 1], G[r1, r0, kh, kw], V[o, r1, 1, 1] -> y[b, o, h, w]'

Shared arguments: ``in_channels``/``out_channels`` (features for a linear layer);
``kernel_size`` (an int is a square 2-D kernel, a tuple gives 1-D to 3-D, ``()`` a linear layer);
``stride``, ``padding`` (an int, a tuple or ``"same"``) and ``dilation`` as in ``nn.Conv2d``;
``groups`` (a parallel index ``g`` on every core); ``in_modes``/``out_modes`` (the channels as a
product of modes, or a number of near-equal modes); ``rank`` (an int for every rank edge, a
tuple with one per edge, or a float in (0, 1]: the largest equal rank whose layer has at most
that fraction of the dense layer's parameters); ``phi`` (a hyperedge carried by every core).
"""

from __future__ import annotations

import math
import random as _random
import warnings
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from ..errors import SpecError
from ..language.settings import positive_int
from . import axes
from .axes import SPATIAL, IntOrTuple, Padding
from .topologies import TOPOLOGIES

if TYPE_CHECKING:
    from .module import Layer

Rank = int | float | Sequence[int]
Modes = int | Sequence[int] | str | None


class Format(NamedTuple):
    """A tensorial layer as spec text and the sizes of its indices."""

    spec: str
    sizes: dict[str, int]

    def layer(self, **options: Any) -> "Layer":
        """``tnspec.layer(spec, sizes=sizes, **options)``: the initialized module."""
        from .api import layer
        return layer(self.spec, sizes=self.sizes, **options)


NAMES = tuple(TOPOLOGIES)


def build(format: str, in_channels: int, out_channels: int, kernel_size: IntOrTuple = (),
          *, rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
          dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
          out_modes: Modes = None, phi: int | None = None, blocks: int = 2,
          rank_multiple: int = 1) -> Format:
    """The named ``format`` (one of :data:`NAMES`) for a layer of these shapes.

    Args:
        in_channels, out_channels: channels (features, for a linear layer), as ``nn.Conv2d``.
        kernel_size: an int (a square 2-D kernel), a tuple (1-D to 3-D), or ``()`` for a
            linear layer.
        rank: an int for every rank edge, a tuple with one per edge, or a float in (0, 1]: the
            largest equal rank whose layer has at most that share of the dense parameters.
        stride, padding, dilation: as ``nn.Conv2d`` (an int or one per spatial axis);
            ``padding="same"`` for stride 1 and an odd dilated kernel.
        groups: as ``nn.Conv2d``; a parallel index ``g`` on every core.
        in_modes, out_modes: the channels per group as a product of modes (a tuple), a
            number of near-equal modes (an int), or ``"auto"``: the fewest near-equal modes
            of at most 16 each (768 -> 12 x 8 x 8; tt gives both sides the larger count).
            Default ``"auto"`` for tt_lora, 2 for tt, tr and odd, else 1.
        phi: a hyperedge of this size carried by every core (htk2: 4 by default).
        blocks: the number of Tucker terms of ``block_term``.
        rank_multiple: with a float ``rank``, round the rank down to a multiple of this
            (the largest within the share; where none fits, the largest rank that does). CPU
            convolutions pad channels to a vector width, 16 on AVX-512, so a 3x3 conv over 51
            channels costs about what 64 cost, and one over 48 a little over half of that.

    Raises :class:`SpecError` for sizes that are not positive ints, or that do not fit the
    format; warns when the layer has more parameters than the dense one."""
    if format not in TOPOLOGIES:
        raise SpecError(f"unknown format {format!r}", hint=f"choose one of {', '.join(NAMES)}")
    builder, count, names = TOPOLOGIES[format]
    given = {"in_channels": in_channels, "out_channels": out_channels, "groups": groups,
             "blocks": blocks, "rank_multiple": rank_multiple,
             **({} if phi is None else {"phi": phi})}
    for what, value in given.items():
        if positive_int(value) is None:
            raise SpecError(f"{what}={value!r} must be a positive int",
                            hint="channels, groups, blocks, phi and rank_multiple are sizes "
                            "(1 or more)")
    phi = 4 if format == "htk2" and phi is None else phi
    if in_channels % groups or out_channels % groups:
        raise SpecError(f"groups={groups} does not divide in_channels={in_channels} and "
                        f"out_channels={out_channels}", hint="as in nn.Conv2d")
    default_modes = {"tt": 2, "tr": 2, "tt_lora": "auto", "odd": 2}.get(format, 1)
    cin, cout = axes.channel_modes(in_channels // groups, out_channels // groups, in_modes,
                                   out_modes, default_modes, paired=format == "tt")
    if format == "tt" and len(cin) != len(cout):
        raise SpecError(f"tt pairs input and output modes, got {len(cin)} and {len(cout)}",
                        hint="give in_modes and out_modes of the same length")
    if format == "odd" and (len(cin), len(cout)) != (2, 2):
        raise SpecError("the Odd-like network has 2 input and 2 output modes",
                        hint="give in_modes and out_modes of length 2")
    if format == "depthwise_separable" and groups != 1:
        raise SpecError("depthwise_separable takes no groups", hint="leave groups=1")
    x_axis, y_axis, spatial, sizes, parts = axes.geometry(cin, cout, kernel_size, stride,
                                                          padding, dilation, groups)
    if format == "depthwise_separable" and not parts.ks:
        raise SpecError("depthwise_separable needs a kernel", hint="give kernel_size")
    ranks = ["r"] if count(parts) == 1 else [f"r{i}" for i in range(count(parts))]
    if format == "block_term":
        ranks[-1] = "n"

    def make(rank_sizes: Sequence[int]) -> Format:
        cores = builder(parts, ranks)
        head, tail = (["g"] if groups > 1 else []), (["phi"] if phi else [])
        letters = names or _letters(len(cores))
        operands = [f"x[{', '.join(['b', x_axis] + spatial)}]"]
        operands += [f"{letters[i]}[{', '.join(head + core + tail)}]"
                     for i, core in enumerate(cores)]
        out = ", ".join(["b", y_axis] + list(SPATIAL.get(len(parts.ks), ())))
        all_sizes = {**sizes, **dict(zip(ranks, rank_sizes))}
        if format == "block_term":
            all_sizes["n"] = blocks
        if groups > 1:
            all_sizes["g"] = groups
        if phi:
            all_sizes["phi"] = phi
        return Format(f"{', '.join(operands)} -> y[{out}]", all_sizes)

    free = len(ranks) - (format == "block_term")
    dense = in_channels * out_channels // groups * math.prod(sizes[k] for k in parts.ks)
    if isinstance(rank, float) and free == 0:
        return make([])  # nothing to fit: the format has no rank edge
    if isinstance(rank, float):
        if not 0 < rank <= 1:
            raise SpecError(f"a fractional rank is a share of the dense parameters, got {rank}",
                            hint="give a float in (0, 1] or an int")
        return _fit(lambda r: make([r] * free), rank * dense, rank_multiple)
    check_rank_multiple(rank, rank_multiple)
    rank_sizes = [rank] * free if isinstance(rank, int) else list(rank)
    if free and (len(rank_sizes) != free or
                 any(positive_int(r) is None for r in rank_sizes)):
        raise SpecError(f"{format} here has {free} rank edge(s), got rank={rank!r}",
                        hint=f"give one positive int, or a tuple of {free}")
    fmt = make(rank_sizes[:free])
    params = _parameters(fmt)
    if params > dense:
        warnings.warn(f"{format} with rank={rank!r} has {params:,} parameters, more than the "
                      f"{dense:,} of the dense layer it stands for; a float rank such as "
                      "rank=0.25 gives a share of the dense parameters", stacklevel=3)
    return fmt


def check_rank(rank: Rank) -> None:
    """Raise :class:`SpecError` unless ``rank`` is a rank :func:`build` takes: a positive int,
    a float in (0, 1] (a share of the dense parameters) or a tuple of positive ints. A
    workflow calls it before its layer loop, so that a rank of 0 or 1.5 is one error rather
    than every layer skipped."""
    if isinstance(rank, float) and not isinstance(rank, bool):
        if 0 < rank <= 1:
            return
    elif isinstance(rank, Sequence) and not isinstance(rank, str):
        if rank and all(positive_int(r) is not None for r in rank):
            return
    elif positive_int(rank) is not None:
        return
    raise SpecError(f"rank={rank!r} is no rank", hint="give a positive int (every rank edge), "
                    "a tuple of them (one per edge), or a float in (0, 1]: the share of the "
                    "dense layer's parameters")


def check_rank_multiple(rank: Rank, rank_multiple: int) -> None:
    """Raise :class:`SpecError` where ``rank_multiple`` has nothing to round: it rounds the
    rank of a share (a float ``rank``), not a rank given as an int or a tuple; or where it is
    not a positive int."""
    if positive_int(rank_multiple) is None:
        raise SpecError(f"rank_multiple={rank_multiple!r} must be a positive int",
                        hint="e.g. 16, the vector width a CPU convolution pads channels to")
    if rank_multiple != 1 and not isinstance(rank, float):
        raise SpecError(f"rank_multiple={rank_multiple!r} with rank={rank!r}",
                        hint="rank_multiple rounds the rank of a share: give rank=0.25 (a "
                        "float), or an int rank that is the multiple itself")


def _fit(make: Callable[[int], Format], budget: float, multiple: int = 1) -> Format:
    """The format with the largest equal rank whose parameter count is within ``budget``,
    rounded down to a multiple of ``multiple`` where one fits."""

    def params(r: int) -> int:
        return _parameters(make(r))

    if params(1) > budget:
        raise SpecError(f"even rank 1 has {params(1)} parameters, over the budget of "
                        f"{int(budget)}", hint="give a larger fraction or an int rank")
    lo, hi = 1, 2
    while params(hi) <= budget and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid) <= budget else (lo, mid)
    return make(lo // multiple * multiple or lo)


def _parameters(fmt: Format) -> int:
    from .api import compile
    return compile(fmt.spec, sizes=fmt.sizes).num_parameters


def _letters(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)] if n <= 26 else [f"V{i}" for i in range(n)]


def _arguments(given: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in given.items() if k != "__class__"}


# ---- the named formats: explicit signatures, so that editors show every argument ------------


def standard(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
             rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
             dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
             out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """The dense layer itself, one core ``W[o, c, k...]``: exactly ``nn.ConvNd``/``nn.Linear``.
    Arguments as :func:`build`."""
    return build("standard", **_arguments(locals()))


def low_rank(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
             rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
             dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
             out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Two cores: input side (with the kernel) and output side, joined by one rank. Each is
    laid out output index first, as a conv's or linear's weight (and LoRA's ``A`` and ``B``)
    is: ``U[r, c, kh, kw]``, ``V[o, r, 1, 1]`` (a unit axis per kernel axis); the two convs
    take them as stored (7 ops a training step of a 3x3 conv layer, 9 with ``V[o, r]``, 15
    with the factors the other way round; Tucker-2's three ``nn.Conv2d`` by hand 10). Arguments
    as :func:`build`."""
    return build("low_rank", **_arguments(locals()))


def cp(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
       rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
       dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
       out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """CP (Lebedev et al. 2015): one factor per mode and kernel axis, one rank hyperedge.
    Of a conv, the factors are laid out as its four convs read them (``A[r, c, 1, 1]``,
    ``B[r, 1, kh, 1]``, ``C[r, 1, 1, kw]``, ``D[o, r, 1, 1]``): a kernel built first is a
    broadcast multiply of two factors (21 ops a training step of a 64 -> 64 3x3 layer at 10%,
    44 with the factors the other way round), the four convs' order their 13. Arguments as
    :func:`build`."""
    return build("cp", **_arguments(locals()))


def tucker(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
           rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
           dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
           out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Tucker: a factor per mode and kernel axis around a core of all ranks.
    Arguments as :func:`build`."""
    return build("tucker", **_arguments(locals()))


def tucker2(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
            rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
            dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
            out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Tucker-2 (Kim et al. 2016): 1x1 reduction, a ``r0 -> r1`` conv core, 1x1 expansion.
    Each core is laid out as its conv's weight, a 1x1 factor with a unit axis per kernel axis
    (``U[r0, c, 1, 1]``, ``G[r1, r0, kh, kw]``, ``V[o, r1, 1, 1]``): the convs take them as
    stored (10 ops a training step, as three ``nn.Conv2d`` written by hand; 23 before the
    layout, 14 before the unit axes). Arguments as :func:`build`."""
    return build("tucker2", **_arguments(locals()))


def htk2(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
         rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
         dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
         out_modes: Modes = None, phi: int | None = 4, rank_multiple: int = 1) -> Format:
    """Hyper Tucker-2 (Pan et al. 2022, Fig. 5): Tucker-2 with a hyperedge ``phi`` (default 4).
    Arguments as :func:`build`."""
    return build("htk2", **_arguments(locals()))


def tt(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
       rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
       dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
       out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Tensor train (Garipov et al. 2016): a kernel core, then a core per (in, out) mode pair.
    Arguments as :func:`build`."""
    return build("tt", **_arguments(locals()))


def tr(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
       rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
       dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
       out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Tensor ring (Wang et al. 2018): mode cores and a kernel core on one ring of ranks.
    Arguments as :func:`build`."""
    return build("tr", **_arguments(locals()))


def tt_lora(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
            rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
            dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
            out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """Tensor train over small modes (TT-LoRA's and LoRETTA's layout): a core per input mode,
    a kernel core, a core per output mode, on an open chain, so that the bond between the
    input and the output side plays LoRA's rank. Arguments as :func:`build`."""
    return build("tt_lora", **_arguments(locals()))


def block_term(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
               rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
               dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
               out_modes: Modes = None, phi: int | None = None, blocks: int = 2,
               rank_multiple: int = 1) -> Format:
    """Block-term: a sum of ``blocks`` Tucker terms (the block index is a hyperedge).
    Arguments as :func:`build`."""
    return build("block_term", **_arguments(locals()))


def odd(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
        rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
        dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
        out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """The Odd-like network: 9 cores, 14 ranks, 2 input and 2 output modes.
    Arguments as :func:`build`."""
    return build("odd", **_arguments(locals()))


def hypernet(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
             rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
             dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
             out_modes: Modes = None, phi: int | None = None, rank_multiple: int = 1) -> Format:
    """A hyper-edged network: input, kernel and output cores sharing one rank hyperedge.
    Arguments as :func:`build`."""
    return build("hypernet", **_arguments(locals()))


def depthwise_separable(in_channels: int, out_channels: int, kernel_size: IntOrTuple = (), *,
                        rank: Rank = 8, stride: IntOrTuple = 1, padding: Padding = 0,
                        dilation: IntOrTuple = 1, groups: int = 1, in_modes: Modes = None,
                        out_modes: Modes = None, phi: int | None = None,
                        rank_multiple: int = 1) -> Format:
    """Depthwise conv then pointwise 1x1 (MobileNet); no rank, no groups.
    Arguments as :func:`build`."""
    return build("depthwise_separable", **_arguments(locals()))


def random(seed: int, *, vertices: tuple[int, int] = (4, 8), modes: tuple[int, int] = (2, 3),
           mode_size: tuple[int, int] = (2, 4), rank_size: tuple[int, int] = (2, 4),
           conv: bool = True, kernel: int = 3, stride: int = 1, hyperedge: float = 0.5,
           extra_edges: float = 0.3, in_modes: Sequence[int] | None = None,
           out_modes: Sequence[int] | None = None) -> Format:
    """A random tensorial layer as in the paper's appendix: 4-8 vertices (cores), 2-3 input
    and 2-3 output modes, rank edges joining every vertex to the network (a random spanning
    tree, plus each other pair with probability ``extra_edges``), the kernel on one random
    vertex when ``conv`` (odd ``kernel``, 'same' padding, ``stride``), and with probability
    ``hyperedge`` an index phi on every vertex.
    Sizes are drawn from the given ranges; ``in_modes``/``out_modes`` fix the mode sizes
    instead (to chain layers)."""
    rng = _random.Random(seed)
    n = rng.randint(*vertices)
    cores: list[list[str]] = [[] for _ in range(n)]
    sizes: dict[str, int] = {}
    ins = [f"i{k}" for k in range(len(in_modes) if in_modes else rng.randint(*modes))]
    outs = [f"o{k}" for k in range(len(out_modes) if out_modes else rng.randint(*modes))]
    for name in ins + outs:
        cores[rng.randrange(n)].append(name)
        sizes[name] = rng.randint(*mode_size)
    sizes.update(zip(ins, in_modes or ()))
    sizes.update(zip(outs, out_modes or ()))
    edges = [(rng.randrange(v), v) for v in range(1, n)]  # a random spanning tree
    edges += [(a, b) for a in range(n) for b in range(a + 1, n)
              if (a, b) not in edges and rng.random() < extra_edges]
    for k, (a, b) in enumerate(edges):
        cores[a].append(f"r{k}")
        cores[b].append(f"r{k}")
        sizes[f"r{k}"] = rng.randint(*rank_size)
    if conv:
        cores[rng.randrange(n)] += ["kh", "kw"]
        sizes.update(kh=kernel, kw=kernel)
    if rng.random() < hyperedge:
        for core in cores:
            core.append("phi")
        sizes["phi"] = rng.randint(2, 4)
    data = ins[0] if len(ins) == 1 else "(" + " ".join(ins) + ")"
    result = outs[0] if len(outs) == 1 else "(" + " ".join(outs) + ")"
    s, p = (f"{stride}*" if stride > 1 else ""), (f"-{kernel // 2}" if kernel > 1 else "")
    spatial_in = f", {s}h+kh{p}, {s}w+kw{p}" if conv else ""
    spatial_out = ", h, w" if conv else ""
    operands = [f"x[b, {data}{spatial_in}]"]
    operands += [f"V{v}[{', '.join(core)}]" for v, core in enumerate(cores)]
    return Format(f"{', '.join(operands)} -> y[b, {result}{spatial_out}]", sizes)
