"""``tnspec.hotswap``: another trained adapter's tensors written into a model's adapter in
place, so that a ``torch.compile``'d model serves it without compiling again (as PEFT's
``hotswap_adapter`` does for LoRA).

``set_adapter`` changes which module runs, and ``torch.compile`` guards on that choice: each
adapter made active compiles once (then it is cached). ``hotswap`` changes values only: the
adapter keeps its modules, parameters and Python attributes, so every guard still holds. The
adapter swapped in must have the same network and sizes; its scaling, where it differs, is
folded into its zero core (the adapter's output is linear in each core), so the scaling the
compiled code read stays as it was."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ...errors import SpecError
from ..adapted import Adapted, Saved, adapted_modules
from .state import FORMAT
from . import step_rule


def hotswap(model: nn.Module, state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
            *, name: str | None = None, into: str | None = None) -> nn.Module:
    """Write adapter ``name`` of ``state`` and ``config`` (from :func:`adapter_state_dict` and
    :func:`adapter_config`; default: the one that was active when they were saved) into the
    adapter ``into`` of ``model`` (default: its active one), in place, values only: a
    compiled model runs the new adapter without compiling again. Every layer holding ``into``
    must be named in ``config`` with the same network and sizes, and the modules trained in
    full with it too; all is checked before anything changes. Returns ``model``.

    >>> from torch import nn
    >>> import tnspec
    >>> model, _ = tnspec.adapt(nn.Sequential(nn.Linear(8, 8)), "tt", rank=0.5)
    >>> other, _ = tnspec.adapt(nn.Sequential(nn.Linear(8, 8)), "tt", rank=0.5)
    >>> _ = tnspec.hotswap(model, tnspec.adapter_state_dict(other),
    ...                    tnspec.adapter_config(other))
    """
    if not isinstance(config, Mapping) or config.get("format") != FORMAT:
        raise SpecError("hotswap needs the config saved with the adapters' tensors",
                        hint="give hotswap(model, adapter_state_dict(m), adapter_config(m))")
    held = dict(adapted_modules(model))
    if into is None:
        actives = {m.active for m in held.values() if m.active is not None}
        if len(actives) != 1:
            raise SpecError("hotswap: the model has " + (
                "no active adapter" if not actives else
                f"several active adapters ({', '.join(sorted(actives))})"),
                hint="name the adapter to write into: into=...")
        into = actives.pop()
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    for path, module in held.items():
        if isinstance(module, Adapted) and into in module.adapters:
            writes += _layer_writes(path, module, state, config, name, into)
        elif isinstance(module, Saved) and into in module.copies:
            writes += _copy_writes(path, module, state, config, name, into)
    if not writes:
        raise SpecError(f"hotswap: no layer of the model holds adapter {into!r}",
                        hint=f"the model's adapters: {_names(held) or 'none'}")
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    return model


def _source(path: str, active: str | None, saved: Any, name: str | None) -> str:
    """The saved adapter to swap in at ``path``: ``name``, or the one active when saved."""
    key = active if name is None else name
    if key is None or key not in saved:
        raise SpecError(f"hotswap: the saved adapters of {path!r} have no adapter "
                        f"{key!r}" if key is not None else
                        f"hotswap: the saved adapters of {path!r} had none active",
                        hint="name the saved adapter to swap in: name=...")
    return key


def _layer_writes(path: str, module: Adapted, state: Mapping[str, torch.Tensor],
                  config: Mapping[str, Any], name: str | None, into: str
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    entry = config["layers"].get(path)
    if entry is None:
        raise SpecError(f"hotswap: layer {path!r} holds adapter {into!r}, but the saved "
                        "adapters do not name it",
                        hint="swap in adapters trained on the same layers")
    key = _source(path, entry.get("active"), entry["adapters"], name)
    saved, layer = entry["adapters"][key], module.adapters[into]
    for what, have, given in (("network", layer.spec, saved["spec"]),
                              ("sizes", dict(layer.sizes), saved["sizes"]),
                              ("zeroed core", module.zeroed[into], saved["zeroed"]),
                              ("step_rule", step_rule.rule_of(layer), saved.get("step_rule")),
                              ("init", "offset" if into in module.offsets else "zero",
                               saved.get("init", "zero"))):
        if have != given:
            raise SpecError(f"hotswap: layer {path!r}: the saved adapter's {what} is "
                            f"{given!r}, adapter {into!r} has {have!r}",
                            hint="hotswap writes values only; load_adapters then set_adapter "
                            "takes another network (a compiled model compiles it once)")
    ratio = float(saved["scaling"]) / module.scaling[into]
    writes = []
    parts = [("adapters", layer)] + ([("offsets", module.offsets[into])]
                                     if into in module.offsets else [])
    for part, held in parts:
        prefix = ".".join(filter(None, [path, part, key])) + "."
        for core, p in held.state_dict(keep_vars=True).items():  # a bound's sigma included
            value = state.get(prefix + core)
            if value is None or tuple(value.shape) != tuple(p.shape):
                raise SpecError(f"hotswap: layer {path!r}: {part} core {core} is " + (
                    "missing" if value is None else f"{tuple(value.shape)}") +
                    f" in the saved state, expected {tuple(p.shape)}")
            if core == module.zeroed[into]:  # its scaling, folded into the core it multiplies
                value = value.double() * ratio
            writes.append((p, value.to(p.device, p.dtype)))
    return writes


def _copy_writes(path: str, module: Saved, state: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any], name: str | None, into: str
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    entry = config.get("saved", {}).get(path)
    if entry is None:
        raise SpecError(f"hotswap: module {path!r} is trained in full with adapter {into!r}, "
                        "but the saved adapters do not name it",
                        hint="swap in adapters saved with the same modules_to_save")
    key = _source(path, entry.get("active"), entry["copies"], name)
    prefix = ".".join(filter(None, [path, "copies", key])) + "."
    writes = []
    for tensor_name, target in module.copies[into].state_dict(keep_vars=True).items():
        value = state.get(prefix + tensor_name)
        if value is None or tuple(value.shape) != tuple(target.shape):
            raise SpecError(f"hotswap: the copy of {path!r}: {tensor_name} is " + (
                "missing" if value is None else f"{tuple(value.shape)}") +
                f" in the saved state, expected {tuple(target.shape)}")
        writes.append((target, value.to(target.device, target.dtype)))
    return writes


def _names(held: Mapping[str, nn.Module]) -> str:
    names = {k for m in held.values()
             for k in (m.adapters if isinstance(m, Adapted) else m.copies)}
    return ", ".join(sorted(names))
