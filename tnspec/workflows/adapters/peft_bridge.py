"""tnspec adapters inside Hugging Face PEFT (optional: needs ``pip install peft``).

``register_peft(config, "tt")`` maps ``nn.Linear``, ``nn.Conv1d/2d/3d`` and Hugging Face's
``Conv1D`` (GPT-2's projections) to a custom LoRA
layer type (PEFT's experimental ``LoraConfig._register_custom_module``) that runs a tnspec
adapter of that format at rank ``config.r``, built and initialized as :func:`tnspec.adapt`
builds it. ``get_peft_model``, ``save_pretrained``, ``PeftModel.from_pretrained(model, path,
config=config)`` and ``merge_and_unload`` then work as for PEFT's own LoRA. What PEFT keeps in
its own hands: ``lora_alpha`` (tnspec's init rule sets the scaling), ``lora_dropout`` and
``init_lora_weights`` are ignored. ``adapter_config.json`` keeps the registration under
``tnspec`` and targets that only the registered config loads: ``from_pretrained`` without it
refuses, saying what to pass, rather than load PEFT's plain LoRA beside cores it cannot read.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import SpecError
from ..adapted import delta_weight
from ..dense_layers import CONVS, linear_kinds, stored
from .layers import adapter_layer


def register_peft(config: Any, fmt: str = "tt", *, scale: float = 1.0,
                  **options: Any) -> Any:
    """Register tnspec adapters of format ``fmt`` (a name of :data:`tnspec.formats.NAMES`,
    with ``options`` for :func:`tnspec.formats.build`) in the PEFT ``LoraConfig`` ``config``
    for ``nn.Linear``, ``nn.Conv1d/2d/3d`` and ``Conv1D``; ``config.r`` (or its
    ``rank_pattern``) is the rank, ``scale`` the adapter's variance as a share of the base
    layer's. Returns ``config``."""
    cls = _layer_class(fmt, scale, dict(options))
    # after _layer_class, which imports peft and with it transformers' Conv1D
    config._register_custom_module({kind: cls for kind in (*linear_kinds(), *CONVS)})
    config.to_dict = types.MethodType(_saved(type(config).to_dict, fmt, scale, options), config)
    return config


#: the target_modules written to adapter_config.json: PEFT loading it without the registered
#: config finds no such module and stops with this text, rather than load its plain LoRA
#: layers beside the tnspec cores it cannot read (and compute the base model's outputs)
REFUSAL = ("tnspec adapters: load them with PeftModel.from_pretrained(model, path, "
           "config=tnspec.register_peft(LoraConfig(...), fmt)), format and targets in this "
           "file's 'tnspec'")


def _saved(to_dict: Any, fmt: str, scale: float, options: dict[str, Any]) -> Any:
    """The config's ``to_dict`` as ``save_pretrained`` writes it: the registration under
    ``tnspec``, and targets that only the registered config loads."""
    def saved(self: Any) -> dict[str, Any]:
        out = to_dict(self)
        targets = out.get("target_modules")
        out["tnspec"] = {"format": fmt, "scale": scale, "options": options,
                         "target_modules": sorted(targets) if isinstance(targets, (set, list))
                         else targets}
        out["target_modules"] = [REFUSAL]
        return out
    return saved


def _registered(config: Any, base: nn.Module) -> type | None:
    """The tnspec layer class ``config`` registered for ``base``'s type, or None."""
    mapping = getattr(config, "_custom_modules", None) or {}
    cls = next((v for k, v in mapping.items() if isinstance(base, k)), None)
    return cls if hasattr(cls, "tn_format") else None


def _layer_class(fmt: str, scale: float, options: dict[str, Any]) -> type:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class TnspecLoraLayer(nn.Module, LoraLayer):
        """A PEFT LoRA layer whose adapters are tnspec layers (``lora_tn``)."""

        adapter_layer_names = ("lora_tn",)
        other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout")
        tn_format, tn_scale, tn_options = fmt, scale, options  # what register_peft was given

        def __init__(self, base_layer: nn.Module, adapter_name: str, r: int = 8,
                     lora_alpha: int = 8, **kwargs: Any) -> None:
            nn.Module.__init__(self)
            LoraLayer.__init__(self, base_layer)
            self.lora_tn = nn.ModuleDict()
            self.tn_pad: dict[str, Any] = {}
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha)

        def update_layer(self, adapter_name: str, r: int, lora_alpha: int | None = None,
                         config: Any = None, **kwargs: Any) -> None:
            # PEFT's add_adapter calls this on the layer an earlier config built: the format
            # is the one this adapter's own config registered, not the first one's
            cls = type(self) if config is None else _registered(config, self.get_base_layer())
            if cls is None:
                raise SpecError(f"the config of adapter {adapter_name!r} registers no tnspec "
                                f"format for {type(self.get_base_layer()).__name__}, and this "
                                "layer holds tnspec adapters",
                                hint="pass it through tnspec.register_peft(config, fmt) first")
            layer, scaling, pad, _, _ = adapter_layer(self.get_base_layer(), cls.tn_format, r,
                                                      cls.tn_scale, None, None, cls.tn_options)
            self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
            self.scaling[adapter_name], self.tn_pad[adapter_name] = scaling, pad
            self.lora_tn[adapter_name] = layer
            self._move_adapter_to_device_of_base_layer(adapter_name)
            self.set_adapter(self.active_adapters)

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """The adapter as a dense weight laid out as the base's (transposed for a
            ``Conv1D``), in float64."""
            return stored(self.get_base_layer(),
                          delta_weight(self.lora_tn[adapter], self.scaling[adapter]))

        def _add(self, adapter: str, sign: int) -> None:
            weight = self.get_base_layer().weight
            with torch.no_grad():
                total = weight.double() + sign * self.get_delta_weight(adapter).to(weight.device)
                weight.copy_(total.to(weight.dtype))

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None
                  ) -> None:
            for adapter in check_adapters_to_merge(self, adapter_names):
                if adapter in self.lora_tn:
                    self._add(adapter, 1)
                    if safe_merge and not torch.isfinite(self.get_base_layer().weight).all():
                        self._add(adapter, -1)
                        raise ValueError(f"merging adapter {adapter!r} gives non-finite "
                                         "weights")
                    self.merged_adapters.append(adapter)

        def unmerge(self) -> None:
            while self.merged_adapters:
                self._add(self.merged_adapters.pop(), -1)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, *args, **kwargs)
            y = self.base_layer(x, *args, **kwargs)
            if self.merged:
                return y
            for adapter in self.active_adapters:
                if adapter in self.lora_tn:
                    pad, layer = self.tn_pad[adapter], self.lora_tn[adapter]
                    xa = x if pad is None else F.pad(x, pad[0], mode=pad[1])
                    # PEFT keeps adapters in float32 beside a bf16 or fp16 base
                    a = layer(xa.to(next(layer.parameters()).dtype)).to(y.dtype)
                    # not torch.add(..., alpha=): inductor (torch 2.13) drops alpha after a
                    # matmul
                    y = y + self.scaling[adapter] * a
            return y

        def __repr__(self) -> str:
            return "tnspec." + super().__repr__()

    return TnspecLoraLayer
