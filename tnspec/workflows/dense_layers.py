"""The dense layers the workflows replace, adapt and merge, and their weights in one layout.

``nn.Linear``, ``nn.Conv1d/2d/3d`` and Hugging Face's ``transformers.pytorch_utils.Conv1D``
(the projections of GPT-2 and its kin: a linear layer that stores its weight as ``(in, out)``,
the transpose of ``nn.Linear``'s). Every workflow reads a layer's weight through
:func:`weight_of`, always ``(out, in, *kernel)``, and writes it through :func:`write_weight`, so
that no workflow has to know which of them it holds. ``transformers`` is never imported here:
a model can hold a ``Conv1D`` only once its module is loaded, so it is looked up there.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..errors import SpecError
from . import padded
from .padded import Reading

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def hf_conv1d() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` where ``transformers`` is loaded, else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def linear_kinds() -> tuple[type, ...]:
    """The linear layer types: ``nn.Linear``, and Hugging Face's ``Conv1D`` where loaded."""
    conv1d = hf_conv1d()
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer (``nn.Linear`` or Hugging Face's ``Conv1D``)."""
    return isinstance(module, linear_kinds())


def is_dense(module: nn.Module) -> bool:
    """Whether ``module`` is a layer the workflows know: linear, or ``nn.Conv1d/2d/3d``."""
    return isinstance(module, (*linear_kinds(), *CONVS))


def is_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight ``(in, out)`` (Hugging Face's ``Conv1D``)."""
    conv1d = hf_conv1d()
    return conv1d is not None and isinstance(module, conv1d)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of a linear layer; ``(in_channels, out_channels)`` of a conv."""
    if is_transposed(module):
        return module.nx, module.nf
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.in_channels, module.out_channels


def weight_of(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``nn.Linear`` / ``nn.ConvNd`` lay it out, ``(out, in, *kernel)``
    (a view of a ``Conv1D``'s, not a copy)."""
    return module.weight.t() if is_transposed(module) else module.weight


def stored(module: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``value``, given as :func:`weight_of` lays it out, as ``module`` stores its weight."""
    return value.t().contiguous() if is_transposed(module) else value


def check_forward(module: nn.Module) -> Reading:
    """What ``module`` computes as a plain layer (a :class:`Reading`); SpecError where that is
    not known. A subclass that overrides ``forward`` (a LoRA linear, a conv with a learned
    gain) is not its weight, and ``nn.MultiheadAttention``'s out-projection is read by its
    parent, never called. A conv subclass that pads "same" in its own forward, as checkpoints
    ported from TensorFlow do, or standardizes its weight, as BiT's do, is read as the plain
    conv it computes with the pad kept in front (:mod:`.padded`)."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        raise SpecError("nn.MultiheadAttention reads this layer's weight directly")
    if isinstance(module, padded.Padded):  # the base of an adapted layer, read before
        return Reading(module.layer, module.pad)
    base = next(b for b in (*linear_kinds(), *CONVS) if isinstance(module, b))
    for method in ("forward", "_conv_forward"):
        if getattr(type(module), method, None) is not getattr(base, method, None):
            read = padded.reading(module, base) if base in CONVS else None
            if read is not None:
                return read
            raise SpecError(f"{type(module).__name__} overrides {method}: a layer of its "
                            "weight would not compute what it does" + (
                                " (no 'same' pad or weight standardization found that "
                                "computes it)" if base in CONVS else ""))
    return Reading(module)


def kind_names() -> str:
    """The layer types in words, for messages."""
    return "nn.Linear, nn.Conv1d/2d/3d or transformers' Conv1D"


def never_replaced(model: nn.Module, embeddings: bool = False) -> tuple[tuple[str, int, str], ...]:
    """``(module type, how many, why)`` for the modules of ``model`` that hold parameters of
    their own and are no dense layer (embeddings aside where ``embeddings``), so that a report
    can say what it left alone and why; tnspec's own modules aside. (A dense layer a workflow
    does not replace is one of its skipped layers, with the reason.)"""
    counts: dict[str, list] = {}
    for module in model.modules():
        if is_dense(module) or next(module.parameters(recurse=False), None) is None or \
                type(module).__module__.startswith("tnspec.") or \
                embeddings and isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue
        kind = type(module).__name__
        counts.setdefault(kind, [0, _why(module)])[0] += 1
    return tuple((kind, n, why) for kind, (n, why) in sorted(counts.items()))


def _why(module: nn.Module) -> str:
    if isinstance(module, nn.MultiheadAttention):
        return "its in-projection is a parameter its fused kernel reads, not a layer"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "an embedding: tnspec.tensorize replaces it by a factorized table"
    if "Norm" in type(module).__name__:
        return "a normalization: a few parameters per channel"
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return "a transposed conv: no tnspec format stands for it yet"
    return f"not a layer tnspec knows ({kind_names()})"
