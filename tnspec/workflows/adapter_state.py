"""What a model's tnspec adapters become after training: merged into the base weights
(``merge_adapters``), saved and loaded on their own (``adapter_state_dict``,
``load_adapters``), switched (``set_adapter``) or turned off for a while
(``disable_adapters``)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import SpecError
from ..nn.api import _with_options, compile
from .adapters import (_CONVS, Adapted, TensorizedConv, TensorizedLinear, _adapted,
                       _geometry_differs, set_adapter)
from .merge import set_submodule

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
    merged: dict[int, nn.Module] = {}
    for path, module in list(target.named_modules(remove_duplicate=False)):
        if not isinstance(module, Adapted):
            continue
        if id(module) not in merged:
            names = ([module.active] if module.active and not module.disabled else []) \
                if name is None else [n for n in wanted if n in module.adapters]
            base = module.base
            if names:
                weight = base.weight.detach().double()
                for n in names:
                    weight = weight + module.delta_weight(n).to(weight.device)
                with torch.no_grad():
                    base.weight.copy_(weight.to(base.weight.dtype))
            merged[id(module)] = base
        if not path:
            return merged[id(module)]
        set_submodule(target, path, merged[id(module)])
    return target


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
    root = model
    actives = []
    for path, entry in state["layers"].items():
        try:
            module = model.get_submodule(path)
        except AttributeError:
            if strict:
                raise SpecError(f"the model has no layer {path!r} to put an adapter on",
                                hint="load onto the model the adapters were trained on, or "
                                "pass strict=False") from None
            continue
        owner = module if isinstance(module, Adapted) else Adapted(module)
        if not isinstance(owner.base, (nn.Linear, *_CONVS)):
            raise SpecError(f"layer {path!r} is a {type(owner.base).__name__}, not a linear or "
                            "conv layer")
        for key, saved in entry["adapters"].items():
            owner.add(key, _rebuilt(owner.base, path, key, saved), float(saved["scaling"]),
                      None if saved["pad"] is None else
                      (tuple(saved["pad"][0]), saved["pad"][1]), saved["zeroed"])
        if owner is not module:
            if path:
                set_submodule(model, path, owner)
            else:
                root = owner
        actives.append(entry["active"])
    for p in root.parameters():
        p.requires_grad_(False)
    for active in dict.fromkeys(a for a in actives if a):
        set_adapter(root, active)
    return root


def _rebuilt(base: nn.Module, path: str, key: str, saved: Mapping[str, Any]) -> nn.Module:
    net = _with_options(compile(saved["spec"], sizes=saved["sizes"]), bias=False)
    differs = _geometry_differs(base, net)
    if differs:
        raise SpecError(f"adapter {key!r} of layer {path!r} does not fit it: {differs}")
    cls = TensorizedLinear if isinstance(base, nn.Linear) else TensorizedConv
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
