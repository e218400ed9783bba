"""One adapter layer for one dense layer: the network of a format, a spec string or a compiled
:class:`~tnspec.Network`, checked against the layer's geometry and initialized by ``adapt``'s
rule (docs/adapters.md, "The init rule"): Graph-in for a share of the base layer's output
variance, the output-side core zero (``init="zero"``) or drawn and later offset by a frozen copy
(``init="offset"``), and kept in units of its Graph-in std."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ...errors import SpecError
from ...ir import Network
from ...shapes import geometry, nn_attributes
from ...language.parse import parse
from ...language.settings import SCALE_RANGE
from ...analysis.init import core_inits
from ...fit import decompose
from ...nn import formats
from ...nn.api import _with_options, compile
from ...nn.module import Layer
from ..dense_layers import features, is_linear, weight_of
from ..stand_ins import TensorizedConv, TensorizedLinear

Fmt = str | formats.Format | Network

#: what ``adapt(init=...)`` knows: the output-side core at zero; every core drawn and the
#: initial adapter subtracted by a frozen copy of itself; or the cores fitted to the base
#: weight's principal part in the format (PiSSA's start for any format), subtracted likewise
INITS = ("zero", "offset", "principal")

#: the fit of a principal start: one start, no basin hops, a few seconds a layer
PRINCIPAL_FIT = {"starts": 1, "hops": 0, "max_iter": 30, "max_seconds": 10.0}


@dataclass(frozen=True)
class AdapterPlan:
    """What :func:`adapter_plan` checked of one layer's adapter, before anything is drawn: its
    network, ``F.pad``'s arguments for the base's padding (None: none) and the zeroed core."""

    net: Network
    pad: tuple[tuple[int, ...], str] | None
    zeroed: str


def adapter_layer(base: nn.Module, fmt: Fmt, rank: int | float | None, scale: float,
                  zero: str | None, sizes: Mapping[str, int] | None,
                  options: Mapping[str, Any], init: str = "zero"
                  ) -> tuple[Layer, float, tuple[tuple[int, ...], str] | None, str, str]:
    """The adapter for ``base``: ``(layer, scaling, pad, zeroed core, note)``, initialized
    (``init="zero"``: the zeroed core at zero; ``"offset"``: drawn, for a frozen copy to
    cancel; ``"principal"``: fitted to the base weight, for a frozen copy to cancel); a
    SpecError says why there is none."""
    return drawn_layer(base, adapter_plan(base, fmt, rank, zero, sizes, options), scale, init)


def adapter_plan(base: nn.Module, fmt: Fmt, rank: int | float | None, zero: str | None,
                 sizes: Mapping[str, int] | None, options: Mapping[str, Any]) -> AdapterPlan:
    """The adapter ``base`` would get, checked and nothing drawn; a SpecError says why there
    is none (``adapt`` counts the layers that get one before it draws any)."""
    padding, pad = _padding(base)
    if isinstance(fmt, str) and fmt in formats.NAMES:
        if sizes:
            raise SpecError("sizes= goes with a spec string", hint="give rank= for a format")
        fmt = _built(base, fmt, 8 if rank is None else rank, padding, options)
    elif rank is not None or options:
        raise SpecError(f"rank= and format options go with a format name, not {fmt!r}",
                        hint="give the ranks' sizes in sizes=")
    net = _network(base, fmt, sizes or {})
    differs = _geometry_differs(base, net)
    if differs:
        raise SpecError(f"the adapter's geometry differs from the layer's: {differs}")
    given = geometry(net).convs
    if any(c.padding for c in given):  # runs on the input as it comes: the base's padding
        if tuple(c.padding for c in given) != padding:
            raise SpecError(f"the adapter pads {tuple(c.padding for c in given)}, the layer "
                            f"{getattr(base, 'padding', 0)} ({base.padding_mode})",
                            hint="write the spec without padding: it then runs on the input "
                            "padded as the layer pads it")
        pad = None
    zeroed = decompose.output_core(net) if zero is None else zero
    cores = [c.name for c in net.cores]
    if zeroed not in cores:
        raise SpecError(f"zero={zero!r} is not a core of {net.spec}",
                        hint=f"the cores are {', '.join(cores)}")
    return AdapterPlan(net, pad, zeroed)


def drawn_layer(base: nn.Module, plan: AdapterPlan, scale: float, init: str = "zero"
                ) -> tuple[Layer, float, tuple[tuple[int, ...], str] | None, str, str]:
    """The adapter ``plan`` describes for ``base``, drawn for an output variance of ``scale``
    times the base layer's: ``(layer, scaling, pad, zeroed core, note)``. The cores are drawn
    for the base's variance, as at ``scale=1``, and ``scale`` is carried by the output's
    multiplier (``scaling``, ``sqrt(scale)`` of it): Adam moves each entry of a core by about
    ``lr`` a step, so a step moves the adapter by ``sqrt(scale)`` of what it moves at
    ``scale=1``, where cores drawn smaller would each move more of themselves and a step
    would fall only as ``scale ** ((k - 1) / 2k)`` for ``k`` cores (docs/adapters.md, "The
    default start")."""
    net, pad, zeroed = plan.net, plan.pad, plan.zeroed
    weight = weight_of(base).detach()
    out = weight.shape[0]
    note = ""
    variance = math.nan if weight.is_meta else float(weight.double().pow(2).sum()) / out
    if not variance > 0 or not math.isfinite(variance):
        variance = 1 / (weight[0].numel() or 1)
        note = ("on the meta device (no values yet)" if weight.is_meta else "the base weight is "
                "zero or not finite") + ": scaled for Kaiming's fan-in variance"
    # Graph-in for an output variance of `variance`: the activation scale is 1 / variance,
    # within the range whose stds are finite; what a very small (or large) base weight leaves
    # over is carried by the output's multiplier below
    activation = min(max(1.0 / variance, SCALE_RANGE[0]), SCALE_RANGE[1])
    net = _with_options(net, init="graph-in", activation=activation, bias=False)
    cls = TensorizedLinear if is_linear(base) else TensorizedConv
    layer = cls(net, dtype=weight.dtype, device=weight.device)
    stds = {c.core: c.std(net.sizes) for c in core_inits(net)}
    with torch.no_grad():  # in units of its Graph-in std
        if init == "zero":
            getattr(layer, zeroed).zero_()
        else:
            getattr(layer, zeroed).div_(stds[zeroed])
    scaling = stds[zeroed] * math.sqrt(variance * activation * scale)
    if init == "principal" and not weight.is_meta:
        # the layer's weight = the base weight's best approximation in the format (the
        # truncated SVD for low_rank); a frozen copy cancels it at init, so the model computes
        # W + A - A0: PiSSA's W - A0 + A, the base left as it is. As PiSSA's A and B hold
        # sqrt(S) each, the cores hold the part themselves (scaling 1), their norms equal:
        # Adam moves each entry by about lr, and k cores 1/scaling larger under a small
        # scaling made every step scaling^(1/k) the size (low_rank at 2% on the digits MLP,
        # lr 1e-3, 3 seeds: 0.704 so, 0.931 now; experiments/models/adapter_rates.py)
        scaling = 1.0
        error = layer.fit_(weight.float(), **PRINCIPAL_FIT)
        balance(layer)
        note = "; ".join(filter(None, [note, f"cores fitted to the base weight's principal "
                                       f"part (relative error {error:.3f})"]))
    return layer, scaling, pad, zeroed, note


def balance(layer: Layer) -> None:
    """Scale the cores of ``layer``, in place, to equal Frobenius norms (their geometric mean):
    the network computes the same (it is linear in each core), and no core is left much
    smaller than the others. Cores that are all zero are left as they are."""
    cores = list(layer._cores().values())
    norms = [float(c.detach().double().norm()) for c in cores]
    if not all(n > 0 and math.isfinite(n) for n in norms):
        return
    mean = math.exp(sum(math.log(n) for n in norms) / len(norms))
    with torch.no_grad():
        for core, n in zip(cores, norms):
            core.mul_(mean / n)


def _padding(base: nn.Module) -> tuple[Any, tuple[tuple[int, ...], str] | None]:
    """``(padding, pad)``: the zero padding for an adapter run on the input as it comes (the
    base's where it pads zeros equally on both sides of every axis, else 0) and ``F.pad``'s
    arguments for one run on the input padded as the base pads it (None: no padding)."""
    if is_linear(base) or not any(base._reversed_padding_repeated_twice):
        return 0, None
    pads = tuple(base._reversed_padding_repeated_twice)
    pad = (pads, "constant" if base.padding_mode == "zeros" else base.padding_mode)
    left, right = pads[0::2][::-1], pads[1::2][::-1]
    return (tuple(left) if base.padding_mode == "zeros" and left == right else 0), pad


def _built(base: nn.Module, fmt: str, rank: int | float, padding: Any,
           options: Mapping[str, Any]) -> formats.Format:
    if is_linear(base):
        return formats.build(fmt, *features(base), (), rank=rank, **options)
    return formats.build(fmt, base.in_channels, base.out_channels, tuple(base.kernel_size),
                         rank=rank, stride=tuple(base.stride), padding=padding,
                         dilation=tuple(base.dilation), groups=base.groups, **options)


def _network(base: nn.Module, fmt: Fmt, sizes: Mapping[str, int]) -> Network:
    """``fmt`` compiled, with the channel and kernel sizes a spec string leaves out read
    from ``base``."""
    if isinstance(fmt, Network):
        return fmt
    if isinstance(fmt, formats.Format):
        return compile(fmt.spec, sizes=fmt.sizes)
    if not isinstance(fmt, str):
        raise TypeError(f"adapt takes a format name, a spec string, a Network or a Format, not "
                        f"{type(fmt).__name__}")
    doc = parse(fmt)
    if len(doc.layers) != 1 or len(doc.layers[0].networks) != 1:
        raise SpecError(f"{fmt!r} is neither a format ({', '.join(formats.NAMES)}) nor one "
                        "network", hint="compile a .tn file's layer and pass the Network")
    node = doc.layers[0].networks[0]
    x, y = node.operands[0].indices, node.output.indices
    found: dict[str, int] = {}
    groups = getattr(base, "groups", 1)
    for axis, channels in ((x, _channels(base, "in")), (y, _channels(base, "out"))):
        if len(axis) > 1 and axis[1].kind == "name":
            found[axis[1].names[0]] = channels // groups
    for k, (axis, out) in enumerate(zip(x[2:], y[2:])):
        kernel = [n for n in axis.names if n not in out.names]
        if len(kernel) == 1 and k < len(getattr(base, "kernel_size", ())):
            found[kernel[0]] = base.kernel_size[k]
    return compile(fmt, sizes={**found, **sizes})


def _channels(base: nn.Module, side: str) -> int:
    return features(base)[0 if side == "in" else 1]


def _geometry_differs(base: nn.Module, net: Network) -> str:
    """What of ``net``'s geometry differs from ``base``'s ("" where nothing does; the padding
    is left to the caller)."""
    geo = geometry(net)
    if geo is None:
        return "it is neither conv-like nor linear-like"
    attrs = nn_attributes(geo, net.sizes.__getitem__)
    linear = dict(zip(("in_features", "out_features"), features(base))) if is_linear(base) \
        else {}
    for key, value in attrs.items():
        want = linear[key] if key in linear else getattr(base, key, None)
        if key != "padding" and value != (tuple(want) if isinstance(want, (tuple, list))
                                          else want):
            return f"{key} {value} where the layer has {want}"
    return ""
