"""``tnspec.tensorize``: replace the ``nn.Conv1d/2d/3d`` and ``nn.Linear`` layers of an existing
model by tensorial layers of a named format, either freshly initialized for the activation that
follows them (Graph-in by default) or fitted to the trained weights they replace
(``weights="fit"``); and ``tnspec.merge``, the way back to dense layers for deployment.
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import formats
from .api import _with_options, compile
from .errors import SpecError
from .module import Layer
from .shapes import geometry

Selector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
                 nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_MODULE_ACTIVATIONS = {nn.ReLU: "relu", nn.ReLU6: "relu", nn.Tanh: "tanh", nn.GELU: "gelu",
                       nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
_FUNCTION_ACTIVATIONS = {torch.relu: "relu", torch.nn.functional.relu: "relu",
                         torch.tanh: "tanh", torch.nn.functional.tanh: "tanh",
                         torch.nn.functional.gelu: "gelu", torch.nn.functional.silu: "silu",
                         torch.sigmoid: "sigmoid", torch.nn.functional.sigmoid: "sigmoid",
                         "relu": "relu", "relu_": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}


class TensorizedLinear(Layer):
    """A tnspec layer standing in for ``nn.Linear``: any number of leading dimensions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class TensorizedConv(Layer):
    """A tnspec layer standing in for ``nn.ConvNd`` (batched or unbatched input, as every
    conv-like layer)."""


@dataclass(frozen=True)
class Replacement:
    """One replaced layer: its name, what it was, its format, and the parameter counts."""

    name: str
    before: str
    spec: str
    params_before: int
    params_after: int
    activation: str
    activation_from: str
    fit_error: float | None = None  # relative error of the fitted weight (weights="fit")
    error_goal: float | None = None  # the error= asked for


@dataclass(frozen=True)
class Report:
    """What ``tensorize`` did: the layers replaced, those skipped (with why), the totals."""

    format: str
    replaced: tuple[Replacement, ...]
    skipped: tuple[tuple[str, str], ...]  # (name, why), in model order
    params_before: int
    params_after: int
    skipped_kinds: tuple[str, ...] = ()  # the module type of each skipped layer
    other: tuple[tuple[str, int], ...] = ()  # kinds with parameters tensorize never replaces

    def __str__(self) -> str:
        lines = [f"tensorize: {len(self.replaced)} layer(s) to {self.format}, "
                 f"{len(self.skipped)} skipped; model parameters {self.params_before:,} -> "
                 f"{self.params_after:,} ({self.params_before / max(self.params_after, 1):.1f}x "
                 "fewer)"]
        for r in self.replaced:
            lines.append(f"  {r.name}: {r.before}")
            how = (f"init for {r.activation} ({r.activation_from})" if r.fit_error is None
                   else f"fitted to its weights, relative error {r.fit_error:.4f}")
            if r.error_goal is not None and r.fit_error is not None and \
                    r.fit_error > r.error_goal:
                how += f" (the goal {r.error_goal:g} is not reached even at the full share)"
            lines.append(f"      {r.params_before:,} -> {r.params_after:,} params, {how}")
        groups: dict[tuple[str, str], list[str]] = {}
        for (name, why), kind in zip(self.skipped,
                                     self.skipped_kinds or ("layer",) * len(self.skipped)):
            groups.setdefault((kind, why), []).append(name)
        for (kind, why), names in groups.items():  # one line per kind and reason
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  skipped {len(names)} x {kind} ({shown}): {why}")
        if self.other:
            lines.append("  not a kind tensorize replaces: " +
                         ", ".join(f"{n} x {kind}" for kind, n in self.other))
        return "\n".join(lines)


def tensorize(model: nn.Module, format: str = "tucker2", *, rank: int | float = 0.5,
              include: Selector = None, exclude: Selector = None, init: str = "graph-in",
              activation: str | float | None = None, weights: str = "init",
              error: float | None = None, **options: Any) -> tuple[nn.Module, Report]:
    """Replace, in place, every ``nn.Conv1d/2d/3d`` and ``nn.Linear`` of ``model`` selected by
    ``include``/``exclude`` (glob patterns on qualified names such as ``"features.*"``, or a
    function of ``(name, module)``) by a tnspec layer of ``format`` (a name of
    :data:`tnspec.formats.NAMES`) with the same stride, padding, dilation, groups and bias.
    ``rank`` is an int or a share of each dense layer's parameters; ``options`` go to
    :func:`tnspec.formats.build` (``phi``, ``in_modes``, ...). Each layer is initialized with
    ``init`` for the activation that follows it in the model (read from ``torch.fx`` or the
    order of an ``nn.Sequential``) unless ``activation`` is given. Layers that cannot be
    expressed (reflect padding, asymmetric 'same' padding, a rank too small) are skipped and
    listed in the report. Returns ``(model, report)``.

    ``weights="fit"`` fits each new layer to the weight of the layer it replaces
    (:meth:`Layer.fit_`) and copies the bias; the report gives each fit's relative error. With
    ``error=`` (0.1: 10%) the rank is chosen per layer instead of ``rank``: the smallest share of
    the dense layer's parameters, found by bisection, whose fit reaches that error (or the
    whole share, 1.0, if none does; the report shows the error reached).

    >>> net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
    ...                     nn.Linear(32 * 8 * 8, 10))
    >>> net, report = tensorize(net, "cp", rank=8, include="0")
    >>> print(report)
    tensorize: 1 layer(s) to cp, 0 skipped; model parameters 25,130 -> 20,954 (1.2x fewer)
      0: Conv2d(16, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
          4,640 -> 464 params, init for relu (read from the model)
    """
    if format not in formats.NAMES:
        raise SpecError(f"unknown format {format!r}",
                        hint=f"choose one of {', '.join(formats.NAMES)}")
    if weights not in ("init", "fit"):
        raise SpecError(f"weights={weights!r}", hint='"init" (a fresh init) or "fit" (fitted '
                        "to the trained weights)")
    if error is not None and (weights != "fit" or not 0 < error < 1):
        raise SpecError(f"error={error!r} needs weights='fit' and a relative error in (0, 1)")
    before = sum(p.numel() for p in model.parameters())
    following = _following_activations(model)
    tied = _tied(model)
    replaced, skipped, kinds = [], [], []
    other: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, *_CONVS)) or isinstance(module, Layer):
            if not isinstance(module, Layer) and \
                    next(module.parameters(recurse=False), None) is not None:
                other[type(module).__name__] = other.get(type(module).__name__, 0) + 1
            continue
        if not _selected(name, module, include, exclude):
            continue
        act, source = (activation, "given") if activation is not None else \
            following.get(name, ("linear", "no activation found after it"))
        try:
            if name in tied:
                raise SpecError(tied[name])
            fit_error = None
            if error is not None:
                new, fit_error = _smallest(module, format, init, act, options, error)
            else:
                new = _replacement(module, format, rank, init, act, options)
                if weights == "fit":
                    fit_error = _fitted(new, module)
        except SpecError as exc:
            skipped.append((name, exc.message))
            kinds.append(type(module).__name__)
            continue
        _set_submodule(model, name, new)
        replaced.append(Replacement(name, repr(module), new.spec,
                                    sum(p.numel() for p in module.parameters()),
                                    sum(p.numel() for p in new.parameters()), str(act), source,
                                    fit_error, error))
    after = sum(p.numel() for p in model.parameters())
    return model, Report(format, tuple(replaced), tuple(skipped), before, after, tuple(kinds),
                         tuple(sorted(other.items())))


def _tied(model: nn.Module) -> dict[str, str]:
    """``{layer name: why}`` for the modules whose parameters are shared with another module,
    or that are registered under two names: replacing one would untie them."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    tied: dict[str, str] = {}
    for names in owners.values():
        unique = list(dict.fromkeys(names))
        for name in unique:
            others = [n for n in unique if n != name]
            if others:
                tied[name] = (f"its parameters are shared with {others[0]!r} (tied weights); "
                              "left alone so that they stay tied")
    return tied


def _replacement(module: nn.Module, format: str, rank: int | float, init: str,
                 activation: str | float, options: dict[str, Any]) -> Layer:
    """The tnspec layer for one dense layer; SpecError says why it cannot be."""
    weight = module.weight
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        raise SpecError("nn.MultiheadAttention reads this layer's weight directly")
    if isinstance(module, nn.Linear):
        fmt = formats.build(format, module.in_features, module.out_features, (), rank=rank,
                            **options)
        cls: type[Layer] = TensorizedLinear
    else:
        if module.padding_mode != "zeros":
            raise SpecError(f"padding_mode={module.padding_mode!r}: tnspec pads with zeros")
        padding = module.padding
        if padding == "valid":
            padding = 0
        elif padding == "same":
            total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
            if any(t % 2 for t in total):
                raise SpecError("padding='same' with an even dilated kernel pads one side "
                                "more; tnspec pads both sides equally")
            padding = tuple(t // 2 for t in total)
        if module.groups == module.in_channels > 1 and format != "standard":
            raise SpecError("a depthwise conv (groups = in_channels) has nothing to factorize")
        fmt = formats.build(format, module.in_channels, module.out_channels,
                            tuple(module.kernel_size), rank=rank, stride=tuple(module.stride),
                            padding=padding, dilation=tuple(module.dilation),
                            groups=module.groups, **options)
        cls = TensorizedConv
    net = _with_options(compile(fmt.spec, sizes=fmt.sizes), init=init, activation=activation,
                        bias=module.bias is not None)
    return cls(net, dtype=weight.dtype, device=weight.device)


def _fitted(new: Layer, module: nn.Module) -> float:
    """Fit ``new`` to the dense ``module``'s weight, copy its bias; the relative error."""
    err = new.fit_(module.weight.detach())
    if module.bias is not None:
        with torch.no_grad():
            new.bias.copy_(module.bias.reshape(new.bias.shape))
    return err


def _smallest(module: nn.Module, format: str, init: str, activation: str | float,
              options: dict[str, Any], error: float, steps: int = 6) -> tuple[Layer, float]:
    """The fitted layer of the smallest rank share (bisection on (0, 1]) reaching ``error``."""
    best = _replacement(module, format, 1.0, init, activation, options)
    best_error = _fitted(best, module)
    low, high = 0.0, 1.0
    for _ in range(steps if best_error <= error else 0):
        share = (low + high) / 2
        try:
            new = _replacement(module, format, share, init, activation, options)
        except SpecError:  # no rank fits that share
            low = share
            continue
        new_error = _fitted(new, module)
        if new_error <= error:
            best, best_error, high = new, new_error, share
        else:
            low = share
    return best, best_error


def merge(model: nn.Module) -> nn.Module:
    """Replace, in place, every conv-like or linear-like tnspec layer of ``model`` by the dense
    ``nn.Conv1d/2d/3d`` or ``nn.Linear`` with its :meth:`~Layer.dense_weight` and bias (same
    stride, padding, dilation, groups, dtype and device): for deployment where dense is
    faster. Returns the model; a tnspec layer given as the model itself returns its dense
    module. Layers of other networks stay, with a warning naming them.

    >>> layer = formats.cp(16, 32, 3, rank=8, padding=1).layer()
    >>> merge(layer)
    Conv2d(16, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    """
    kept = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Layer):
            continue
        if geometry(module.network) is None:
            kept.append(name or "the model")
            continue
        dense = _dense(module)
        if not name:
            return dense
        _set_submodule(model, name, dense)
    if kept:
        warnings.warn(f"merge kept {len(kept)} tnspec layer(s) that are neither conv-like nor "
                      f"linear-like: {', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''}",
                      stacklevel=2)
    return model


def _dense(layer: Layer) -> nn.Module:
    """The ``nn.ConvNd`` or ``nn.Linear`` computing what a conv/linear-like ``layer`` does."""
    weight = layer.dense_weight().detach()
    kind = dict(dtype=weight.dtype, device=weight.device, bias=layer.bias is not None)
    if weight.dim() == 2:
        dense: nn.Module = nn.Linear(layer.in_features, layer.out_features, **kind)
    else:
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[weight.dim() - 3]
        dense = conv(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                     layer.padding, layer.dilation, layer.groups, **kind)
    with torch.no_grad():
        dense.weight.copy_(weight)
        if layer.bias is not None:
            dense.bias.copy_(layer.bias.reshape(-1))
    return dense


def _selected(name: str, module: nn.Module, include: Selector, exclude: Selector) -> bool:
    def matches(selector: Selector) -> bool:
        if callable(selector):
            return bool(selector(name, module))
        patterns = [selector] if isinstance(selector, str) else list(selector or ())
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)
    return (include is None or matches(include)) and not (exclude is not None and
                                                          matches(exclude))


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _following_activations(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{layer name: (activation, how it was found)}`` for the layers followed by one."""
    found: dict[str, tuple[str, str]] = {}
    for seq_name, seq in model.named_modules():  # nn.Sequential order first...
        if isinstance(seq, nn.Sequential):
            children = list(seq.named_children())
            for i, (child, module) in enumerate(children):
                nxt = [m for _, m in children[i + 1:]]
                while nxt and isinstance(nxt[0], _PASS_THROUGH):
                    nxt.pop(0)
                act = _module_activation(nxt[0]) if nxt else None
                if act:
                    found[f"{seq_name}.{child}" if seq_name else child] = \
                        (act, "read from the model")
    try:  # ...then what forward() does, where torch.fx can trace it
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - untraceable models keep the Sequential reading
        return found
    modules = dict(model.named_modules())
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target),
                                                      (nn.Linear, *_CONVS)):
            continue
        user = node
        for _ in range(4):
            if len(user.users) != 1:
                break
            user = next(iter(user.users))
            act = _node_activation(user, modules)
            if act:
                found[node.target] = (act, "read from the model")
                break
            if not (user.op == "call_module" and isinstance(modules.get(user.target),
                                                            _PASS_THROUGH)):
                break
    return found


def _module_activation(module: nn.Module) -> str | None:
    if isinstance(module, nn.LeakyReLU):
        return f"leaky_relu({module.negative_slope})"
    return next((a for t, a in _MODULE_ACTIVATIONS.items() if isinstance(module, t)), None)


def _node_activation(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str | None:
    if node.op == "call_module":
        return _module_activation(modules[node.target])
    if node.op in ("call_function", "call_method"):
        if node.target is torch.nn.functional.leaky_relu:
            slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1
                                    else 0.01)
            return f"leaky_relu({slope})" if isinstance(slope, (int, float)) else None
        try:
            return _FUNCTION_ACTIVATIONS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None
