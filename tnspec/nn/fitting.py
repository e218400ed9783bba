"""A :class:`~tnspec.nn.module.Layer` as a dense weight, and its cores fitted to one.

``Layer.dense_weight`` and ``Layer.fit_`` are these functions; ``tnspec.fit.decompose`` does the
work on the network and its cores, and this module adds what only a layer knows: an embedding's
padding row and vocabulary, the device of its cores, and copying the fit into them in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import SpecError
from ..fit import decompose

if TYPE_CHECKING:
    from .module import Layer


def dense_weight(layer: Layer) -> torch.Tensor:
    """The layer's equivalent dense weight, differentiable in its cores (see
    :meth:`Layer.dense_weight`)."""
    # read as attributes: a core under a parametrization is read as the network reads it
    network = layer.network
    cores = {c.name: getattr(layer, c.name) for c in network.cores}
    if not network.lookup:
        return decompose.dense_weight(network, cores)
    table = decompose.lookup_table(network, cores)[:network.vocabulary]
    pad = network.options.padding_idx
    if pad is None:
        return table
    return table.index_fill(0, torch.tensor([pad], device=table.device), 0.0)


def fit(layer: Layer, weight: torch.Tensor, metric: torch.Tensor | None,
        **options: Any) -> float:
    """Set ``layer``'s cores, in place, to the fit of ``weight`` (in the metric of the inputs'
    second moments, ``tnspec.fit.moments``, when ``metric`` is given); the relative error
    reached, computed from the cores as set (see :meth:`Layer.fit_`)."""
    network = layer.network
    device = next(iter(layer.parameters())).device
    if network.lookup:  # a (num_embeddings, embedding_dim) table: the one-hot weight
        if metric is not None:
            raise SpecError("inputs= fits the outputs of conv and linear layers; an "
                            "embedding is fitted to its table", hint="drop inputs=")
        rows = network.table_rows
        if tuple(weight.shape) != (layer.num_embeddings, layer.embedding_dim):
            raise SpecError(f"fit_ takes the ({layer.num_embeddings}, {layer.embedding_dim}) "
                            f"table, got shape {list(weight.shape)}",
                            hint="one row per index, as nn.Embedding.weight holds them")
        padded = weight.new_zeros(rows, weight.shape[1])
        padded[:weight.shape[0]] = weight
        _copy(layer, decompose.fit(network, padded.detach().t().to(device), **options))
        with torch.no_grad():
            return decompose.relative_error(layer.dense_weight(), weight)
    if metric is not None:
        options["metric"] = metric = metric.to(device)
    _copy(layer, decompose.fit(network, weight.detach().to(device), **options))
    with torch.no_grad():
        if metric is None:
            return decompose.relative_error(layer.dense_weight(), weight)
        return decompose.output_error(layer.dense_weight(), weight, metric)


def _copy(layer: Layer, cores: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in cores.items():
            getattr(layer, name).copy_(tensor)
