"""``tnspec.export_lora``: any tnspec adapter as a plain LoRA, for the stacks that load only LoRA
(vLLM, diffusers, PEFT without tnspec). Each adapted layer's delta weight (float64, as
``merge_adapters`` adds it) is cut to its best rank-``r`` approximation, the truncated SVD of the
delta unfolded as ``(out, in * kernel)``, and written as PEFT's ``lora_A`` / ``lora_B`` tensors
with ``lora_alpha = r`` (scaling 1); the relative error of each cut is reported, and warned of
above ``warn_above``. Modules trained in full (``adapt(..., modules_to_save=...)``) go in as
PEFT's ``modules_to_save``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import SpecError
from ..adapted import Adapted, Saved, adapted_modules
from ..dense_layers import is_linear, is_transposed
from ..padded import Padded


@dataclass(frozen=True)
class LoraExport:
    """``state`` (PEFT's key -> tensor), ``config`` (the fields of PEFT's ``LoraConfig``,
    JSON-able) and ``errors`` (per layer, ``||LoRA delta - adapter delta|| / ||adapter
    delta||``)."""

    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    errors: dict[str, float]

    def __str__(self) -> str:
        worst = max(self.errors.items(), key=lambda kv: kv[1])
        return (f"LoRA rank {self.config['r']} of {len(self.errors)} layer(s); relative error "
                f"of the deltas at most {worst[1]:.2e} ({worst[0]})")


def export_lora(model: nn.Module, rank: int, name: str | None = None,
                prefix: str = "base_model.model.", warn_above: float | None = 0.05
                ) -> LoraExport:
    """Adapter ``name`` (by default each layer's active one) of every adapted layer of
    ``model`` as a rank-``rank`` LoRA in PEFT's layout: ``state`` keys
    ``prefix + "<layer>.lora_A.weight"`` and ``".lora_B.weight"`` (for a conv, ``lora_A`` is a
    conv of the layer's kernel, stride, padding and dilation to ``rank`` channels and
    ``lora_B`` a 1x1 conv), ``config`` for ``peft.LoraConfig(**config)``:
    ``set_peft_model_state_dict`` loads ``state`` into ``get_peft_model(base,
    LoraConfig(**config))``. Grouped and dilated convs and layers whose padding is not zeros
    have no LoRA form in PEFT: a SpecError names them. Each module trained in full
    (``modules_to_save`` of ``adapt``) is exported as PEFT saves its ``modules_to_save``: its
    copy for the adapter, under ``prefix + "<module>.<tensor>"``, and its name in
    ``config["modules_to_save"]``. A layer whose LoRA loses more than ``warn_above`` of its
    delta (relative error; None: never) is warned of, with the rank that would keep it: a
    TT or TR adapter's delta is often of high rank, and its cut is not the adapter."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise SpecError(f"rank={rank!r} must be a positive int", hint="e.g. rank=8")
    state: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    transposed = []
    layers = [(path, m) for path, m in adapted_modules(model) if isinstance(m, Adapted)]
    for path, module in layers:  # checked, then built: an error leaves nothing half-made
        base = module.base
        if not path:
            raise SpecError("the model is a bare adapted layer: a LoRA names the layers "
                            "inside a model", hint="adapt the model that holds the layer")
        if isinstance(base, Padded):
            raise SpecError(f"layer {path!r} pads its input in its forward ({base.pad}): "
                            "PEFT's LoRA conv would read it unpadded",
                            hint="exclude it from adapt, or merge_adapters instead")
        if getattr(base, "groups", 1) != 1 or getattr(base, "padding_mode", "zeros") != "zeros" \
                or any(d != 1 for d in getattr(base, "dilation", ())):
            raise SpecError(f"layer {path!r} ({type(base).__name__}) has no LoRA form: PEFT's "
                            "LoRA adds an ungrouped, undilated, zero-padded conv",
                            hint="exclude it from adapt")
    for path, module in layers:
        key = module.active if name is None else name
        if key is None or key not in module.adapters:
            continue
        delta = module.delta_weight(key)  # (out, in, *kernel), float64
        flat = delta.reshape(delta.shape[0], -1)
        u, s, vh = torch.linalg.svd(flat, full_matrices=False)
        r = min(rank, s.numel())
        a, b = vh[:r], u[:, :r] * s[:r]
        if r < rank:  # a delta of lower rank than asked: zero rows, as PEFT's shapes need
            a = torch.cat([a, a.new_zeros(rank - r, a.shape[1])])
            b = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], 1)
        norm = float(flat.norm())
        errors[path] = float((b @ a - flat).norm()) / norm if norm > 0 else 0.0
        dtype = module.base.weight.dtype
        if not is_linear(module.base):
            a = a.reshape(rank, *delta.shape[1:])
            b = b.reshape(*b.shape, *([1] * (delta.dim() - 2)))
        transposed.append(is_transposed(module.base))
        state[f"{prefix}{path}.lora_A.weight"] = a.to(dtype).contiguous()
        state[f"{prefix}{path}.lora_B.weight"] = b.to(dtype).contiguous()
    if not errors:
        raise SpecError("no adapted layer has " + (f"an adapter named {name!r}" if name else
                                                   "an active adapter"),
                        hint="adapt the model first, or give name=")
    saved = []
    for path, module in adapted_modules(model):
        key = module.active if name is None else name
        if isinstance(module, Saved) and key in module.copies:
            saved.append(path)
            state |= {f"{prefix}{path}.{n}": t.detach()
                      for n, t in module.copies[key].state_dict().items()}
    lossy = {path: e for path, e in errors.items() if warn_above is not None and e > warn_above}
    if lossy:
        worst = max(lossy, key=lossy.__getitem__)
        warnings.warn(f"export_lora: the rank-{rank} LoRA loses more than {warn_above:g} of the "
                      f"adapter's delta in {len(lossy)} of {len(errors)} layer(s), at worst "
                      f"{lossy[worst]:.2f} ({worst!r}); the exported model will not compute what "
                      f"the adapted one does: give a higher rank (export.errors has every "
                      f"layer's), or warn_above=None", stacklevel=2)
    if len(set(transposed)) > 1:
        raise SpecError("the adapted layers mix transformers' Conv1D with nn.Linear: PEFT's "
                        "fan_in_fan_out is one flag for all", hint="export them separately")
    config = {"r": rank, "lora_alpha": rank, "target_modules": sorted(errors),
              "fan_in_fan_out": bool(transposed[0]), "lora_dropout": 0.0, "bias": "none"}
    if saved:
        config["modules_to_save"] = saved
    return LoraExport(state, config, errors)
