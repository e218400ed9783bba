"""The public entry points: ``tnspec.compile`` (text -> Network) and ``tnspec.layer`` (text ->
an initialized ``torch.nn.Module``), and the module class itself."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from . import codegen
from . import init as initializers
from .check import DEFAULT_MAX_ELEMENTS, check, select_layer
from .errors import SpecError
from .ir import DISTRIBUTIONS, INITS, STRIDE_COUNTS, Network
from .lower import Program, bias_shape, bind_shape, lower
from .runtime import run
from .parse import parse
from .plan import Plan, plan
from .settings import activation_from_python
from .codegen import summary_line


def compile(text: str, /, *, name: str | None = None,
            max_elements: int = DEFAULT_MAX_ELEMENTS, sizes: Mapping[str, int] | None = None,
            **more_sizes: int) -> Network:
    """Parse and check ``text`` (an expression or a ``.tn`` file) into a :class:`Network`.

    ``name`` picks a layer of a file; ``sizes`` and keyword sizes bind or override index sizes
    (the mapping takes any index name, also one that is a keyword of this function). Cores
    with more than ``max_elements`` elements are refused. Raises :class:`tnspec.SpecError`.

    >>> net = compile("x[b, i], W[i, o] -> y[b, o]", i=4, o=3)
    >>> net.sizes
    {'i': 4, 'o': 3}
    """
    return check(parse(text), layer=name, sizes=_merge(sizes, more_sizes),
                 max_elements=max_elements)


def _merge(sizes: Mapping[str, int] | None, more: Mapping[str, int]) -> dict[str, int]:
    """The ``sizes`` mapping and keyword sizes as one dict; an index given in both is refused."""
    both = sorted(set(sizes or {}) & set(more))
    if both:
        raise SpecError(f"size {both[0]!r} is given twice, in sizes= and as a keyword",
                        hint="give each size once")
    return {**(sizes or {}), **more}


def compile_all(text: str, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[Network]:
    """Every layer of ``text``, each with its default sizes."""
    doc = parse(text)
    return [check(doc, layer=lay.name, max_elements=max_elements) for lay in doc.layers]


def generate(text: str, /, *, names: Sequence[str] | None = None,
             shape: Mapping[str, int] | None = None, init: str | None = None,
             planner: str = "auto", source: str | None = None,
             sizes: Mapping[str, int] | None = None, **more_sizes: int) -> str:
    """Python source of a standalone module with one class per layer of ``text``.

    ``names`` picks layers (default: all); ``shape`` gives the input sizes the contraction order
    is planned for (batch and spatial indices by name, spatial ones by their output index;
    default 32 each); ``sizes`` and keyword sizes override the parameters of the layers that
    declare them.
    """
    sizes = _merge(sizes, more_sizes)
    doc = parse(text)
    chosen = list(names) if names else [lay.name for lay in doc.layers]
    unused = set(sizes) if doc.is_file else set()
    programs = []
    for name in chosen:
        if doc.is_file:  # --set reaches the layers that declare the parameter
            declared = {p.name for p in select_layer(doc, name).params}
            own = {k: v for k, v in sizes.items() if k in declared}
            unused -= set(own)
        else:
            own = sizes
        net = _with_options(check(doc, layer=name, sizes=own), init=init)
        bound = bind_shape(net, example_shape(net, shape or {}))
        the_plan = plan(bound, planner)
        programs.append((lower(the_plan), summary_line(the_plan)))
    if unused:
        raise SpecError(f"no layer has a parameter named {sorted(unused)[0]!r}",
                        hint="--set names a size parameter of a layer")
    return codegen.generate(programs, source)


def example_shape(net: Network, given: Mapping[str, int], default: int = 32) -> tuple[int, ...]:
    """An input shape for planning: static axes from the sizes, the others from ``given``
    (spatial axes by their output index or their affine text), else ``default``."""
    sizes = net.sizes
    known = set(sizes) | {c.source for c in net.convs} | {c.target for c in net.convs} | \
        set(net.input.indices)
    for key in given:
        if key not in known:
            raise SpecError(f"--shape names {key!r}, which is not an index of the input",
                            hint="name batch indices and spatial output indices, e.g. b=32,h=32")
    by_source = {c.source: c.target for c in net.convs}
    dims = []
    for axis in net.input.axes:
        n = 1
        for i in axis:
            n *= sizes.get(i) or given.get(i) or given.get(by_source.get(i, i)) or default
        dims.append(n)
    return tuple(dims)


def _with_options(net: Network, **overrides: Any) -> Network:
    """``net`` with some options replaced (None leaves an option as the spec says)."""
    values = {k: v for k, v in overrides.items() if v is not None}
    for key, choices in (("init", INITS), ("distribution", DISTRIBUTIONS),
                         ("stride_count", STRIDE_COUNTS)):
        if key in values and values[key] not in choices:
            raise SpecError(f"unknown {key} {values[key]!r}",
                            hint=f"choose one of {', '.join(choices)}")
    if "activation" in values:
        values["activation"], values["activation_param"] = \
            activation_from_python(values["activation"])
    if "bias" in values:
        values["bias"] = bool(values["bias"])
    return replace(net, options=replace(net.options, **values)) if values else net


def layer(text: str, /, *, name: str | None = None, init: str | None = None,
          activation: str | float | None = None, bias: bool | None = None,
          distribution: str | None = None, stride_count: str | None = None,
          init_weights: Mapping[str, float] | None = None,
          dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          planner: str = "auto", autotune: bool = False,
          max_elements: int = DEFAULT_MAX_ELEMENTS, sizes: Mapping[str, int] | None = None,
          **more_sizes: int) -> "Layer":
    """An initialized ``nn.Module`` for ``text`` (an expression, or a ``.tn`` file's text with
    ``name`` picking the layer). ``sizes`` (a mapping, for index names that are keywords here)
    and keyword sizes bind or override the spec's sizes; these override
    its options: ``init`` (graph-in, graph-out, graph-avg, kaiming-in, kaiming-out, xavier,
    orthogonal, naive), ``activation`` (a name, ``"leaky_relu(0.1)"``, or the scale p_a),
    ``bias``, ``distribution`` (normal, uniform), ``stride_count`` ("exact": graph-out counts
    K/s taps on strided axes), ``init_weights`` (relative shares of a graph mode's product of
    variances, by core name). With ``autotune=True`` the first call for each input shape times
    the candidate contraction orders and keeps the fastest.

    >>> m = layer("x[b, i], W[i, o] -> y[b, o]", i=4, o=3)
    >>> m(torch.ones(2, 4)).shape
    torch.Size([2, 3])
    """
    net = compile(text, name=name, max_elements=max_elements, sizes=sizes, **more_sizes)
    weights = tuple((str(k), float(v)) for k, v in init_weights.items()) if init_weights \
        else None
    net = _with_options(net, init=init, activation=activation, bias=bias,
                        distribution=distribution, stride_count=stride_count,
                        init_weights=weights)
    return Layer(net, dtype=dtype, device=device, planner=planner, autotune=autotune,
                 max_elements=max_elements)


class Layer(nn.Module):
    """A tensor-network layer: one ``nn.Parameter`` per core, named as in the spec.

    Attributes: ``spec`` (the canonical expression), ``sizes`` (every bound index size),
    ``network`` (the IR). The contraction order is planned per input shape and cached.
    """

    def __init__(self, network: Network, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, planner: str = "auto",
                 autotune: bool = False, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        super().__init__()
        self.autotune = autotune
        self.network = network
        self.spec = network.spec
        self.sizes = dict(network.sizes)
        self.planner = planner
        self.max_elements = max_elements
        for core in network.cores:
            shape = tuple(self.sizes[i] for i in core.indices)
            self.register_parameter(core.name, nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device)))
        shape = bias_shape(network)
        if network.options.bias and shape:
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self._programs: dict[tuple[int, ...], Program] = {}
        self._last_shape: tuple[int, ...] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every core for the layer's init (respects ``torch.manual_seed``); zero the bias."""
        params = {c.name: getattr(self, c.name) for c in self.network.cores}
        initializers.apply(initializers.core_inits(self.network), params, self.sizes)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def plan(self, shape: Sequence[int]) -> Plan:
        """The contraction plan for an input of ``shape`` (print ``.report()`` to see it)."""
        return plan(bind_shape(self.network, tuple(shape)), self.planner,
                    max_elements=self.max_elements)

    def program(self, shape: Sequence[int]) -> Program:
        """The lowered statements for an input of ``shape`` (planned once, then cached)."""
        key = tuple(int(n) for n in shape)
        if key not in self._programs:
            self._programs[key] = self._fastest(key) if self.autotune else lower(self.plan(key))
        return self._programs[key]

    def _fastest(self, shape: tuple[int, ...], repeats: int = 3) -> Program:
        """Time every distinct candidate order (forward and backward) and keep the fastest."""
        bound = bind_shape(self.network, shape)
        programs: dict[tuple, Program] = {}
        for name in ("auto", "greedy", "dense-first", "left-to-right"):
            try:
                candidate = plan(bound, name, max_elements=self.max_elements)
            except (SpecError, ValueError):
                continue
            key = tuple((s.left.indices, s.right.indices, s.impl) for s in candidate.steps)
            programs.setdefault(key, lower(candidate))
        first = next(iter(self.parameters()))
        x = torch.randn(shape, dtype=first.dtype, device=first.device, requires_grad=True)
        params = {c.name: getattr(self, c.name) for c in self.network.cores}
        inputs = [x, *params.values()]
        best: tuple[float, Program] | None = None
        for program in programs.values():
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                y = run(program, x, params, self.sizes, self.bias)
                torch.autograd.grad(y, inputs, torch.ones_like(y))
                if x.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds = sorted(times[1:])[len(times[1:]) // 2]
            if best is None or seconds < best[0]:
                best = (seconds, program)
        assert best is not None, "the auto planner always gives a candidate"
        return best[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {c.name: getattr(self, c.name) for c in self.network.cores}
        if torch.compiler.is_compiling():
            program = _traced_program(self)
        else:
            self._last_shape = tuple(x.shape)
            program = self.program(self._last_shape)
        return run(program, x, params, self.sizes, self.bias)

    def extra_repr(self) -> str:
        opts = self.network.options
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        return f"{self.spec!r}, {sizes}, init={opts.init!r}, activation={opts.activation!r}"


@torch._dynamo.assume_constant_result
def _traced_program(layer: Layer) -> Program:
    """The Program a compiled layer runs: planned for the last input shape seen eagerly, else
    for the default example shape. Every Program runs any input shape, and the input's shape may
    be symbolic while tracing (dynamic shapes), so it is not part of the key. Planning is plain
    Python that torch.compile should not trace: it runs once, at trace time, as a constant."""
    shape = getattr(layer, "_last_shape", None) or example_shape(layer.network, {})
    return layer.program(shape)
