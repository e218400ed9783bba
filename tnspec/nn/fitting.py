"""A layer's network and cores as a dense weight, and its cores fitted to one.

``Layer.dense_weight`` and ``Layer.fit_`` call these functions with what they need: the layer's
network and its cores as the network reads them (a core under a parametrization included), so
that this module knows nothing of the ``Layer`` class. ``tnspec.fit.decompose`` does the work on
the network and its cores; this module adds an embedding's padding row and vocabulary, the
device of the cores, and copying the fit into them in place.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..errors import SpecError
from ..fit import decompose
from ..ir import Network


def dense_weight(network: Network, cores: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The equivalent dense weight of ``network`` with ``cores`` (as the network reads them),
    differentiable in them (see :meth:`Layer.dense_weight`)."""
    if not network.lookup:
        return decompose.dense_weight(network, cores)
    table = decompose.lookup_table(network, cores)[:network.vocabulary]
    pad = network.options.padding_idx
    if pad is None:
        return table
    return table.index_fill(0, torch.tensor([pad], device=table.device), 0.0)


def fit(network: Network, cores: Callable[[], Mapping[str, torch.Tensor]],
        weight: torch.Tensor, metric: torch.Tensor | None,
        table: tuple[int, int] | None = None, **options: Any) -> float:
    """Set the cores that ``cores()`` reads, in place, to the fit of ``weight`` (in the metric
    of the inputs' second moments, ``tnspec.fit.moments``, when ``metric`` is given); the
    relative error reached, computed from the cores as set (see :meth:`Layer.fit_`). For an
    index input, ``table`` is the ``(num_embeddings, embedding_dim)`` shape ``weight`` must
    have."""
    device = next(iter(cores().values())).device
    if network.lookup:  # a (num_embeddings, embedding_dim) table: the one-hot weight
        if metric is not None:
            raise SpecError("inputs= fits the outputs of conv and linear layers; an "
                            "embedding is fitted to its table", hint="drop inputs=")
        if tuple(weight.shape) != table:
            raise SpecError(f"fit_ takes the ({table[0]}, {table[1]}) table, got shape "
                            f"{list(weight.shape)}",
                            hint="one row per index, as nn.Embedding.weight holds them")
        padded = weight.new_zeros(network.table_rows, weight.shape[1])
        padded[:weight.shape[0]] = weight
        _copy(cores(), decompose.fit(network, padded.detach().t().to(device), **options))
        with torch.no_grad():
            return decompose.relative_error(dense_weight(network, cores()), weight)
    if metric is not None:
        options["metric"] = metric = metric.to(device)
    _copy(cores(), decompose.fit(network, weight.detach().to(device), **options))
    with torch.no_grad():
        fitted = dense_weight(network, cores())
        if metric is None:
            return decompose.relative_error(fitted, weight)
        return decompose.output_error(fitted, weight, metric)


def _copy(cores: Mapping[str, torch.Tensor], fitted: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in fitted.items():
            cores[name].copy_(tensor)
