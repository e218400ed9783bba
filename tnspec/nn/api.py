"""The public entry points: ``tnspec.compile`` (text -> Network), ``tnspec.layer`` (text -> an
initialized :class:`~tnspec.nn.module.Layer`), ``tnspec.contract`` (its functional form) and
``tnspec.generate`` (the source ``tnspec compile`` writes).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch

from ..errors import SpecError
from ..ir import DEFAULT_MAX_BYTES, DEFAULT_MAX_ELEMENTS, Network
from ..shapes import bind_shape, example_shape
from ..language.check import check, select_layer
from ..language.parse import parse
from ..language.settings import option_value, positive_limit
from ..planning import calibration
from ..planning.plan import plan
from ..emit import codegen, runtime, safe
from ..emit.codegen import LayerCode, summary_line
from ..emit.lower import bias_shape, lower
from .module import Layer

__all__ = ["compile", "compile_all", "contract", "example_shape", "generate", "layer"]


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
                 max_elements=positive_limit("max_elements", max_elements))


def _merge(sizes: Mapping[str, int] | None, more: Mapping[str, int]) -> dict[str, int]:
    """The ``sizes`` mapping and keyword sizes as one dict; an index given in both is refused."""
    both = sorted(set(sizes or {}) & set(more))
    if both:
        raise SpecError(f"size {both[0]!r} is given twice, in sizes= and as a keyword",
                        hint="give each size once")
    return {**(sizes or {}), **more}


def compile_all(text: str, *, names: Sequence[str] | None = None,
                sizes: Mapping[str, int] | None = None,
                max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[Network]:
    """The layers of ``text`` (those in ``names``, default all). ``sizes`` override the
    parameters of the layers that declare them (as ``--set``); a size no chosen layer declares
    is an error."""
    doc = parse(text)
    limit = positive_limit("max_elements", max_elements)
    sizes = dict(sizes or {})
    chosen = list(names) if names else [lay.name for lay in doc.layers]
    unused = set(sizes) if doc.is_file else set()
    nets = []
    params: dict[str, None] = {}  # every parameter of the chosen layers, in order
    for name in chosen:
        if doc.is_file:  # --set reaches the layers that declare the parameter
            declared = [p.name for p in select_layer(doc, name).params]
            params.update(dict.fromkeys(declared))
            own = {k: v for k, v in sizes.items() if k in declared}
            unused -= set(own)
        else:
            own = sizes
        nets.append(check(doc, layer=name, sizes=own, max_elements=limit))
    if unused:
        bad = sorted(unused)[0]
        close = difflib.get_close_matches(bad, list(params), n=1)
        there = ", ".join(params) or "none"
        raise SpecError(f"no layer has a parameter named {bad!r}; the parameters are: {there}",
                        hint=(f"did you mean {close[0]!r}? " if close else "") +
                        "--set names a size parameter of a layer")
    return nets


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
    programs = []
    for net in compile_all(text, names=names, sizes=_merge(sizes, more_sizes)):
        net = _with_options(net, init=init)
        example = example_shape(net, shape or {})
        try:
            bound = bind_shape(net, example)
        except ValueError as exc:  # e.g. a kernel larger than the default 32
            raise SpecError(f"layer {net.name} cannot be planned for the input shape "
                            f"{list(example)}: {exc}", hint="plan for an input larger than the "
                            "kernel with --shape (shape= in Python), e.g. h=64,w=64") from None
        # planned for the CPU that compiles: the file's most likely runner
        the_plan = plan(bound, planner, model=calibration.cost_model("cpu", torch.float32),
                        choose=calibration.chooser("cpu", torch.float32))
        programs.append(LayerCode(net, lower(the_plan), summary_line(the_plan)))
    return codegen.generate(programs, source)


def _with_options(net: Network, **overrides: Any) -> Network:
    """``net`` with some options replaced (None leaves an option as the spec says)."""
    values = {k: option_value(k, v) for k, v in overrides.items()
              if v is not None and k != "init_weights"}
    if "activation" in values:
        values["activation"], values["activation_param"] = values["activation"]
    if overrides.get("init_weights") is not None:
        values["init_weights"] = overrides["init_weights"]
    return replace(net, options=replace(net.options, **values)) if values else net


def layer(text: str, /, *, name: str | None = None, init: str | None = None,
          activation: str | float | None = None, bias: bool | None = None,
          distribution: str | None = None, stride_count: str | None = None,
          init_weights: Mapping[str, float] | None = None,
          dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          planner: str = "auto", autotune: bool | None = None,
          max_elements: int = DEFAULT_MAX_ELEMENTS, max_bytes: int = DEFAULT_MAX_BYTES,
          sizes: Mapping[str, int] | None = None, **more_sizes: int) -> "Layer":
    """An initialized ``nn.Module`` for ``text`` (an expression, or a ``.tn`` file's text with
    ``name`` picking the layer). ``sizes`` (a mapping, for index names that are keywords here)
    and keyword sizes bind or override the spec's sizes; these override
    its options: ``init`` (graph-in, graph-out, graph-avg, kaiming-in, kaiming-out, xavier,
    orthogonal, naive), ``activation`` (a name, ``"leaky_relu(0.1)"``, or the scale p_a),
    ``bias``, ``distribution`` (normal, uniform), ``stride_count`` ("exact": graph-out counts
    K/s taps on strided axes), ``init_weights`` (relative shares of a graph mode's product of
    variances, by core name). ``autotune``: the first call for each input shape times the
    candidate contraction orders and keeps the fastest, in the calibration cache (default: on
    where calibration is, see ``tnspec calibrate``; True or False forces it). ``max_elements``
    bounds each core (and the bias); ``max_bytes`` each tensor of the forward pass at the
    batch it is called with.

    >>> m = layer("x[b, i], W[i, o] -> y[b, o]", i=4, o=3)
    >>> m(torch.ones(2, 4)).shape
    torch.Size([2, 3])
    """
    net = compile(text, name=name, max_elements=max_elements, sizes=sizes, **more_sizes)
    weights = _init_weights(init_weights, net) if init_weights is not None else None
    net = _with_options(net, init=init, activation=activation, bias=bias,
                        distribution=distribution, stride_count=stride_count,
                        init_weights=weights)
    return Layer(net, dtype=dtype, device=device, planner=planner, autotune=autotune,
                 max_bytes=max_bytes)


def _init_weights(given: Any, net: Network) -> tuple[tuple[str, float], ...]:
    """``init_weights`` checked: a mapping from core names to positive numbers."""
    names = [c.name for c in net.cores]
    hint = f"a dict from core names ({', '.join(names)}) to positive shares"
    if not isinstance(given, Mapping):
        raise SpecError(f"init_weights must be a dict, not {type(given).__name__}", hint=hint)
    out = []
    for k, v in given.items():
        if k not in names:
            raise SpecError(f"init_weights names {k!r}, which is not a core", hint=hint)
        try:
            share = float(v)
        except (TypeError, ValueError):
            share = math.nan
        if isinstance(v, bool) or not (0 < share < math.inf):
            raise SpecError(f"init_weights[{k!r}] = {v!r} is not a positive number", hint=hint)
        out.append((k, share))
    return tuple(out)


def contract(spec: str | Network, x: torch.Tensor, /, cores: Mapping[str, torch.Tensor] |
             None = None, *, planner: str = "auto", sizes: Mapping[str, int] | None = None,
             **more_sizes: int) -> torch.Tensor:
    """Contract the network ``spec`` (an expression, or a :class:`Network` such as
    ``tnspec.backward(layer.network, x.shape)``) with the data ``x`` and the given ``cores``
    (core name -> tensor): the functional form of :func:`layer`, as ``F.conv2d`` is to
    ``nn.Conv2d``. Planned, lowered and run as a layer's forward is. A ``"bias"`` entry is
    added as the layer adds its bias (and ignored by networks without one, such as backward
    networks), so ``cores=dict(layer.named_parameters())`` works. Core sizes are read from the
    tensors unless given.

    >>> W = torch.ones(4, 3)
    >>> contract("x[b, i], W[i, o] -> y[b, o]", torch.ones(2, 4), {"W": W}).tolist()
    [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"contract takes a torch.Tensor, not {type(x).__name__}; convert it "
                        "with torch.as_tensor(x)")
    cores = dict(cores or {})
    for name, value in cores.items():
        if not (isinstance(value, torch.Tensor) or (name == "bias" and value is None)):
            raise TypeError(f"contract: cores[{name!r}] is a {type(value).__name__}, not a "
                            "torch.Tensor; convert it with torch.as_tensor")
    bias = cores.pop("bias", None)
    if isinstance(spec, Network):
        safe.network(spec)  # public dataclasses: a Network may be built by hand
        net = spec
    else:
        given = _merge(sizes, more_sizes)
        net = compile(spec, sizes={**_sizes_from_cores(spec, cores, given), **given})
    missing = [c.name for c in net.cores if c.name not in cores]
    extra = sorted(set(cores) - {c.name for c in net.cores})
    if missing or extra:
        raise SpecError(f"cores= lacks {missing[0]!r}" if missing else
                        f"cores= has {extra[0]!r}, which is not a core of the network",
                        hint=f"give one tensor per core: {', '.join(c.name for c in net.cores)}")
    for core in net.cores:
        want = tuple(net.sizes[i] for i in core.indices)
        if tuple(cores[core.name].shape) != want:
            raise SpecError(f"core {core.name!r} has shape {list(cores[core.name].shape)}, but "
                            f"{core.name}[{', '.join(core.indices)}] is {list(want)}")
    cls = runtime.layer_class(net, plan(bind_shape(net, tuple(x.shape)), planner,
                                        itemsize=x.element_size(),
                                        model=calibration.cost_model(x.device, x.dtype),
                                        choose=calibration.chooser(x.device, x.dtype)))
    if bias is not None and not (net.options.bias and bias_shape(net)):
        bias = None  # e.g. a layer's bias, given with its cores to its backward network
    module = SimpleNamespace(sizes=net.sizes, bias=bias, **cores)
    return cls.forward(module, x)


def _sizes_from_cores(text: str, cores: Mapping[str, Any], given: Mapping[str, int]
                      ) -> dict[str, int]:
    """Sizes of core indices read off the core tensors' shapes (for an inline expression)."""
    doc = parse(text)
    if doc.is_file or len(doc.layers) != 1 or len(doc.layers[0].networks) != 1:
        return {}
    found: dict[str, int] = {}
    for op in doc.layers[0].networks[0].operands[1:]:
        tensor = cores.get(op.name)
        if tensor is None or len(tensor.shape) != len(op.indices):
            continue
        for ix, n in zip(op.indices, tensor.shape):
            if ix.kind == "name" and ix.names[0] not in given:
                if found.setdefault(ix.names[0], int(n)) != int(n):
                    raise SpecError(f"index {ix.names[0]!r} has size {found[ix.names[0]]} in "
                                    f"one core and {int(n)} in {op.name!r}", span=ix.span,
                                    source=text)
    return found
