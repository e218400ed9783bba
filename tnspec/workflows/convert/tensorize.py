"""``tnspec.tensorize``: replace the ``nn.Conv1d/2d/3d`` and linear layers (``nn.Linear``,
Hugging Face's ``Conv1D``) of an existing model by tensorial layers of a named format, either
freshly initialized for the activation that follows them (Graph-in by default) or fitted to the
trained weights they replace (``weights="fit"``). ``tnspec.merge``
(``tnspec.workflows.convert.merge``) is the way back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ...errors import SpecError
from ...progress import Progress, now
from ...fit import decompose
from ...nn import formats, layout
from ...nn.api import _with_options, compile
from ...nn.embedding import TiedHead, replacing
from ...nn.layout import LayoutChoice
from ...nn.module import Layer
from ..adapted import adapted_parts
from ..dense_layers import (check_forward, features, is_dense, is_linear, never_replaced,
                            weight_of)
from ..left_alone import read_directly, tied, tied_heads
from ..model_tree import Selector, selected, set_submodule
from ..stand_ins import TensorizedConv, TensorizedLinear
from . import threads as threads_
from .activations import following_activations
from .report import Candidate


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
    note: str = ""  # what else the report should say of this layer


@dataclass(frozen=True)
class Report:
    """What ``tensorize`` did: the layers replaced, those skipped (with why), the totals."""

    format: str
    replaced: tuple[Replacement, ...]
    skipped: tuple[tuple[str, str], ...]  # (name, why), in model order
    params_before: int
    params_after: int
    skipped_kinds: tuple[str, ...] = ()  # the module type of each skipped layer
    other: tuple[tuple[str, int, str], ...] = ()  # (kind, count, why) of those never replaced
    layout: LayoutChoice | None = None  # memory_format=: what the model was left in, and why
    threads: str = ""  # torch's threads for the fits where tensorize changed them, and why

    def __str__(self) -> str:
        lines = [f"tensorize: {len(self.replaced)} layer(s) to {self.format}, "
                 f"{len(self.skipped)} skipped; model parameters {self.params_before:,} -> "
                 f"{self.params_after:,} ({_ratio(self.params_before, self.params_after)})"]
        if self.layout is not None:
            lines.append(f"  {self.layout}")
        if self.threads:
            lines.append(f"  fitted on {self.threads}")
        for r in self.replaced:
            lines.append(f"  {r.name}: {r.before}")
            how = (f"init for {r.activation} ({r.activation_from})" if r.fit_error is None
                   else f"fitted to its weights, relative error {r.fit_error:.4f}")
            lines.append(f"      {r.params_before:,} -> {r.params_after:,} params, "
                         f"{r.note if r.activation_from == 'tied' else how}")
            if r.note and r.activation_from != "tied":
                lines.append(f"      {r.note}")
        groups: dict[tuple[str, str], list[str]] = {}
        for (name, why), kind in zip(self.skipped,
                                     self.skipped_kinds or ("layer",) * len(self.skipped)):
            groups.setdefault((kind, why), []).append(name)
        for (kind, why), names in groups.items():  # one line per kind and reason
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  skipped {len(names)} x {kind} ({shown}): {why}")
        for kind, n, why in self.other:
            lines.append(f"  left alone {n} x {kind}: {why}")
        return "\n".join(lines)


def tensorize(model: nn.Module, format: str = "tucker2", *, rank: int | float = 0.5,
              include: Selector = None, exclude: Selector = None, init: str = "graph-in",
              activation: str | float | None = None, weights: str = "init",
              error: float | None = None, fit: Mapping[str, Any] | None = None,
              memory_format: str | torch.memory_format | None = None,
              example: torch.Tensor | Sequence[int] | None = None,
              threads: int | str | None = "auto", **options: Any) -> tuple[nn.Module, Report]:
    """Replace, in place, every ``nn.Conv1d/2d/3d`` and linear layer (``nn.Linear``, Hugging
    Face's ``Conv1D``) of ``model`` selected by
    ``include``/``exclude`` (glob patterns on qualified names such as ``"features.*"``, or a
    function of ``(name, module)``) by a tnspec layer of ``format`` (a name of
    :data:`tnspec.formats.NAMES`) with the same stride, padding, dilation, groups and bias.
    ``rank`` is an int or a share of each dense layer's parameters; ``options`` go to
    :func:`tnspec.formats.build` (``phi``, ``in_modes``, ...; ``rank_multiple=16`` rounds each
    share's rank down to a multiple of 16, which CPU convolutions run faster). Each layer is
    initialized with ``init`` for the activation that follows it in the model (read from
    ``torch.fx`` or the order of an ``nn.Sequential``) unless ``activation`` is given. Layers
    that cannot be expressed (reflect padding, asymmetric 'same' padding, a rank too small) are
    skipped and listed in the report. Returns ``(model, report)``.

    ``weights="fit"`` fits each new layer to the weight of the layer it replaces
    (:meth:`Layer.fit_`) and copies the bias; the report gives each fit's relative error.
    ``fit`` passes options to each fit: ``max_iter``, ``tol``, ``starts``, ``hops`` and
    ``max_seconds`` (per fit; 60 by default), e.g. ``fit={"hops": 0, "max_seconds": 30}``. With
    ``error=`` (0.1: 10%) the rank is chosen per layer instead of ``rank``: the smallest share of
    the dense layer's parameters, found by bisection, whose fit reaches that error. A layer
    whose goal is reached only with as many parameters as the dense one, or not at all, stays
    dense, and the report says so. ``threads`` (with ``weights="fit"``): torch's intra-op
    threads for the fits, as :func:`tnspec.compress` takes it ("auto": the CPUs other
    processes leave free; a number; None: torch's as it is), put back after. An error or
    Ctrl-C part way (in a fit, say) puts every layer it replaced back: the model is as it was.

    A language model's head tied to its token embedding (an ``nn.Linear`` holding the
    ``nn.Embedding``'s weight), both selected, stays tied: the embedding becomes a tensorized
    table and the head a :class:`~tnspec.nn.embedding.TiedHead` reading the same cores.
    Other tied layers are left alone, and the report says so.

    ``memory_format`` lays out the whole model when it is done: ``torch.channels_last`` (or
    ``channels_last_3d``, ``contiguous_format``) converts every 4-D (5-D) parameter and buffer;
    ``"auto"`` times a training step on ``example`` (an input batch or its shape) as the model
    is and channels-last end to end, and converts only where channels-last is clearly faster
    (:mod:`tnspec.nn.layout`). The report says which, with the timings.

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
    threads_.check(threads)
    if weights not in ("init", "fit"):
        raise SpecError(f"weights={weights!r}", hint='"init" (a fresh init) or "fit" (fitted '
                        "to the trained weights)")
    if error is not None and (weights != "fit" or not 0 < error < 1):
        raise SpecError(f"error={error!r} needs weights='fit' and a relative error in (0, 1)")
    fit_options = _fit_options(fit, weights)
    layout_asked = layout.resolve(memory_format, example)
    unknown = sorted(set(options) - set(_FORMAT_OPTIONS))
    if unknown:
        where = "fit options go in fit={...}" if unknown[0] in _FIT_OPTIONS else \
            "a format's options are " + ", ".join(_FORMAT_OPTIONS)
        raise TypeError(f"tensorize() got an unexpected keyword argument {unknown[0]!r}; "
                        f"{where}")
    if error is None:  # else each layer's share is chosen by its fit
        formats.check_rank(rank)
        formats.check_rank_multiple(rank, options.get("rank_multiple", 1))
    if layout_asked == "auto":  # checked before any layer is replaced
        layout.check_example(model, example)
    before = sum(p.numel() for p in model.parameters())
    following = following_activations(model)
    # {layer name: why}
    left_alone = {**read_directly(model), **tied(model), **adapted_parts(model)}
    # a head tied to its token embedding, both selected: the head reads the new table
    heads = {h: e for h, e in tied_heads(model).items()
             if all(selected(n, model.get_submodule(n), include, exclude) for n in (h, e))}
    for name in (*heads, *heads.values()):
        left_alone.pop(name, None)
    replaced, skipped, kinds = [], [], []
    other = never_replaced(model, embeddings=True)
    progress = Progress("tensorize")  # a line per layer where a person watches
    torch_threads = torch.get_num_threads()
    originals: dict[str, nn.Module] = {}  # what each replaced name held, put back on an error

    def put(name: str, new: nn.Module) -> None:
        originals.setdefault(name, model.get_submodule(name))
        set_submodule(model, name, new)
    try:
        # fits are many small linear-algebra calls: beside other jobs, on the cores they leave
        on_threads = threads_.use(threads if weights == "fit" else None, model)
        if on_threads:
            progress.line(f"fits run on {on_threads}")
        for name, module in list(model.named_modules()):
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and \
                    selected(name, module, include, exclude):
                try:
                    if name in left_alone:
                        raise SpecError(left_alone[name])
                    new, fit_error = replacing(module, format, rank, weights, error, fit_options)
                except SpecError as exc:
                    skipped.append((name, exc.message))
                    kinds.append(type(module).__name__)
                    continue
                put(name, new)
                replaced.append(Replacement(name, repr(module), new.spec if isinstance(new, Layer)
                                            else new.rows.spec,
                                            module.weight.numel(),
                                            sum(p.numel() for p in new.parameters()), "linear",
                                            "an embedding", fit_error, error))
                continue
            if not is_dense(module) or isinstance(module, Layer):
                continue
            if not selected(name, module, include, exclude) or name in heads:
                continue
            act, source = (activation, "given") if activation is not None else \
                following.get(name, ("linear", "no activation found after it"))
            try:
                if name in left_alone:
                    raise SpecError(left_alone[name])
                original, read = module, check_forward(module)
                module = read.layer
                fit_error = None
                if error is not None:
                    new, fit_error = _smallest(module, format, init, act, options, error,
                                               fit_options)
                else:
                    new = _replacement(module, format, rank, init, act, options)
                    if weights == "fit":
                        fit_error = _fitted(new, module, fit_options)
            except SpecError as exc:
                skipped.append((name, exc.message))
                kinds.append(type(module).__name__)
                progress.line(f"{name}: skipped ({exc.message})")
                continue
            note = ""
            if weights == "fit" and not weight_of(module).detach().any():
                note = (f"the weight is all zero: cores at their Graph-in scale with "
                        f"{decompose.output_core(new.network)} zeroed, so that it still trains")
            _keep_state(original, new)
            put(name, read.around(new))
            note = "; ".join(filter(None, [note, read.note(original, "as")]))
            replaced.append(Replacement(name, repr(module), new.spec,
                                        sum(p.numel() for p in module.parameters()),
                                        sum(p.numel() for p in new.parameters()), str(act), source,
                                        fit_error, error, note))
            progress.line(f"{name}: {type(module).__name__} -> {format}"
                          + ("" if fit_error is None else f", fit error {fit_error:.4f}")
                          + f" ({now() - progress.start:.0f} s so far)")
        for head, table in heads.items():
            _tie(model, head, table, replaced, skipped, kinds, put)
        torch.set_num_threads(torch_threads)  # the layout is timed on torch's own count
        after = sum(p.numel() for p in model.parameters())
        chosen = layout.apply(model, layout_asked, example)
    except BaseException:  # an error or Ctrl-C: the model as it was
        for name, module in reversed(originals.items()):
            set_submodule(model, name, module)
        raise
    finally:
        torch.set_num_threads(torch_threads)
    return model, Report(format, tuple(replaced), tuple(skipped), before, after, tuple(kinds),
                         other, chosen, on_threads)


def _tie(model: nn.Module, head: str, table: str, replaced: list, skipped: list,
         kinds: list, put: Callable[[str, nn.Module], None]) -> None:
    """The tied ``head`` reads the tensorized embedding ``table`` replaced (a
    :class:`TiedHead`), so that the two stay one; where the embedding stayed, so does it."""
    old, new = model.get_submodule(head), model.get_submodule(table)
    if not isinstance(new, Layer):
        skipped.append((head, f"tied to {table!r}, which stays as it is"))
        kinds.append(type(old).__name__)
        return
    put(head, TiedHead(new, old.bias))
    replaced.append(Replacement(head, repr(old), new.spec, old.weight.numel() + (
        0 if old.bias is None else old.bias.numel()), 0 if old.bias is None else
        old.bias.numel(), "linear", "tied", note=f"reads the table of {table!r} (tied)"))


def _ratio(before: int, after: int) -> str:
    """``"4.2x fewer"``, ``"1.3x more"`` or ``"unchanged"``."""
    if before == after:
        return "unchanged"
    if after < before:
        return f"{before / max(after, 1):.1f}x fewer"
    return f"{after / max(before, 1):.1f}x more"


def _keep_state(old: nn.Module, new: nn.Module) -> None:
    """Carry train/eval mode and frozen parameters over to the module replacing ``old``."""
    new.train(old.training)
    for name, p in new.named_parameters():
        p.requires_grad_((old.bias if name == "bias" else old.weight).requires_grad)


def _replacement(module: nn.Module, format: str, rank: int | float, init: str,
                 activation: str | float, options: dict[str, Any]) -> Layer:
    """The tnspec layer for one dense layer; SpecError says why it cannot be."""
    weight = module.weight
    if is_linear(module):
        fmt = formats.build(format, *features(module), (), rank=rank, **options)
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


_FORMAT_OPTIONS = ("in_modes", "out_modes", "phi", "blocks", "rank_multiple")  # build's
_FIT_OPTIONS = ("max_iter", "tol", "starts", "hops", "max_seconds")  # Layer.fit_'s


def _fit_options(fit: Any, weights: str) -> dict[str, Any]:
    """``fit=`` checked: a mapping of :meth:`Layer.fit_`'s options, with ``weights="fit"``."""
    if fit is None:
        return {}
    if weights != "fit":
        raise SpecError("fit= needs weights='fit'", hint="fit= sets how each layer is fitted "
                        "to its trained weights")
    if not isinstance(fit, Mapping):
        raise TypeError(f"tensorize(fit=...) takes a dict of fit options, not "
                        f"{type(fit).__name__}")
    unknown = sorted(set(fit) - set(_FIT_OPTIONS))
    if unknown:
        raise TypeError(f"tensorize(fit=...) got an unexpected fit option {unknown[0]!r}; "
                        f"the options are {', '.join(_FIT_OPTIONS)}")
    decompose.check_options(**fit)
    return dict(fit)


def _fitted(new: Layer, module: nn.Module, fit: Mapping[str, Any]) -> float:
    """Fit ``new`` to the dense ``module``'s weight, copy its bias; the relative error."""
    err = new.fit_(weight_of(module).detach(), **fit)
    if module.bias is not None:
        with torch.no_grad():
            new.bias.copy_(module.bias.reshape(new.bias.shape))
    return err


def _smallest(module: nn.Module, format: str, init: str, activation: str | float,
              options: dict[str, Any], error: float, fit: Mapping[str, Any],
              steps: int = 6) -> tuple[Layer, float]:
    """The fitted layer of the smallest rank share (bisection on (0, 1]) reaching ``error``;
    SpecError (the layer stays dense) where none does with fewer parameters than the dense
    layer."""
    best = _replacement(module, format, 1.0, init, activation, options)
    best_error = _fitted(best, module, fit)
    if best_error > error:
        raise SpecError(f"kept dense: the goal error={error:g} is not reached even at the full "
                        f"share (relative error {best_error:.4f} there)")
    low, high = 0.0, 1.0
    for _ in range(steps):
        share = (low + high) / 2
        try:
            new = _replacement(module, format, share, init, activation, options)
        except SpecError:  # no rank fits that share
            low = share
            continue
        new_error = _fitted(new, module, fit)
        if new_error <= error:
            best, best_error, high = new, new_error, share
        else:
            low = share
    dense = sum(p.numel() for p in module.parameters())
    if sum(p.numel() for p in best.parameters()) >= dense:
        raise SpecError(f"kept dense: the goal error={error:g} needs "
                        f"{sum(p.numel() for p in best.parameters()):,} parameters, not fewer "
                        f"than the dense layer's {dense:,}")
    return best, best_error


def fitted(module: nn.Module, new: Layer, fmt: str, share: float, metric: torch.Tensor | None,
           options: Mapping[str, Any]) -> Candidate:
    """``new`` fitted to ``module`` (its bias copied, its flags kept) as ``compress``'s
    candidate."""
    error = new._fit(weight_of(module).detach(), metric, **options)
    if module.bias is not None:
        with torch.no_grad():
            new.bias.copy_(module.bias.reshape(new.bias.shape))
    _keep_state(module, new)  # frozen stays frozen, and is timed so
    return Candidate(fmt, share, sum(p.numel() for p in new.parameters()), error)
