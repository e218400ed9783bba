"""``tnspec.adapt`` and ``tnspec.set_adapter``: tensor-network adapters for fine-tuning a
pretrained model. Each targeted ``nn.Linear`` / ``nn.Conv1d/2d/3d`` becomes an
:class:`Adapted` module: the original module (frozen, untouched) plus named tnspec layers of
the same geometry whose outputs are added.

The init rule (docs/adapters.md): the adapter's cores are drawn by Graph-in for the base
layer's output variance (read from its weight: ``||W||^2 / out`` for unit-variance inputs),
one of them (the output-side one by default) stored in units of its Graph-in std, the
adapter's output multiplied by that std and by ``sqrt(scale)``: an output variance of
``scale`` times the base layer's. By default (``init="offset"``) a
frozen copy of the adapter at init is subtracted, so that adapting changes no output and
every core learns from the first step, and ``scale`` is shared out over the adapted layers
(:func:`drawn_scale`); with ``init="zero"`` that one core starts at zero instead
(``adapter_layers`` builds one layer). ``adapter_state`` holds merging, saving and
switching.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from ...errors import SpecError
from ...nn import formats
from ...nn.module import Layer
from ..adapted import Adapted, Saved, frozen_copy, inside_adapted, set_adapter
from ..feeding import call, evaluated
from ..dense_layers import check_forward, is_dense, kind_names
from ..left_alone import read_directly
from ..model_tree import Selector, first_skipped, parameter_holders, selected, set_submodule
from .layers import INITS, AdapterPlan, Fmt, adapter_plan, drawn_layer
from . import step_rule as step_rule_

#: where every core is drawn, the output variance all of a model's adapters hold together, in
#: units of one base layer's: each of ``n`` adapted layers gets ``scale = min(1, 4 / n)``
DRAWN_TOTAL = 4.0


@dataclass(frozen=True)
class Adaptation:
    """One adapted layer: its name, the base module, the adapter's spec and parameters."""

    name: str
    base: str
    spec: str
    params: int  # the adapter's trainable parameters
    base_params: int  # the base layer's (weight and bias)
    zeroed: str
    note: str = ""
    init: str = "zero"

    @property
    def share(self) -> float:
        return self.params / max(self.base_params, 1)


@dataclass(frozen=True)
class AdaptReport:
    """What ``adapt`` did: the layers adapted, those skipped (with why), the totals."""

    adapter: str
    format: str
    adapted: tuple[Adaptation, ...]
    skipped: tuple[tuple[str, str], ...]
    trainable: int  # every trainable parameter of the model after adapt
    total: int  # every parameter of the model, adapters included
    saved: tuple[tuple[str, int], ...] = ()  # modules_to_save: (name, parameters)
    unreached: tuple[str, ...] = ()  # adapted layers a forward of ``sample`` never called
    scale: float = 1.0  # each adapter's output variance over its base layer's

    def __str__(self) -> str:
        lines = [f"adapt: {self.adapter!r} ({self.format}) on {len(self.adapted)} layer(s), "
                 f"{len(self.skipped)} skipped; {self.trainable:,} of {self.total:,} parameters "
                 f"train ({100 * self.trainable / max(self.total, 1):.2f}%)"
                 + ("" if self.scale == 1 else f"; scale {self.scale:.3g} each")]
        for a in self.adapted:
            lines.append(f"  {a.name}: {a.base}")
            lines.append(f"      {a.params:,} trainable ({100 * a.share:.2f}% of its "
                         f"{a.base_params:,}), " + (f"{a.zeroed} starts at zero"
                                                    if a.init == "zero" else
                                                    "less its frozen copy at init")
                         + (f"; {a.note}" if a.note else ""))
        for name, params in self.saved:
            lines.append(f"  {name}: trained in full ({params:,} parameters, saved with the "
                         "adapters)")
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        if self.unreached:
            lines.append(f"  never reached by the sample's forward (their adapters will not "
                         f"train): {', '.join(self.unreached)}")
        return "\n".join(lines)


def adapt(model: nn.Module, fmt: Fmt = "low_rank", *, rank: int | float | None = None,
          include: Selector = None, exclude: Selector = None, scale: float | None = None,
          name: str = "default", zero: str | None = None,
          sizes: Mapping[str, int] | None = None, modules_to_save: Selector = None,
          step_rule: str | None = None, init: str = "offset", sample: Any = None,
          **options: Any) -> tuple[nn.Module, AdaptReport]:
    """Add adapter ``name`` to every ``nn.Linear`` / ``nn.Conv1d/2d/3d`` of ``model`` selected by
    ``include``/``exclude`` (as :func:`tnspec.tensorize`), in place: each becomes an
    :class:`Adapted` module (or gets one more adapter), and every parameter of the model other
    than the new adapter's is frozen. The new adapter is the active one. Returns
    ``(model, report)``; a bare layer given as the model returns its ``Adapted`` module.

    ``fmt`` is a name of :data:`tnspec.formats.NAMES` (``low_rank`` is LoRA) with ``rank`` (an
    int, or a float: the adapter's share of the base layer's parameters; 8 by default) and
    ``options`` for :func:`tnspec.formats.build` (``in_modes``, ``phi``, ...); or a spec string
    whose channel and kernel sizes, where not in ``sizes``, are read from each layer (ranks
    go in ``sizes``); or a compiled :class:`Network` (from a ``.tn`` file) or a
    :class:`~tnspec.formats.Format`. Any stride, dilation, groups, padding (``"same"``
    included) and ``padding_mode`` work: the adapter runs on the input padded as the base pads
    it. Layers whose geometry a spec does not match are skipped, with why, in the report; a
    call that would adapt no layer (an unknown format, a rank that is no rank, a name every
    layer has already) raises a SpecError saying why, and leaves the model as it was.

    By default (``init="offset"``) every core is drawn by Graph-in and a frozen copy of the
    adapter as drawn is subtracted (``Adapted.offsets``): the model computes the base's
    output at init, bit for bit without autograd and to float rounding with it (a matmul may
    pick another kernel for a weight that requires grad), and every core gets a gradient from
    the first step (the copy costs one more forward of the adapter, no trainable parameter).
    The drawn adapter's output variance is ``scale`` times the base layer's, carried by its
    output's multiplier (the cores drawn as at ``scale=1``, so that a step moves the adapter
    by ``sqrt(scale)`` of what it moves at 1); without ``scale``, ``min(1, 4 / n)`` for ``n``
    adapted layers (:func:`drawn_scale`), so that many adapters together do not move the
    model faster than a few: at ``scale=1`` a transformer's 36 adapters each changed their
    layer's output by 12-37% in 10 steps and the model's embedding collapsed
    (docs/adapters.md, "The default start"). ``init="zero"`` starts the
    core ``zero`` (by default the output-side one) at zero instead, ``scale=1``: exact bit for
    bit in both modes, but only that core learns at first, and on a conv network four of
    five formats stayed near chance. ``init="principal"`` fits the cores to the base weight's
    principal part in the format (the truncated SVD for ``low_rank``: PiSSA's start, for any
    format) and subtracts a frozen copy likewise: the model computes ``W + A - A0``, which is
    PiSSA's ``(W - A0) + A`` with the base weight left as it is (nothing to restore when
    merging or saving; the copy is saved with the adapter). As in PiSSA the cores hold that
    part themselves (scaling 1), at equal norms.
    ``step_rule="spectral"`` holds the adapter's inner cores (those with two bonds or more) at
    their init spectral norm while they train, so that a chain's or ring's cores cannot
    align to grow the product by orders of magnitude (:mod:`~tnspec.workflows.adapters.step_rule`).

    ``modules_to_save`` (names, glob patterns or a function of ``(name, module)``, as
    ``include``; a name also matches at the end of a longer one, ``"classifier"`` matching
    ``"model.classifier"``, as PEFT's) are trained in full instead: each becomes a
    :class:`Saved` module holding the original and a trainable copy for this adapter, which
    ``adapter_state_dict`` saves and ``merge_adapters`` keeps. A new classification head is
    one. A layer that is tied to another (a language model's head and its token embedding)
    is left out, and the report says so.

    ``sample``: a batch the model takes (a tensor, a tuple of positional arguments or a dict
    of keyword arguments, as a tokenizer gives); the model runs it once before anything
    changes, in eval mode and without gradients, and the report names the adapted layers the
    forward never called
    (``unreached``: a ``pooler`` of a model whose pooled output the task does not use), whose
    adapters would not train.

    >>> net = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
    ...                     nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    >>> net, report = adapt(net, "tt", rank=4)
    >>> print(report)
    adapt: 'default' (tt) on 2 layer(s), 0 skipped; 1,092 of 13,026 parameters train (8.38%)
      0: Conv2d(4, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), padding_mode=reflect)
          196 trainable (33.11% of its 592), less its frozen copy at init
      3: Linear(in_features=1024, out_features=10, bias=True)
          896 trainable (8.74% of its 10,250), less its frozen copy at init
    """
    if scale is not None and not (isinstance(scale, (int, float)) and
                                  not isinstance(scale, bool) and scale > 0 and
                                  math.isfinite(scale)):
        raise SpecError(f"scale={scale!r} must be a positive number",
                        hint="the adapter's output variance as a share of the base layer's")
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(f"adapter name {name!r} must be a Python identifier",
                        hint='e.g. name="task_b"')
    if hasattr(nn.ModuleDict, name):  # the adapters are held in one
        raise SpecError(f"adapter name {name!r} is taken by nn.ModuleDict, which holds the "
                        "adapters", hint='e.g. name="task_b"')
    # arguments that would have every layer skipped are one error, before anything changes
    if isinstance(fmt, str) and fmt not in formats.NAMES and "[" not in fmt:
        raise SpecError(f"unknown format {fmt!r}", hint=f"choose one of "
                        f"{', '.join(formats.NAMES)} (LoRA is low_rank), or write a spec")
    if rank is not None:
        formats.check_rank(rank)
    step_rule_.check(step_rule)
    if init not in INITS:
        raise SpecError(f"unknown init {init!r}", hint=f"choose one of {', '.join(INITS)}")
    to_save = _to_save(model, modules_to_save, name)
    called = None if sample is None else _called(model, sample)
    adapted, skipped, wrapped = [], [], {}
    left_alone = read_directly(model)
    holders = parameter_holders(model)
    chosen = _chosen(model, include, exclude, to_save)
    # first what each layer would get, nothing drawn: the drawn scale counts the layers that
    # get an adapter, not those a small share or the format's geometry skips
    planned: list[tuple[str, nn.Module, Adapted | None, Any, AdapterPlan | None]] = []
    ready: set[int] = set()
    for path, module, owner in chosen:
        if id(module) in ready:  # one module under several names: one Adapted for all
            planned.append((path, module, owner, None, None))
            continue
        try:
            if path in left_alone:
                raise SpecError(left_alone[path])
            _check_untied(module, holders)
            if owner is not None and name in owner.adapters:
                raise SpecError(f"it has an adapter named {name!r} already",
                                hint="give another name=, or merge_adapters first")
            read = check_forward(module)
            plan = adapter_plan(read.layer, fmt, rank, zero, sizes, options)
        except SpecError as exc:
            skipped.append((path or type(module).__name__, exc.message))
            continue
        ready.add(id(module))
        planned.append((path, module, owner, read, plan))
    if scale is None:
        scale = drawn_scale(init, len(ready))
    # then every adapter drawn, the model untouched, so that an error while drawing (a fit
    # of the principal start, an interrupt) leaves the model as it was
    drawn = []
    for path, original, owner, read, plan in planned:
        if plan is None:
            drawn.append((path, original, owner, read, None))
            continue
        try:
            layer, scaling, pad, zeroed, note = drawn_layer(read.layer, plan, scale, init)
            step_rule_.bound(layer, step_rule, zeroed)
            offset = frozen_copy(layer) if init in ("offset", "principal") else None
        except SpecError as exc:
            skipped.append((path or type(original).__name__, exc.message))
            continue
        drawn.append((path, original, owner, read, (layer, scaling, pad, zeroed, note, offset)))
    root = None
    for path, original, owner, read, new in drawn:
        if new is None:
            if id(original) not in wrapped:  # its first name's adapter failed to draw
                continue
            owner = wrapped[id(original)][0]
            if path:
                set_submodule(model, path, owner)
            continue
        module, (layer, scaling, pad, zeroed, note, offset) = read.layer, new
        owner = owner or Adapted(read.base(original))
        owner.add(name, layer, scaling, pad, zeroed, offset)
        wrapped[id(original)] = (owner, path)
        if path:
            set_submodule(model, path, owner)
        else:
            root = owner
        note = "; ".join(filter(None, [note, read.note(original, "adapted as")]))
        own, theirs = (sum(p.numel() for p in m.parameters()) for m in (layer, module))
        if own > theirs:
            note = "; ".join(filter(None, [note, "more parameters than the layer it adapts: "
                                           "train the layer itself, or give a smaller rank"]))
        adapted.append(Adaptation(path, repr(module), layer.spec, own, theirs, zeroed, note,
                                  init))
    larger = [a.name or "the model" for a in adapted if a.params > a.base_params]
    if larger:
        warnings.warn(f"adapt: the adapter of {', '.join(larger[:4])}"
                      f"{', ...' if len(larger) > 4 else ''} has more parameters than the "
                      "layer it adapts (see the report)", stacklevel=2)
    if not adapted and not to_save:  # nothing changed: say why rather than "100% train"
        why = first_skipped(skipped) if skipped else \
            f"no {kind_names()} layer is selected"
        raise SpecError(f"adapt changed nothing: {why}",
                        hint="check the format, rank= and zero=, or include= and exclude=")
    result = root if root is not None else model
    for path, module in to_save:
        owner = module if isinstance(module, Saved) else Saved(module)
        owner.add(name)
        if owner is not module:
            set_submodule(result, path, owner)
    for p in result.parameters():  # as get_peft_model: the new adapter alone trains
        p.requires_grad_(False)
    set_adapter(result, name)
    unreached = () if called is None else \
        tuple(a.name for a in adapted if a.name and not called[a.name])
    params = list(result.parameters())
    return result, AdaptReport(name, fmt if isinstance(fmt, str) and fmt in formats.NAMES
                               else "spec", tuple(adapted), tuple(skipped),
                               sum(p.numel() for p in params if p.requires_grad),
                               sum(p.numel() for p in params),
                               tuple((path, sum(p.numel() for p in m.parameters()))
                                     for path, m in to_save), unreached, scale)


def drawn_scale(init: str, layers: int) -> float:
    """``adapt``'s ``scale`` where none is given: 1 for a zero core; where every core is drawn
    (``"offset"``, ``"principal"``), ``DRAWN_TOTAL / layers``, at most 1, so that the drawn
    adapters of a model together hold the output variance of ``DRAWN_TOTAL`` of its layers
    (docs/adapters.md, "The default start")."""
    return 1.0 if init == "zero" else min(1.0, DRAWN_TOTAL / max(layers, 1))


def _chosen(model: nn.Module, include: Selector, exclude: Selector,
            to_save: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, Any]]:
    """``(path, layer, its Adapted or None)`` for every layer ``include``/``exclude`` select,
    each name of a shared one: a dense layer, or the base of an :class:`Adapted` (an
    adapter's own layers and the modules trained in full aside)."""
    inside = inside_adapted(model)  # an adapter's own layers, a base: not adapted again
    found = []
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, Adapted):
            module, owner = module.base, module
        elif is_dense(module) and not isinstance(module, Layer) and \
                id(module) not in inside:
            owner = None
        else:
            continue
        if selected(path, module, include, exclude) and \
                not any(path == p or path.startswith(p + ".") for p, _ in to_save):
            found.append((path, module, owner))
    return found


def _called(model: nn.Module, sample: Any) -> dict[str, bool]:
    """Per module name: whether a forward of ``sample`` calls it (run on the model as given,
    before ``adapt`` changes anything, so that a sample the model does not take raises with
    the model untouched)."""
    seen: set[int] = set()
    modules = dict(model.named_modules(remove_duplicate=False))
    hooks = [m.register_forward_hook(lambda m, args, out: seen.add(id(m)))
             for m in set(modules.values())]
    try:
        with evaluated(model):
            call(model, sample, given="sample=")
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 (the model's own error, quoted)
        raise SpecError(f"sample= does not run through the model: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}",
                        hint="give a batch as the model takes it: a tensor, a tuple of "
                        "arguments or a dict of keyword arguments") from None
    finally:
        for hook in hooks:
            hook.remove()
    return {name: id(m) in seen for name, m in modules.items()}


def _to_save(model: nn.Module, selector: Selector, name: str) -> list[tuple[str, nn.Module]]:
    """The modules ``modules_to_save`` selects (the outermost of nested matches), checked:
    a SpecError where it selects none, or one the copy cannot be made of."""
    if selector is None:
        return []
    patterns = [selector] if isinstance(selector, str) else \
        None if callable(selector) else list(selector)

    def chosen(path: str, module: nn.Module) -> bool:  # PEFT's rule: a suffix matches too
        if patterns is None:
            return bool(selector(path, module))
        return any(selected(path, module, p, None) or path.endswith("." + p)
                   for p in patterns)
    inside = inside_adapted(model)
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(p + ".") for p, _ in found) or \
                not chosen(path, module):
            continue
        if id(module) in inside and not isinstance(module, Saved):
            raise SpecError(f"modules_to_save: {path!r} is inside the adapted module "
                            f"{inside[id(module)]!r}", hint="save the whole adapted module's "
                            "parent, or adapt that layer instead")
        if isinstance(module, Saved) and name in module.copies:
            raise SpecError(f"modules_to_save: {path!r} has a copy for adapter {name!r} "
                            "already", hint="give another name=, or merge_adapters first")
        found.append((path, module))
    if not found:
        raise SpecError(f"modules_to_save={selector!r} selects no module of the model",
                        hint="give module names as model.named_modules() lists them")
    return found


def _check_untied(module: nn.Module, holders: dict[int, list[tuple[str, nn.Module]]]) -> None:
    """SpecError where another module holds ``module``'s weight or bias (a language model's
    head tied to its token embedding): merging an adapter into it would rewrite the other
    module too, or untie them."""
    for p in module.parameters(recurse=False):
        others = [n for n, m in holders.get(id(p), []) if m is not module]
        if others:
            raise SpecError(f"its weight is tied to {others[0]!r}'s (shared weights): left "
                            "alone so that merge_adapters keeps the tie",
                            hint="exclude= it, or untie the weights before adapt")
