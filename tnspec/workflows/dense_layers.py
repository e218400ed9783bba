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


def check_forward(module: nn.Module) -> nn.Module:
    """``module``, or a plain ``nn.ConvNd`` computing what it does; SpecError where there is
    none. A subclass that overrides ``forward`` (a weight-standardized conv, a LoRA linear) is
    not its weight, and ``nn.MultiheadAttention``'s out-projection is read by its parent,
    never called. A conv subclass that pads in its own forward, as checkpoints ported from
    TensorFlow do ("same" padding: EfficientNet-PyTorch's ``Conv2dStaticSamePadding``, timm's
    ``Conv2dSame``), computes a plain conv where its stride is 1 and the padding symmetric:
    checked on random inputs of two sizes, that conv is returned, holding the same
    parameters."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        raise SpecError("nn.MultiheadAttention reads this layer's weight directly")
    base = next(b for b in (*linear_kinds(), *CONVS) if isinstance(module, b))
    for method in ("forward", "_conv_forward"):
        if getattr(type(module), method, None) is not getattr(base, method, None):
            plain = _plain_conv(module, base) if base in CONVS else None
            if plain is not None:
                return plain
            why = f"{type(module).__name__} overrides {method}: a layer of its weight would " \
                "not compute what it does"
            if base in CONVS and any(s != 1 for s in module.stride):
                why += f" (stride {tuple(module.stride)}: a pad made in forward would depend " \
                    "on the input size)"
            raise SpecError(why)
    return module


def _plain_conv(module: nn.Module, base: type) -> nn.Module | None:
    """A plain ``base`` conv holding ``module``'s weight and bias that computes what
    ``module`` does on random inputs of two sizes, padded as configured or "same" on top;
    None where neither does (or the stride is not 1, where "same" depends on the size)."""
    if any(s != 1 for s in module.stride) or module.padding_mode != "zeros" or \
            isinstance(module.padding, str) or module.transposed:
        return None
    same = tuple(d * (k - 1) for k, d in zip(module.kernel_size, module.dilation))
    candidates = [tuple(module.padding)]
    if all(s % 2 == 0 for s in same) and any(same):
        candidates.append(tuple(p + s // 2 for p, s in zip(module.padding, same)))
    weight = module.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    side = max(same) + 3
    inputs = [torch.randn(2, module.in_channels, *([n] * len(same)), generator=gen,
                          device=weight.device, dtype=weight.dtype) for n in (side, side + 1)]
    try:
        with torch.no_grad():
            wanted = [module(x) for x in inputs]
    except Exception:  # noqa: BLE001 (its own forward fails on a probe: not a plain conv)
        return None
    for padding in candidates:
        plain = base(module.in_channels, module.out_channels, module.kernel_size,
                     padding=padding, dilation=module.dilation, groups=module.groups,
                     bias=module.bias is not None, device="meta")
        plain.weight, plain.bias = module.weight, module.bias  # the same parameters
        with torch.no_grad():
            got = [plain(x) for x in inputs]
        if all(g.shape == w.shape and torch.allclose(g, w, rtol=1e-4, atol=1e-5 * float(
                w.abs().max()) + 1e-12) for g, w in zip(got, wanted)):
            plain.train(module.training)
            return plain
    return None


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
