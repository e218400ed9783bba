"""What a model's tnspec adapters become after training: merged into the base weights
(``merge_adapters``), saved and loaded on their own (``adapter_state_dict`` and
``adapter_config``, ``load_adapters``), switched (``set_adapter``) or turned off for a while
(``disable_adapters``)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ...errors import SpecError
from ...shapes import geometry
from ...nn.api import _with_options, compile
from ..adapted import Adapted, Saved, adapted_modules, frozen_copy, parts, set_adapter
from ..dense_layers import check_forward, is_dense, is_linear, kind_names, stored, weight_of
from ..model_tree import parameter_holders, set_submodule
from ..padded import Padded
from ..stand_ins import TensorizedConv, TensorizedLinear
from .layers import INITS, _geometry_differs, _padding
from . import step_rule

FORMAT = "tnspec-adapters/2"  # the tag of adapter_config's layout
_NESTED = "tnspec-adapters/1"  # the nested dict adapter_state_dict returned before


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """A context in which ``model`` runs its base layers alone (as before ``adapt``)::

        with tnspec.disable_adapters(model):
            reference = model(x)
    """
    modules = [m for _, m in adapted_modules(model)]
    before = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m, flag in zip(modules, before):
            m.disabled = flag


def merge_adapters(model: nn.Module, name: str | Sequence[str] | None = None, *,
                   inplace: bool = False) -> nn.Module:
    """The model with adapter ``name`` (by default each layer's active one; a list sums
    several) folded into the base weights: every :class:`Adapted` module becomes a plain
    ``nn.Linear`` / ``nn.ConvNd`` of the base's geometry holding ``W + scaling * dW``,
    accumulated in float64 and cast back to the base's dtype. Other adapters are dropped.

    Works on a deep copy and leaves ``model`` as it was, unless ``inplace=True`` (the base
    weights are then overwritten). The merged parameters keep their flags (frozen by
    ``adapt``: call ``requires_grad_()`` to train them)."""
    if name is not None:
        wanted = [name] if isinstance(name, str) else list(name)
        present = {k for _, m in adapted_modules(model) for k in parts(m)}
        missing = [n for n in wanted if n not in present]
        if missing:
            raise SpecError(f"no layer has an adapter named {missing[0]!r}",
                            hint=f"the adapters are {', '.join(sorted(present)) or 'none'}")
        for path, module in adapted_modules(model):
            both = [n for n in wanted if isinstance(module, Saved) and n in module.copies]
            if len(both) > 1:
                raise SpecError(f"adapters {both[0]!r} and {both[1]!r} each train their own "
                                f"copy of {path!r} (modules_to_save): merged, it can be only "
                                "one", hint="merge one of them")
    target = model if inplace else copy.deepcopy(model)
    holders = parameter_holders(target)
    merged: dict[int, nn.Module] = {}
    for path, module in list(target.named_modules(remove_duplicate=False)):
        if not isinstance(module, (Adapted, Saved)):
            continue
        if id(module) not in merged:
            names = ([module.active] if module.active and not module.disabled else []) \
                if name is None else [n for n in wanted if n in parts(module)]
            if isinstance(module, Saved):  # the copy trained in full stands in for it
                merged[id(module)] = module.copies[names[0]] if names else module.original
            else:
                merged[id(module)] = module.base
                if names:  # written into the plain conv the base computes
                    read = check_forward(module.base)
                    base = read.layer
                    weight = weight_of(base).detach().double()
                    for n in names:
                        weight = weight + module.delta_weight(n).to(weight.device)
                    _write_weight(base, stored(base, weight).to(base.weight.dtype), path,
                                  holders, module.base)
                    if not isinstance(module.base, Padded):
                        merged[id(module)] = read.around(base)
        if not path:
            return merged[id(module)]
        set_submodule(target, path, merged[id(module)])
    return target


def _write_weight(base: nn.Module, value: torch.Tensor, path: str,
                  holders: dict[int, list[tuple[str, nn.Module]]], merged: nn.Module) -> None:
    """Set ``base``'s weight to ``value`` so that the layer computes with it: a weight under a
    parametrization (weight_norm, spectral_norm) becomes a plain parameter, since writing the
    computed weight would be lost at the next call; a weight another module holds too (a
    language model's head tied to its embedding) is replaced rather than written, with a
    warning, so that the other module keeps what it had (``merged``, the adapted layer's base
    ``base`` was read from, is no other)."""
    if parametrize.is_parametrized(base, "weight"):
        parametrize.remove_parametrizations(base, "weight", leave_parametrized=True)
    for hook in list(base._forward_pre_hooks.values()):  # the hook-based forms, deprecated
        if isinstance(hook, WeightNorm) and hook.name == "weight":
            torch.nn.utils.remove_weight_norm(base)
        elif isinstance(hook, SpectralNorm) and hook.name == "weight":
            torch.nn.utils.remove_spectral_norm(base)
    weight = base.weight
    others = [name or "the model" for name, m in holders.get(id(weight), [])
              if m is not base and m is not merged]
    if others:
        warnings.warn(f"merge_adapters: layer {path!r} shares its weight with "
                      f"{', '.join(map(repr, dict.fromkeys(others)))}; the merged layer gets a "
                      "weight of its own (the tie is broken), and the other keeps the weight "
                      "it had", stacklevel=3)
        base.weight = nn.Parameter(value, requires_grad=weight.requires_grad)
        return
    with torch.no_grad():
        weight.copy_(value)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` alone, flat (name -> tensor, as ``state_dict`` names them):
    each adapter's cores (``"<layer>.adapters.<adapter>.<core>"``), the frozen copy of an
    adapter built with ``init="offset"`` (``"<layer>.offsets.<adapter>.<core>"``) and each copy
    trained in full (``"<module>.copies.<adapter>.<name>"``); no base tensor. With
    :func:`adapter_config` (what rebuilds them, JSON-able) it is all :func:`load_adapters`
    needs; ``safetensors`` stores it::

        save_file(adapter_state_dict(model), "adapters.safetensors",
                  metadata={"tnspec": json.dumps(adapter_config(model))})
    """
    state: dict[str, torch.Tensor] = {}
    for path, module in adapted_modules(model):
        held = [("adapters", module.adapters), ("offsets", module.offsets)] \
            if isinstance(module, Adapted) else [("copies", module.copies)]
        for kind, named in held:
            for key, part in named.items():
                prefix = ".".join(filter(None, [path, kind, key]))
                state |= {f"{prefix}.{n}": t.detach() for n, t in part.state_dict().items()}
    return state


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """What rebuilds the adapters of ``model`` around their tensors (JSON-able): per adapted
    layer, each adapter's spec and sizes, scaling, padding and zeroed core (its step rule and
    init where not the default), and the active one; per module trained in full, its copies
    and the active one."""
    layers: dict[str, Any] = {}
    saved: dict[str, Any] = {}
    for path, module in adapted_modules(model):
        if isinstance(module, Saved):
            saved[path] = {"active": module.active, "copies": list(module.copies)}
            continue
        layers[path] = {"active": module.active, "adapters": {
            key: {"spec": layer.spec, "sizes": dict(layer.sizes),
                  "scaling": module.scaling[key], "zeroed": module.zeroed[key],
                  "pad": None if module.pads[key] is None else
                  [list(module.pads[key][0]), module.pads[key][1]]}
            | ({"step_rule": rule} if (rule := step_rule.rule_of(layer)) else {})
            | ({"init": "offset"} if key in module.offsets else {})
            for key, layer in module.adapters.items()}}
    return {"format": FORMAT, "layers": layers, "saved": saved}


def load_adapters(model: nn.Module, state: Mapping[str, Any],
                  config: Mapping[str, Any] | None = None, *, strict: bool = True
                  ) -> nn.Module:
    """Rebuild the adapters of ``state`` and ``config`` (from :func:`adapter_state_dict` and
    :func:`adapter_config`) on ``model``, a copy of the base model they were trained on, in
    place; freeze the base as ``adapt`` does. Returns the model (the ``Adapted`` module where
    the model is a bare adapted layer). ``strict``: every layer they name must exist with the
    geometry it was adapted at, and every tensor of ``state`` must be used. The nested dict
    of earlier releases (``"tnspec-adapters/1"``, one ``torch.save`` file) loads without
    ``config``. A layer that already holds an adapter of a name being loaded is an error
    (:func:`tnspec.hotswap` writes new tensors into it)."""
    if config is None and isinstance(state, Mapping) and state.get("format") == _NESTED:
        state, config = _flattened(state)
    if not isinstance(config, Mapping) or config.get("format") != FORMAT:
        raise SpecError("not an adapter config" if config is not None else
                        "load_adapters needs the adapters' config beside their tensors",
                        hint="give load_adapters(model, adapter_state_dict(m), "
                        "adapter_config(m)), as they were saved")
    # check, then change: every layer is found and every adapter rebuilt before the model is
    # touched, so that an error leaves it as it was
    used: set[str] = set()
    planned = []
    for path, entry in config["layers"].items():
        module = _found(model, path, strict)
        if module is None:
            continue
        base = module.base if isinstance(module, Adapted) else module
        if not is_dense(base) and not isinstance(base, Padded):
            raise SpecError(f"layer {path!r} is a {type(base).__name__}, not an "
                            f"{kind_names()}")
        try:
            read = check_forward(base)  # a conv padding in its forward: as adapt reads it
        except SpecError as exc:
            raise SpecError(f"layer {path!r}: {exc.message}") from None
        base = read.layer
        adapters = []
        for key, saved in entry["adapters"].items():
            if isinstance(module, Adapted) and key in module.adapters:
                raise _held(path, key)
            tensors = {}
            for part in ("adapters", "offsets"):
                prefix = ".".join(filter(None, [path, part, key])) + "."
                tensors[part] = {n[len(prefix):]: t for n, t in state.items()
                                 if n.startswith(prefix)}
                used |= {prefix + n for n in tensors[part]}
            layer, offset = _rebuilt(base, path, key, saved, tensors["adapters"],
                                     tensors["offsets"])
            adapters.append((key, layer, float(saved["scaling"]), None if saved["pad"] is None
                             else (tuple(saved["pad"][0]), saved["pad"][1]), saved["zeroed"],
                             offset))
        planned.append((path, module, adapters, entry["active"], read))
    copies = []
    for path, entry in config.get("saved", {}).items():
        module = _found(model, path, strict)
        if module is None:
            continue
        for key in entry["copies"]:
            if isinstance(module, Saved) and key in module.copies:
                raise _held(path, key)
            prefix = ".".join(filter(None, [path, "copies", key])) + "."
            tensors = {n[len(prefix):]: t for n, t in state.items() if n.startswith(prefix)}
            used |= {prefix + n for n in tensors}
            copy_ = copy.deepcopy(module.original if isinstance(module, Saved) else module)
            try:
                copy_.load_state_dict(tensors)
            except RuntimeError as exc:
                raise SpecError(f"the copy of {path!r} for adapter {key!r} does not load: "
                                f"{str(exc).splitlines()[0]}") from None
            copies.append((path, module, key, copy_, entry["active"]))
    unused = sorted(set(state) - used)
    if strict and unused:
        raise SpecError(f"the adapter state has tensors no adapter uses: {unused[0]!r}"
                        + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""),
                        hint="give the config saved with these tensors, or strict=False")
    root = model
    for path, module, adapters, _, read in planned:
        owner = module if isinstance(module, Adapted) else Adapted(read.base(module))
        for key, layer, scaling, pad, zeroed, offset in adapters:
            owner.add(key, layer, scaling, pad, zeroed, offset)
        if owner is not module:
            if path:
                set_submodule(model, path, owner)
            else:
                root = owner
    owners: dict[str, Saved] = {}
    for path, module, key, copy_, _ in copies:
        owner = owners.setdefault(path, module if isinstance(module, Saved) else Saved(module))
        owner.copies[key] = copy_
        if owner is not module:
            set_submodule(root, path, owner)
    for p in root.parameters():
        p.requires_grad_(False)
    actives = [p[3] for p in planned] + [a for *_, a in copies]
    for active in dict.fromkeys(a for a in actives if a):
        set_adapter(root, active)
    return root


def _held(path: str, key: str) -> SpecError:
    """The error for loading adapter ``key`` where layer ``path`` already holds one so named
    (loading replaced it without a word)."""
    return SpecError(f"layer {path!r} already holds an adapter named {key!r}: loading would "
                     f"replace it", hint="load onto a fresh copy of the base model, or write "
                     "the saved tensors into the adapter there with tnspec.hotswap")


def _found(model: nn.Module, path: str, strict: bool) -> nn.Module | None:
    """The module at ``path``; None where there is none and not ``strict``."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        if strict:
            raise SpecError(f"the model has no layer {path!r} to put an adapter on",
                            hint="load onto the model the adapters were trained on, or "
                            "pass strict=False") from None
        return None


def _flattened(nested: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The earlier nested layout (``"tnspec-adapters/1"``) as ``(state, config)``."""
    state, layers = {}, {}
    for path, entry in nested["layers"].items():
        layers[path] = {"active": entry["active"], "adapters": {}}
        for key, saved in entry["adapters"].items():
            layers[path]["adapters"][key] = {k: v for k, v in saved.items() if k != "cores"}
            prefix = ".".join(filter(None, [path, "adapters", key]))
            state |= {f"{prefix}.{n}": t for n, t in saved["cores"].items()}
    return state, {"format": FORMAT, "layers": layers, "saved": {}}


def _rebuilt(base: nn.Module, path: str, key: str, saved: Mapping[str, Any],
             cores: Mapping[str, torch.Tensor], frozen: Mapping[str, torch.Tensor]
             ) -> tuple[nn.Module, nn.Module | None]:
    """The adapter ``key`` of layer ``path`` and its frozen copy (None unless
    ``init="offset"``), built from ``saved`` (its config) and loaded with ``cores`` and
    ``frozen``; a SpecError where they do not fit."""
    net = _with_options(compile(saved["spec"], sizes=saved["sizes"]), bias=False)
    differs = _geometry_differs(base, net)
    if differs:
        raise SpecError(f"adapter {key!r} of layer {path!r} does not fit it: {differs}")
    pad = None if saved["pad"] is None else (tuple(saved["pad"][0]), saved["pad"][1])
    given = tuple(c.padding for c in geometry(net).convs)
    trained, here = _padding_text(given, pad), _padding_text((), _padding(base)[1])
    if trained != here:
        raise SpecError(f"adapter {key!r} of layer {path!r} was trained on a layer with "
                        f"{trained}; this layer has {here}",
                        hint="load it onto a copy of the model it was trained on")
    cls = TensorizedLinear if is_linear(base) else TensorizedConv
    layer = cls(net, dtype=base.weight.dtype, device=base.weight.device)
    rule = saved.get("step_rule")
    if rule not in (None, *step_rule.RULES):
        raise SpecError(f"adapter {key!r} of layer {path!r} was trained under step_rule "
                        f"{rule!r}, which this tnspec does not know",
                        hint=f"it knows {', '.join(step_rule.RULES)}: upgrade tnspec")
    step_rule.bound(layer, rule, saved["zeroed"])  # its bounds are loaded with the cores
    init = saved.get("init", "zero")
    if init not in INITS:
        raise SpecError(f"adapter {key!r} of layer {path!r} was built with init {init!r}, "
                        "which this tnspec does not know",
                        hint=f"it knows {', '.join(INITS)}: upgrade tnspec")
    offset = frozen_copy(layer) if init == "offset" else None
    for what, part, given in (("adapter", layer, cores), ("frozen copy", offset, frozen)):
        expected = part.state_dict() if part is not None else {}
        for n, t in expected.items():
            if n not in given or tuple(given[n].shape) != tuple(t.shape):
                raise SpecError(f"the {what} {key!r} of layer {path!r}: {n} is "
                                f"{'missing' if n not in given else tuple(given[n].shape)}, "
                                f"expected {tuple(t.shape)}",
                                hint="give the config saved with these tensors (a bounded "
                                "core is saved as parametrizations.<core>.original, with its "
                                "bound as parametrizations.<core>.0.sigma; an adapter built "
                                "with init='offset' has its frozen copy under offsets.)")
        extra = sorted(set(given) - set(expected))
        if extra:
            raise SpecError(f"the {what} {key!r} of layer {path!r}: the state has "
                            f"{extra[0]!r}, which " + ("this adapter does not hold" if part
                                                       is not None else
                                                       "its config does not build"),
                            hint="give the config saved with these tensors (it says whether "
                            "a step_rule bounds the cores, and the init)")
        with torch.no_grad():
            for n, t in expected.items():
                t.copy_(given[n])
    return layer, offset


def _padding_text(given: tuple[int, ...], pad: tuple[tuple[int, ...], str] | None) -> str:
    """Padding in words, alike for a layer and an adapter: the adapter's own (``given``, zeros
    on both sides, in its spec) or ``F.pad``'s arguments (the layer's, or those an adapter runs
    its input through)."""
    if pad is not None:
        left, right = pad[0][0::2][::-1], pad[0][1::2][::-1]
        mode = "zeros" if pad[1] == "constant" else pad[1]
        return f"padding {left}" + (f"/{right}" if left != right else "") + f" ({mode})"
    if any(given):
        return f"padding {given} (zeros)"
    return "no padding"
