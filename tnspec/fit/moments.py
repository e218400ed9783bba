"""The second moment of what a layer sees: the inputs of a linear layer, the unfolded patches of
a conv (with its stride, padding, dilation and groups), as a factor ``L`` with ``L L^T = M``.

Fitting a layer to its *outputs* on sample inputs ``X`` minimizes ``E ||(W_fit - W) p||^2`` over
the patches ``p``, which is ``||(W_fit - W) L||^2``: the weight error in the metric of the
input's second moment ``M = E[p p^T]``. ``L`` is ``V sqrt(Lambda)`` from the eigendecomposition
of ``M``, keeping the directions that carry the data (eigenvalues above ``1e-12`` of the
largest) and at most ``max_rank`` of them: a ``P x q`` factor, ``q <= min(P, max_rank)``, so
that fitting costs about what a weight-only fit of ``q`` input columns would. Directions past
``max_rank`` carry the least variance; the error there is not weighed.

Where the moment is at least ``4 * max_rank`` wide and the rows could fill more than ``max_rank``
directions, the full eigendecomposition (``O(P^3)``) would mostly compute directions that are
dropped, and the moment of float32 rows is summed in float32 (its error, about ``1e-7`` of the
largest eigenvalue, far below the directions kept; directions under ``1e-6`` of it are that
rounding, and dropped). There the leading ``max_rank`` come from
subspace iteration (Halko, Martinsson and Tropp 2011, algorithm 4.4: ``max_rank + 64`` columns,
two power steps, then the eigendecomposition of the moment in that subspace): a few products by
``M``. On a 2,048-wide conv's patches ``tests/fit/test_moments.py`` holds the subspace to more
than 99.5% of the moment's energy the exact leading directions hold, and ``L L^T`` to within
1.1 times the best rank-512 approximation's error."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import SpecError

MAX_ROWS = 16384  # patches kept for the moment (a random subset past it; the RNG is untouched)
MAX_RANK = 512
OVERSAMPLE, POWER_STEPS = 64, 2  # the subspace iteration's extra columns and its power steps


def patches(x: Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], max_rows: int | None = None,
            seed: int | None = None) -> Tensor:
    """``(rows, C * prod(kernel))``: every patch a conv of these settings reads from ``x``
    (``(N, C, *spatial)``), flattened as ``(c, k1, k2, ...)`` like ``weight[o]``; past
    ``max_rows`` of them, a random subset (by default the one :func:`factor` would keep; another
    ``seed`` draws another), picked before any patch is copied: memory follows the subset, not
    the batch."""
    d = len(kernel)
    x = F.pad(x, [p for pad in reversed(padding) for p in (pad, pad)])
    for axis in range(d):
        span = dilation[axis] * (kernel[axis] - 1) + 1
        x = x.unfold(2 + axis, span, stride[axis])  # (N, C, out..., window)
        x = x[..., ::dilation[axis]]
    # x: (N, C, out_1..out_d, k_1..k_d), a view; (N, out..., C, k...) after the permute
    n, c = x.shape[:2]
    x = x.permute(0, *range(2, 2 + d), 1, *range(2 + d, 2 + 2 * d))
    count = math.prod(x.shape[:1 + d])
    if max_rows is not None and count > max_rows:
        where = torch.unravel_index(subset(count, max_rows, seed), x.shape[:1 + d])
        x = x[tuple(i.to(x.device) for i in where)]  # (max_rows, C, k...): a copy of those
    return x.reshape(-1, c * math.prod(kernel))


def subset(count: int, keep: int, seed: int | None = None) -> Tensor:
    """The rows kept of ``count``: a random ``keep`` of them, the same for the same count and
    ``seed`` (by default the count; own generator, the global RNG untouched)."""
    gen = torch.Generator().manual_seed(count if seed is None else seed)
    return torch.randperm(count, generator=gen)[:keep]


def factor(rows: Tensor, groups: int = 1, *, max_rows: int = MAX_ROWS,
           max_rank: int = MAX_RANK) -> Tensor:
    """``L`` of shape ``(groups, P, q)`` with ``L[g] L[g]^T`` the mean of ``p p^T`` over the
    rows of group ``g`` (``rows``: ``(n, groups * P)``) in its ``q <= max_rank`` leading
    directions (by subspace iteration where ``P >= 4 * max_rank``: the module's docstring), in
    float64."""
    rows = rows.detach()
    if rows.shape[0] > max_rows:  # before the copy below
        rows = rows[subset(rows.shape[0], max_rows).to(rows.device)]
    per = rows.shape[1] // groups
    wide = per >= 4 * max_rank and rows.shape[0] > max_rank
    rows = rows.to(torch.float32 if wide and rows.dtype == torch.float32 else torch.float64)
    # below this share of the largest eigenvalue a direction is the sum's rounding
    floor = 1e-6 if rows.dtype == torch.float32 else 1e-12
    factors = []
    for g in range(groups):
        block = rows[:, g * per:(g + 1) * per]
        moment = (block.T @ block).to(torch.float64) / max(block.shape[0], 1)
        if not bool(torch.isfinite(moment).all()):  # eigh would give NaN, not an error
            raise SpecError("the inputs hold NaN or infinite values",
                            hint="check the data and the layers before this one")
        values, vectors = _leading(moment, max_rank) if wide else _eigh(moment)
        keep = values > floor * max(float(values[-1]), 1e-300)
        values, vectors = values[keep][-max_rank:], vectors[:, keep][:, -max_rank:]
        factors.append(vectors * values.sqrt())
    q = max(max(f.shape[1] for f in factors), 1)
    out = torch.zeros(groups, per, q, dtype=torch.float64, device=rows.device)
    for g, f in enumerate(factors):
        out[g, :, :f.shape[1]] = f
    return out


def _leading(moment: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` leading eigenpairs of the symmetric positive semi-definite ``moment``,
    ascending as ``eigh`` gives them, by subspace iteration from a start drawn with the moment's
    width as seed (own generator: the global RNG untouched, the same result every call)."""
    gen = torch.Generator().manual_seed(len(moment))
    start = torch.randn(len(moment), count + OVERSAMPLE, generator=gen, dtype=moment.dtype)
    basis = start.to(moment.device)
    for _ in range(1 + POWER_STEPS):
        basis = torch.linalg.qr(moment @ basis).Q
    values, small = _eigh(basis.T @ moment @ basis)
    return values[-count:], (basis @ small)[:, -count:]


def _eigh(moment: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh``, with a jitter on the diagonal where it does not converge (the
    moment of ReLU activations has many repeated zero eigenvalues)."""
    scale = float(moment.diagonal().mean()) or 1.0
    for jitter in (0.0, 1e-12, 1e-9, 1e-6):
        try:
            eye = torch.eye(len(moment), dtype=moment.dtype, device=moment.device)
            return torch.linalg.eigh(moment + jitter * scale * eye)
        except torch.linalg.LinAlgError:
            continue
    raise SpecError("the second moment of the inputs has no eigendecomposition",
                    hint="check the inputs for NaN or infinite values")


def of_inputs(layer: Any, inputs: Tensor) -> Tensor:
    """The metric factor of ``inputs`` as the conv-like or linear-like ``layer`` (its
    ``nn.ConvNd`` / ``nn.Linear`` attributes) reads them: ``(groups, P, q)``."""
    if not isinstance(inputs, Tensor) or not inputs.is_floating_point():
        raise TypeError(f"fit_(inputs=...) takes a float tensor of sample inputs, not "
                        f"{type(inputs).__name__}")
    x = inputs.detach()
    if not hasattr(layer, "in_channels"):
        if not hasattr(layer, "in_features"):
            raise SpecError("fitting to inputs needs a conv-like or linear-like layer")
        if x.shape[-1] != layer.in_features:
            raise SpecError(f"inputs of shape {tuple(x.shape)} do not end in "
                            f"in_features={layer.in_features}")
        return factor(x.reshape(-1, layer.in_features))
    d = len(layer.kernel_size)
    if x.dim() == d + 1:  # unbatched, as nn.ConvNd takes it
        x = x.unsqueeze(0)
    if x.dim() != d + 2 or x.shape[1] != layer.in_channels:
        raise SpecError(f"inputs of shape {tuple(x.shape)} are not (N, {layer.in_channels}, "
                        f"...) with {d} spatial axes")
    rows = patches(x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, MAX_ROWS)
    return factor(rows, layer.groups)  # rows are (c, k...) over all channels: group-major
