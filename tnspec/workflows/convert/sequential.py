"""``compress(sequential=True)``: each replaced layer fitted again, in the order the model calls
them, on the inputs the already-compressed layers before it produce (GPTQ's order), so that it
makes up for their errors instead of only its own.

At a layer with dense weight ``W`` (bias ``b``), let ``X`` be the rows it reads in the original
model (a linear layer's inputs, a conv's patches) and ``X'`` those it reads in the compressed
one, on the same batches. The new layer's weight ``V`` should give the original outputs from
the new inputs: minimize ``||X W^T - X' V^T||``. With ``C = X^T X' / n`` and ``M = X'^T X' / n``
this is ``||(W* - V) L||^2`` plus a constant, for the target ``W* = W (C + d I)(M + d I)^-1``
(``d``: ``M``'s mean eigenvalue times ``P / n``, the rows' width over their number, and at
least 1% of it: it pulls ``W*`` toward ``W`` where the rows say little, which on MiniLM kept 32
sentences from making the refit worse on held-out text; ``W* = W`` whenever ``X' = X``) and
``L L^T = M``: the fit ``compress`` already runs, to another weight in another metric. The
bias then takes the mean of what is left, ``b + mean(X W^T - X' V^T)``, its least-squares
value. A refit that does not lower the error on ``X'`` is dropped, and the layer keeps its
first fit.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from ...fit import moments
from ...nn.module import Layer
from ..dense_layers import weight_of
from ..feeding import Runner, call, evaluated
from ..model_tree import set_submodule
from .observe import sampled

DAMPING = 0.01


def refit(model: nn.Module, order: list[str], dense: Mapping[str, nn.Module],
          called: Mapping[str, nn.Module], new: Mapping[str, Layer], data: list[Any],
          run: Runner | None, options: Mapping[str, Any], left: Callable[[], float],
          done: Callable[[str, float, float], None]) -> list[tuple[str, float, float]]:
    """Refit, in place and in ``order``, each layer of ``new`` (set in ``model``) that
    replaced ``called[name]`` (the module the original model called, computing what the dense
    layer ``dense[name]`` does); ``left()``: the seconds left. Returns ``(name, error before,
    error after)`` per layer refitted: the relative output error on the compressed model's
    inputs."""
    out = []
    keep = max(moments.MAX_ROWS // len(data), 1)
    for name in [n for n in order if n in new]:
        seconds = left()
        if seconds <= 0:
            break
        plain, layer = dense[name], new[name]
        compressed = _rows(model, layer, plain, data, run, keep)
        original = _original_rows(model, new, called, plain, name, data, run, keep)
        if original.shape != compressed.shape or not len(original):
            continue  # a layer the batches reach differently in the two models
        want = _outputs(plain, weight_of(plain), original, plain.bias)  # X W^T + b, once
        before = _error(want, _outputs(plain, layer.dense_weight(), compressed, layer.bias))
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        target, metric = _target(plain, original, compressed)
        layer._fit(target, metric, **{**options, "max_seconds": min(
            options.get("max_seconds") or seconds, seconds)})
        got = _outputs(plain, layer.dense_weight(), compressed, layer.bias)
        if plain.bias is not None:  # the bias's least-squares value: the mean left over
            with torch.no_grad():
                layer.bias += (want - got).mean(0).reshape(layer.bias.shape).to(layer.bias)
            got = got + (want - got).mean(0)
        after = _error(want, got)
        if not after < before:
            layer.load_state_dict(state)
            after = before
        out.append((name, before, after))
        done(name, before, after)
    return out


class _Enough(Exception):
    """Raised from a pre-hook once the rows are recorded: the rest of the forward is not run."""


def _rows(model: nn.Module, hooked: nn.Module, dense: nn.Module, data: list[Any],
          run: Runner | None, keep: int) -> torch.Tensor:
    """The rows ``dense`` would read from what reaches ``hooked`` in ``model`` (its first call
    on each batch: the forward stops there), ``keep`` per batch (the same subset for the same
    shapes), in float64."""
    rows: list[torch.Tensor] = []

    def record(_: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            rows.append(sampled(dense, args[0].detach(), keep, len(rows)).double())
            raise _Enough
    handle = hooked.register_forward_pre_hook(record)
    try:
        with evaluated(model):
            for batch in data:
                try:
                    call(model, batch, run)
                except _Enough:
                    pass
    finally:
        handle.remove()
    return torch.cat(rows) if rows else torch.empty(0, 0, dtype=torch.float64)


def _original_rows(model: nn.Module, new: Mapping[str, nn.Module],
                   called: Mapping[str, nn.Module], dense: nn.Module, at: str,
                   data: list[Any], run: Runner | None, keep: int) -> torch.Tensor:
    """:func:`_rows` at layer ``at`` in the original model: every replaced layer's module put
    back for the pass."""
    for name in new:
        set_submodule(model, name, called[name])
    try:
        return _rows(model, called[at], dense, data, run, keep)
    finally:
        for name, module in new.items():
            set_submodule(model, name, module)


def _blocks(dense: nn.Module, weight: torch.Tensor) -> list[tuple[slice, slice]]:
    """Per group: the weight's rows and the input rows' columns it reads."""
    groups = getattr(dense, "groups", 1)
    per_out, per_in = weight.shape[0] // groups, weight[0].numel()
    return [(slice(g * per_out, (g + 1) * per_out), slice(g * per_in, (g + 1) * per_in))
            for g in range(groups)]


def _target(dense: nn.Module, original: torch.Tensor, compressed: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W*, L)``: the weight that gives the original outputs from the compressed inputs,
    in the dense weight's shape, and the factor of the compressed inputs' second moment."""
    weight = weight_of(dense).detach()
    flat = weight.reshape(weight.shape[0], -1).double()
    target = torch.empty_like(flat)
    n = original.shape[0]
    for rows, cols in _blocks(dense, weight):
        x, y = original[:, cols], compressed[:, cols]
        m = y.T @ y / n
        weight_of_rows = max(DAMPING, len(m) / n)  # few rows: W* stays near W
        damp = weight_of_rows * float(m.diagonal().mean()) * torch.eye(len(m), dtype=m.dtype)
        cross = x.T @ y / n
        target[rows] = torch.linalg.solve(m + damp, (flat[rows] @ (cross + damp)).T).T
    groups = getattr(dense, "groups", 1)
    return target.reshape(weight.shape).to(weight), moments.factor(compressed, groups)


def _outputs(dense: nn.Module, weight: torch.Tensor, rows: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """``rows W^T + bias`` per group of ``dense``, in float64 (``weight`` in any shape of
    ``dense``'s weight's size)."""
    flat = weight.detach().reshape(weight_of(dense).shape[0], -1).double()
    out = torch.cat([rows[:, cols] @ flat[r].T for r, cols in _blocks(dense, flat)], 1)
    return out if bias is None else out + bias.detach().double().reshape(-1)


def _error(want: torch.Tensor, got: torch.Tensor) -> float:
    """``||want - got|| / ||want||``."""
    return float((want - got).norm() / (want.norm() + 1e-300))
