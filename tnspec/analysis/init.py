"""Init: how each core is drawn, as plain data (``CoreInit``).

Theory (docs/language.md, "Initialization"; Pan et al., ICML 2022, Theorem 2 and eq. 8). For
zero-mean independent cores and input, every output element is a sum of uncorrelated products,
so

    Var(y) = Var(x) * prod_c Var(W_c) * S_in,   S_in = product of the sizes the forward pass sums
                                                (every core index the output does not carry)

and likewise for the backward pass with S_out (every core index the *input* does not carry: the
sizes the backward network G_bt sums). With the activation's scale p_a:

    graph-in   prod_c Var(W_c) = 1 / (p_a S_in)
    graph-out  prod_c Var(W_c) = 1 / (p_a S_out)
    graph-avg  prod_c Var(W_c) = 2 / (p_a (S_in + S_out))      (the Xavier-like harmonic form)

S_in and S_out are read off the backbone graphs of the forward and the backward network
(``analysis``), and the product is split over the n cores by weights w_c summing to 1 (the
paper's exemplar: w_c = 1/n). The
baselines users apply today are per core, from each core's own shape as ``torch.nn.init`` does:
kaiming-in/out, xavier, orthogonal; and ``naive``, every core given the dense layer's Kaiming
fan-in variance.

Every std is ``(sum of factor * product of sizes) ** exponent``: a formula in the sizes, so
that generated code can compute it for any constructor sizes, and print it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..errors import SpecError
from ..ir import INITS, Network, Options, Role, without_units
from .backbone import backbone

#: p_a = E[f(z)^2] / Var(z) for z ~ N(0, 1): the factor the activation applies to the variance
#: (gelu and silu by Gauss-Hermite quadrature; tanh and sigmoid as in the paper / torch: 1)
ACTIVATION_SCALE = {"linear": 1.0, "relu": 0.5, "tanh": 1.0, "sigmoid": 1.0,
                    "gelu": 0.42522, "silu": 0.35578}


def activation_scale(options: Options) -> float:
    """p_a of the layer's activation: a name, ``leaky_relu`` with its slope, or a number."""
    act = options.activation
    if isinstance(act, (int, float)):
        return float(act)
    if act == "leaky_relu":
        slope = 0.01 if options.activation_param is None else options.activation_param
        return (1 + slope**2) / 2
    return ACTIVATION_SCALE[act]


@dataclass(frozen=True)
class CoreInit:
    """How one core is drawn: ``std = (sum_t factor_t * prod(sizes of names_t)) ** exponent``
    over ``terms = ((factor_t, names_t), ...)``; for "orthogonal" the value is the gain."""

    core: str
    method: str  # "normal", "uniform" or "orthogonal"
    terms: tuple[tuple[float, tuple[str, ...]], ...]
    exponent: float
    why: str

    def std(self, sizes: Mapping[str, int]) -> float:
        try:
            total = sum(f * math.prod(sizes[i] for i in names) for f, names in self.terms)
            return total ** self.exponent
        except OverflowError:  # the generated reset_parameters would raise the same
            raise SpecError(f"core {self.core!r}: the init's product of sizes does not fit a "
                            "float", hint="use fewer cores or smaller sizes") from None


def core_inits(net: Network, init: str | None = None) -> tuple[CoreInit, ...]:
    """How to draw each core of ``net`` under ``init`` (default: the network's option).

    Graph modes split the product of variances over the cores by the relative weights of the
    ``init_weights`` option (default equal: the paper's exemplar)."""
    opts = net.options
    init = init or opts.init
    p = activation_scale(opts)
    method = "normal" if opts.distribution == "normal" else "uniform"
    if net.lookup and init in ("graph-in", "graph-out", "graph-avg"):
        if init != "graph-in":
            raise SpecError(f"init {init!r} needs the gradient of the input, and an index "
                            "input has none", hint="use init 'graph-in' for an index input")
        # the one-hot input sums exactly one row: Var(y) = prod Var(W_c) * (the sums other
        # than the modes), as nn.Embedding's N(0, 1) rows when p_a = 1
        modes = set(net.input.axes[-1])
        summed = tuple(i for i in backbone(net, "in").summed if i not in modes)
        return tuple(CoreInit(c.name, method, ((p, summed),), -w / 2,
                              f"graph-in, index input: prod Var(W) = 1 / ({p:g} * "
                              f"{'*'.join(summed) or '1'}); share of {c.name}: {w:.3g}")
                     for c, w in zip(net.cores, _weights(net)))
    if init in ("graph-in", "graph-out", "graph-avg"):
        s_in = backbone(net, "in")
        s_out = backbone(net, "out", exact_stride=opts.stride_count == "exact")
        # exact stride: a strided kernel counts K/s, a factor on top of the product of sizes
        adjust = s_out.S / math.prod(net.sizes[i] for i in s_out.summed)
        terms = {"graph-in": ((p, s_in.summed),),
                 "graph-out": ((p * adjust, s_out.summed),),
                 "graph-avg": ((p / 2, s_in.summed), (p / 2 * adjust, s_out.summed))}[init]
        weights = _weights(net)
        formula = " + ".join(f"{f:g} * {'*'.join(n) or '1'}" for f, n in terms)
        return tuple(CoreInit(c.name, method, terms, -w / 2,
                              f"{init}: prod Var(W) = 1 / ({formula}); share of {c.name}: "
                              f"{w:.3g}") for c, w in zip(net.cores, weights))
    if init == "naive":
        fan = net.with_role(Role.INPUT_MODE, Role.KERNEL)
        return tuple(CoreInit(c.name, method, ((p, fan),), -0.5,
                              "naive: each core gets the dense layer's Kaiming fan-in variance")
                     for c in net.cores)
    # a unit axis is storage: the fans are those of the core without it
    return tuple(_per_core(c.name, c.indices, init, p, method)
                 for c in without_units(net).cores)


def _weights(net: Network) -> list[float]:
    given = dict(net.options.init_weights)
    names = [c.name for c in net.cores]
    unknown = set(given) - set(names)
    if unknown:
        raise SpecError(f"init_weights names {sorted(unknown)[0]!r}, which is not a core",
                        hint=f"the cores are {', '.join(names)}")
    raw = [given.get(n, 1.0) if given else 1.0 for n in names]
    if min(raw) <= 0 or not all(math.isfinite(w) for w in raw):
        raise SpecError(f"init_weights must be positive finite numbers, got {given}",
                        hint="relative shares, e.g. init_weights={'U': 1, 'G': 2}")
    return [w / sum(raw) for w in raw]


def _per_core(name: str, shape: tuple[str, ...], init: str, p: float, method: str) -> CoreInit:
    """torch.nn.init's fan rule on the core's own shape: fan_in = dim 1 x rest, fan_out = dim 0
    x rest (a 1-D core: both are its size)."""
    rest = shape[2:]
    fan_in = (shape[1:2] + rest) if len(shape) > 1 else shape
    fan_out = shape[:1] + rest
    if init == "kaiming-in":
        return CoreInit(name, method, ((p, fan_in),), -0.5, "kaiming fan-in on the core's shape")
    if init == "kaiming-out":
        return CoreInit(name, method, ((p, fan_out),), -0.5,
                        "kaiming fan-out on the core's shape")
    if init == "xavier":
        return CoreInit(name, method, ((p / 2, fan_in), (p / 2, fan_out)), -0.5,
                        "xavier on the core's shape")
    if init == "orthogonal":
        return CoreInit(name, "orthogonal", ((p, ()),), -0.5, "orthogonal, gain 1/sqrt(p_a)")
    raise SpecError(f"invalid init: {init!r}", hint=f"choose one of {', '.join(INITS)}")
