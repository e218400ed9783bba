"""What a model's tnspec adapters become after training: merged into the base weights
(``merge_adapters``), saved and loaded on their own (``adapter_state_dict``,
``load_adapters``), switched (``set_adapter``) or turned off for a while
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

from ..errors import SpecError
from ..shapes import geometry
from ..nn.api import _with_options, compile
from .adapted import Adapted
from .adapters import (TensorizedConv, TensorizedLinear, _adapted, _geometry_differs, _padding,
                       set_adapter)
from .dense_layers import is_dense, is_linear, kind_names, stored, weight_of
from .merge import parameter_holders, set_submodule

FORMAT = "tnspec-adapters/1"  # the tag of adapter_state_dict's layout


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """A context in which ``model`` runs its base layers alone (as before ``adapt``)::

        with tnspec.disable_adapters(model):
            reference = model(x)
    """
    modules = [m for _, m in _adapted(model)]
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
        present = {k for _, m in _adapted(model) for k in m.adapters}
        missing = [n for n in wanted if n not in present]
        if missing:
            raise SpecError(f"no layer has an adapter named {missing[0]!r}",
                            hint=f"the adapters are {', '.join(sorted(present)) or 'none'}")
    target = model if inplace else copy.deepcopy(model)
    holders = parameter_holders(target)
    merged: dict[int, nn.Module] = {}
    for path, module in list(target.named_modules(remove_duplicate=False)):
        if not isinstance(module, Adapted):
            continue
        if id(module) not in merged:
            names = ([module.active] if module.active and not module.disabled else []) \
                if name is None else [n for n in wanted if n in module.adapters]
            base = module.base
            if names:
                weight = weight_of(base).detach().double()
                for n in names:
                    weight = weight + module.delta_weight(n).to(weight.device)
                _write_weight(base, stored(base, weight).to(base.weight.dtype), path, holders)
            merged[id(module)] = base
        if not path:
            return merged[id(module)]
        set_submodule(target, path, merged[id(module)])
    return target


def _write_weight(base: nn.Module, value: torch.Tensor, path: str,
                  holders: dict[int, list[tuple[str, nn.Module]]]) -> None:
    """Set ``base``'s weight to ``value`` so that the layer computes with it: a weight under a
    parametrization (weight_norm, spectral_norm) becomes a plain parameter, since writing the
    computed weight would be lost at the next call; a weight another module holds too (a
    language model's head tied to its embedding) is replaced rather than written, with a
    warning, so that the other module keeps what it had."""
    if parametrize.is_parametrized(base, "weight"):
        parametrize.remove_parametrizations(base, "weight", leave_parametrized=True)
    for hook in list(base._forward_pre_hooks.values()):  # the hook-based forms, deprecated
        if isinstance(hook, WeightNorm) and hook.name == "weight":
            torch.nn.utils.remove_weight_norm(base)
        elif isinstance(hook, SpectralNorm) and hook.name == "weight":
            torch.nn.utils.remove_spectral_norm(base)
    weight = base.weight
    others = [name or "the model" for name, m in holders.get(id(weight), []) if m is not base]
    if others:
        warnings.warn(f"merge_adapters: layer {path!r} shares its weight with "
                      f"{', '.join(map(repr, dict.fromkeys(others)))}; the merged layer gets a "
                      "weight of its own (the tie is broken), and the other keeps the weight "
                      "it had", stacklevel=3)
        base.weight = nn.Parameter(value, requires_grad=weight.requires_grad)
        return
    with torch.no_grad():
        weight.copy_(value)


def adapter_state_dict(model: nn.Module) -> dict[str, Any]:
    """The adapters of ``model`` alone: each one's cores plus what rebuilds it (its spec and
    sizes, scaling, padding, the layer it adapts) and the active adapter; no base tensor.
    Save it with ``torch.save``; :func:`load_adapters` puts it back on a fresh base model."""
    layers: dict[str, Any] = {}
    for path, module in _adapted(model):
        layers[path] = {"active": module.active, "adapters": {
            key: {"spec": layer.spec, "sizes": dict(layer.sizes),
                  "scaling": module.scaling[key], "zeroed": module.zeroed[key],
                  "pad": None if module.pads[key] is None else
                  [list(module.pads[key][0]), module.pads[key][1]],
                  "cores": {n: p.detach() for n, p in layer.named_parameters()}}
            for key, layer in module.adapters.items()}}
    return {"format": FORMAT, "layers": layers}


def load_adapters(model: nn.Module, state: Mapping[str, Any], *,
                  strict: bool = True) -> nn.Module:
    """Rebuild the adapters of ``state`` (from :func:`adapter_state_dict`) on ``model``, a
    copy of the base model they were trained on, in place; freeze the base as ``adapt`` does.
    Returns the model (the ``Adapted`` module where the model is a bare adapted layer).
    ``strict``: every layer ``state`` names must exist with the geometry it was adapted at."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise SpecError("not an adapter state", hint="give what tnspec.adapter_state_dict "
                        "returned (torch.load it first)")
    # check, then change: every layer is found and every adapter rebuilt before the model is
    # touched, so that an error leaves it as it was
    planned = []
    for path, entry in state["layers"].items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            if strict:
                raise SpecError(f"the model has no layer {path!r} to put an adapter on",
                                hint="load onto the model the adapters were trained on, or "
                                "pass strict=False") from None
            continue
        base = module.base if isinstance(module, Adapted) else module
        if not is_dense(base):
            raise SpecError(f"layer {path!r} is a {type(base).__name__}, not an "
                            f"{kind_names()}")
        adapters = [(key, _rebuilt(base, path, key, saved), float(saved["scaling"]),
                     None if saved["pad"] is None else
                     (tuple(saved["pad"][0]), saved["pad"][1]), saved["zeroed"])
                    for key, saved in entry["adapters"].items()]
        planned.append((path, module, adapters, entry["active"]))
    root = model
    for path, module, adapters, _ in planned:
        owner = module if isinstance(module, Adapted) else Adapted(module)
        for key, layer, scaling, pad, zeroed in adapters:
            owner.add(key, layer, scaling, pad, zeroed)
        if owner is not module:
            if path:
                set_submodule(model, path, owner)
            else:
                root = owner
    for p in root.parameters():
        p.requires_grad_(False)
    for active in dict.fromkeys(a for *_, a in planned if a):
        set_adapter(root, active)
    return root


def _rebuilt(base: nn.Module, path: str, key: str, saved: Mapping[str, Any]) -> nn.Module:
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
    cores = dict(saved["cores"])
    for n, p in layer.named_parameters():
        if n not in cores or tuple(cores[n].shape) != tuple(p.shape):
            raise SpecError(f"adapter {key!r} of layer {path!r}: core {n} is "
                            f"{'missing' if n not in cores else tuple(cores[n].shape)}, "
                            f"expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(cores[n])
    return layer


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
