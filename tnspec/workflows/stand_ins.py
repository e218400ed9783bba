"""The tnspec layers that stand in for dense ones: ``tensorize`` puts them in a dense layer's
place, and an adapter of a dense layer is one, run beside it. They are :class:`tnspec.Layer`
with the interface of the layer they stand for."""

from __future__ import annotations

import torch

from ..nn.module import Layer


class TensorizedLinear(Layer):
    """A tnspec layer standing in for a linear layer (``nn.Linear``, Hugging Face's ``Conv1D``):
    any number of leading dimensions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class TensorizedConv(Layer):
    """A tnspec layer standing in for ``nn.ConvNd`` (batched or unbatched input, as every
    conv-like layer)."""
