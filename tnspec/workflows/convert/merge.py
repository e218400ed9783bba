"""``tnspec.merge``: the way back from tnspec layers to the dense ``nn.Conv1d/2d/3d``,
``nn.Linear``, ``nn.Embedding`` and ``nn.EmbeddingBag`` modules computing the same, for
deployment where dense is faster."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ...errors import SpecError
from ...shapes import geometry
from ...nn.embedding import EmbeddingBag, TiedHead
from ...nn.module import Layer
from ..adapted import inside_adapted
from ..model_tree import set_submodule


def merge(model: nn.Module) -> nn.Module:
    """Replace, in place, every conv-like or linear-like tnspec layer of ``model`` by the dense
    ``nn.Conv1d/2d/3d`` or ``nn.Linear`` with its :meth:`~Layer.dense_weight` and bias (same
    stride, padding, dilation, groups, dtype and device): for deployment where dense is
    faster. Returns the model; a tnspec layer given as the model itself returns its dense
    module. Layers of other networks stay, with a warning naming them. A
    :class:`~tnspec.nn.embedding.TiedHead` becomes an ``nn.Linear`` tied to the merged
    embedding's weight, as before tensorize. Every dense module is built before any is set:
    a layer that cannot be merged raises with the model as it was.

    >>> from tnspec import formats
    >>> layer = formats.cp(16, 32, 3, rank=8, padding=1).layer()
    >>> merge(layer)
    Conv2d(16, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    """
    kept = []
    adapters = inside_adapted(model)  # merge_adapters folds those: they stay as they are
    merged: dict[int, nn.Module] = {}  # a layer registered under several names: one module
    planned: list[tuple[str, nn.Module]] = []  # every dense module built before any is set
    bags: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if _under(name, bags):
            continue  # a bag's own table: merged with it
        if isinstance(module, EmbeddingBag):
            bags.append(name)
            planned.append((name, _once(merged, module, _dense_bag)))
        elif isinstance(module, Layer) and id(module) not in adapters:
            if geometry(module.network) is not None:
                planned.append((name, _once(merged, module, _dense)))
            elif (name or "the model") not in kept:
                kept.append(name or "the model")
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TiedHead) and id(module.table) in merged:
            table = merged[id(module.table)]
            planned.append((name, _once(merged, module, lambda head: _dense_head(head, table))))
    # then change: a module replaced as a whole takes its submodules with it
    replaced = dict(planned)
    if "" in replaced:
        return replaced[""]
    for name, dense in planned:
        if not _under(name, replaced):
            set_submodule(model, name, dense)
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


def _under(name: str, parents: Any) -> bool:
    """Whether the module ``name`` lies inside one of the modules named in ``parents``."""
    return any(not parent or name.startswith(f"{parent}.") for parent in parents)


def _once(merged: dict[int, nn.Module], module: nn.Module, dense: Any) -> nn.Module:
    """``dense(module)``, built once for a module registered under several names."""
    if id(module) not in merged:
        merged[id(module)] = dense(module)
    return merged[id(module)]


def _dense_head(head: TiedHead, table: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` of a tied head whose table merged into the ``nn.Embedding``
    ``table``: it holds that embedding's very weight, tied as the dense model was."""
    weight = table.weight
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
