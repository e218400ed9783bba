"""``tnspec.merge``: the way back from tnspec layers to the dense ``nn.Conv1d/2d/3d``,
``nn.Linear``, ``nn.Embedding`` and ``nn.EmbeddingBag`` modules computing the same, for
deployment where dense is faster."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import SpecError
from ..shapes import geometry
from ..nn.embedding import EmbeddingBag, TiedHead
from ..nn.module import Layer
from .adapted import inside_adapted


def merge(model: nn.Module) -> nn.Module:
    """Replace, in place, every conv-like or linear-like tnspec layer of ``model`` by the dense
    ``nn.Conv1d/2d/3d`` or ``nn.Linear`` with its :meth:`~Layer.dense_weight` and bias (same
    stride, padding, dilation, groups, dtype and device): for deployment where dense is
    faster. Returns the model; a tnspec layer given as the model itself returns its dense
    module. Layers of other networks stay, with a warning naming them. A
    :class:`~tnspec.nn.embedding.TiedHead` becomes an ``nn.Linear`` tied to the merged
    embedding's weight, as before tensorize.

    >>> from tnspec import formats
    >>> layer = formats.cp(16, 32, 3, rank=8, padding=1).layer()
    >>> merge(layer)
    Conv2d(16, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    """
    kept = []
    adapters = inside_adapted(model)  # merge_adapters folds those: they stay as they are
    merged: dict[int, nn.Module] = {}  # a layer registered under several names: one module
    bags = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, EmbeddingBag)]
    for name, module in bags:
        dense = merged.setdefault(id(module), _dense_bag(module))
        if not name:
            return dense
        set_submodule(model, name, dense)
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, Layer) or id(module) in adapters:
            continue
        if geometry(module.network) is None:
            if (name or "the model") not in kept:
                kept.append(name or "the model")
            continue
        dense = merged.setdefault(id(module), _dense(module))
        if not name:
            return dense
        set_submodule(model, name, dense)
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, TiedHead) and isinstance(module.table, nn.Embedding):
            head = merged.setdefault(id(module), _dense_head(module))
            if not name:
                return head
            set_submodule(model, name, head)
    owners = sorted(set(adapters.values()))
    if owners:
        warnings.warn(f"merge left the adapters of {len(owners)} adapted layer(s) as they are "
                      f"({', '.join(owners[:4])}{', ...' if len(owners) > 4 else ''}): "
                      "merge_adapters folds them into their base layers", stacklevel=2)
    if kept:
        warnings.warn(f"merge kept {len(kept)} tnspec layer(s) that are neither conv-like nor "
                      f"linear-like: {', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''}",
                      stacklevel=2)
    return model


def _dense(layer: Layer) -> nn.Module:
    """The ``nn.ConvNd`` or ``nn.Linear`` computing what a conv/linear-like ``layer`` does."""
    weight = layer.dense_weight().detach()
    kind = dict(dtype=weight.dtype, device=weight.device, bias=layer.bias is not None)
    if layer.network.lookup:
        if layer.bias is not None:
            raise SpecError("an embedding with a bias has no nn.Embedding counterpart")
        dense: nn.Module = nn.Embedding(*weight.shape, padding_idx=layer.padding_idx,
                                        _weight=weight.clone(), dtype=weight.dtype,
                                        device=weight.device)
        dense.weight.requires_grad_(any(p.requires_grad for p in layer.parameters()))
        return dense.train(layer.training)
    if weight.dim() == 2:
        dense = nn.Linear(layer.in_features, layer.out_features, **kind)
    else:
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[weight.dim() - 3]
        dense = conv(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                     layer.padding, layer.dilation, layer.groups, **kind)
    with torch.no_grad():
        dense.weight.copy_(weight)
        if layer.bias is not None:
            dense.bias.copy_(layer.bias.reshape(-1))
    # frozen where every core is; the bias as it was; train/eval mode as the layer's
    cores = [p for n, p in layer.named_parameters() if n != "bias"]
    dense.weight.requires_grad_(any(p.requires_grad for p in cores))
    if layer.bias is not None:
        dense.bias.requires_grad_(layer.bias.requires_grad)
    return dense.train(layer.training)


def _dense_head(head: TiedHead) -> nn.Linear:
    """The ``nn.Linear`` of a tied head whose table was merged: it holds the merged
    ``nn.Embedding``'s very weight, tied as the dense model was."""
    weight = head.table.weight
    dense = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                      dtype=weight.dtype, device=weight.device)
    dense.weight = weight
    if head.bias is not None:
        dense.bias = head.bias
    return dense.train(head.training)


def _dense_bag(bag: EmbeddingBag) -> nn.Module:
    """The ``nn.EmbeddingBag`` of a tensorized one."""
    table = _dense(bag.rows)
    dense = nn.EmbeddingBag(bag.num_embeddings, bag.embedding_dim, mode=bag.mode,
                            padding_idx=bag.padding_idx, _weight=table.weight.detach().clone(),
                            dtype=table.weight.dtype, device=table.weight.device)
    dense.weight.requires_grad_(table.weight.requires_grad)
    return dense.train(bag.training)


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def parameter_holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Each parameter (by id) -> the modules holding it as their own, with their names (one
    module registered under two names appears twice): where it has more than one, the
    parameter is tied."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, module))
    return holders
