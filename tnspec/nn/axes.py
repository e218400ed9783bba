"""A layer's ``nn.ConvNd``-style arguments as spec axes: channels as products of modes, and
kernel size, stride, padding, dilation and groups as the affine input terms of a conv edge
(``2*h+kh-1``) with the sizes they fix. Used by :mod:`tnspec.formats` to write specs.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Sequence

from ..errors import SpecError

IntOrTuple = int | Sequence[int]
Padding = int | Sequence[int] | str
SPATIAL = {1: ("h",), 2: ("h", "w"), 3: ("d", "h", "w")}


class Parts(NamedTuple):
    """What a format's cores are built from: input/output mode names, kernel names."""

    ins: list[str]
    outs: list[str]
    ks: list[str]


def geometry(cin: list[int], cout: list[int], kernel_size: IntOrTuple, stride: IntOrTuple,
             padding: IntOrTuple | str, dilation: IntOrTuple, groups: int
             ) -> tuple[str, str, list[str], dict[str, int], Parts]:
    """Input/output channel axes, input spatial terms, sizes, and the mode and kernel names."""
    ins = ["c"] if len(cin) == 1 else [f"c{i}" for i in range(len(cin))]
    outs = ["o"] if len(cout) == 1 else [f"o{i}" for i in range(len(cout))]
    sizes = dict(zip(ins, cin)) | dict(zip(outs, cout))
    g = ["g"] if groups > 1 else []
    x_axis = ins[0] if len(ins) + len(g) == 1 else f"({' '.join(g + ins)})"
    y_axis = outs[0] if len(outs) + len(g) == 1 else f"({' '.join(g + outs)})"
    kernel = (kernel_size,) * 2 if isinstance(kernel_size, int) else tuple(kernel_size)
    dims = len(kernel)
    if dims > 3 or any(k < 1 for k in kernel):
        raise SpecError(f"kernel_size {kernel_size!r} is not 1 to 3 positive sizes",
                        hint="e.g. 3, (3, 5) or (3,) for a 1-D conv; () for a linear layer")
    strides, dilations = per_dim(stride, dims, "stride"), per_dim(dilation, dims, "dilation")
    if padding == "same":
        if any(s != 1 for s in strides) or any(d * (k - 1) % 2 for d, k in zip(dilations, kernel)):
            raise SpecError("padding='same' needs stride 1 and an odd dilated kernel here",
                            hint="tnspec pads both sides equally; give the padding as ints")
        pads = tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel))
    elif isinstance(padding, str):
        raise SpecError(f"unknown padding {padding!r}", hint="give ints or 'same'")
    else:
        pads = per_dim(padding, dims, "padding", minimum=0)
    spatial, ks = [], []
    for t, k, s, d, p in zip(SPATIAL.get(dims, ()), kernel, strides, dilations, pads):
        term = (f"{s}*{t}" if s != 1 else t) + "+" + (f"{d}*k{t}" if d != 1 else f"k{t}")
        spatial.append(term + (f"-{p}" if p else ""))
        sizes[f"k{t}"] = k
        ks.append(f"k{t}")
    return x_axis, y_axis, spatial, sizes, Parts(ins, outs, ks)


def per_dim(value: IntOrTuple, dims: int, what: str, minimum: int = 1) -> tuple[int, ...]:
    values = (value,) * dims if isinstance(value, int) else tuple(value)
    if len(values) != dims or any(not isinstance(v, int) or v < minimum for v in values):
        raise SpecError(f"{what} {value!r} does not fit a {dims}-D kernel",
                        hint=f"one int >= {minimum} or a tuple of {dims}")
    return values


def split_modes(channels: int, modes: int | Sequence[int], side: str, chosen: bool = True
                ) -> list[int]:
    """``channels`` as a list of mode sizes: given, or split into ``modes`` near-equal ones.
    A split that needs a mode of size 1 is refused when the user ``chosen`` the number of
    modes, and said in a warning when it is the format's default (one channel is all 1s)."""
    if not isinstance(modes, int):
        if math.prod(modes) != channels:
            raise SpecError(f"{side}_modes {tuple(modes)} multiply to {math.prod(modes)}, not "
                            f"{channels}", hint="the modes' product is the channels per group")
        return list(modes)
    if modes == 1:
        return [channels]
    factors, n, f = [], channels, 2
    while f * f <= n:  # prime factors, dealt largest first to the smallest mode
        while n % f == 0:
            factors.append(f)
            n //= f
        f += 1
    if n > 1:
        factors.append(n)
    split = [1] * modes
    for f in sorted(factors, reverse=True):
        split[split.index(min(split))] *= f
    if modes > 1 and 1 in split and channels > 1 and not chosen:
        warnings.warn(f"{side}_channels={channels} has too few factors for {modes} modes: "
                      f"using {tuple(sorted(split, reverse=True))}; give {side}_modes= to "
                      "choose", stacklevel=5)
    elif modes > 1 and 1 in split and channels > 1:
        raise SpecError(f"{side}_channels={channels} has no split into {modes} modes above 1 "
                        f"(factors: {', '.join(map(str, sorted(factors))) or 'none'})",
                        hint=f"give {side}_modes=(...) explicitly, {side}_modes=1, or a channel "
                        "count with more factors")
    return sorted(split, reverse=True)


SMALL_MODE = 16  # the largest mode "auto" leaves: 768 -> 12 x 8 x 8, 4096 -> 16 x 16 x 16


def small_modes(channels: int) -> int:
    """How many near-equal modes split ``channels`` into modes of at most 16 (the many-small-
    modes layout of TT-LoRA and LoRETTA): the fewest that do, or the most that have no mode of
    size 1 where none does (a prime above 16 stays one mode)."""
    best = 1
    for n in range(2, max(2, channels.bit_length())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            split = split_modes(channels, n, "", chosen=False)
        if 1 in split:
            break
        best = n
        if max(split) <= SMALL_MODE:
            break
    return best


def channel_modes(cin: int, cout: int, in_modes: object, out_modes: object, default: object,
                  paired: bool) -> tuple[list[int], list[int]]:
    """The input and output channels as mode sizes, from ``in_modes``/``out_modes`` (None: the
    format's ``default``; an int; a tuple; or ``"auto"``: :func:`small_modes`). ``paired``
    (tt) gives two "auto" sides the same, larger count."""
    ins, outs = (default if m is None else m for m in (in_modes, out_modes))
    for side, m in (("in", ins), ("out", outs)):
        if isinstance(m, str) and m != "auto":
            raise SpecError(f"{side}_modes={m!r} is not a number of modes",
                            hint='give an int, a tuple of mode sizes, or "auto"')
    auto = {side: small_modes(c) for side, m, c in (("in", ins, cin), ("out", outs, cout))
            if m == "auto"}
    if paired and auto:
        auto = dict.fromkeys(auto, max(auto.values()))
    return (split_modes(cin, auto.get("in", ins), "in",
                        chosen="in" not in auto and in_modes is not None),
            split_modes(cout, auto.get("out", outs), "out",
                        chosen="out" not in auto and out_modes is not None))
