"""Monte Carlo estimates of the variance ratios a layer applies at initialization.

Only interior positions count: those whose receptive field never touches the zero padding
(for y), or that receive every kernel tap an infinite axis would give them (for dx).
"""

from __future__ import annotations

import math

import torch

import tnspec


def axis_interior(n_in: int, n_out: int, K: int, s: int, d: int, p: int,
                  side: str) -> list[bool]:
    if side == "out":
        return [all(0 <= s * j + d * k - p < n_in for k in range(K)) for j in range(n_out)]
    full = [sum((j + p - d * k) % s == 0 for k in range(K)) for j in range(n_in)]
    got = [sum((j + p - d * k) % s == 0 and 0 <= (j + p - d * k) // s < n_out
               for k in range(K)) for j in range(n_in)]
    return [f == g and f > 0 for f, g in zip(full, got)]


def ratio(layer: tnspec.Layer, seed: int, mode: str, spatial: int = 10, batch: int = 2) -> float:
    """Var(y)/Var(x) (mode "in") or Var(dx)/Var(dy) (mode "out") for one re-initialization."""
    net = layer.network
    shape = [batch] + [math.prod(net.sizes.get(i, spatial) for i in a)
                       for a in net.input.axes[1:]]
    torch.manual_seed(seed)
    layer.reset_parameters()
    x = torch.randn(*shape, requires_grad=mode == "out")
    y = layer(x)
    bound = layer.plan(shape).network
    if mode == "in":
        t, source, axes, side = y, x, net.output.axes, "out"
    else:
        source = torch.randn_like(y)
        (t,) = torch.autograd.grad(y, x, source)
        axes, side = net.input.axes, "in"
    mask = torch.ones(t.shape, dtype=torch.bool)
    for c in net.convs:
        K = bound.sizes[c.kernel] if c.kernel else 1
        inside = torch.tensor(axis_interior(bound.sizes[c.source], bound.sizes[c.target], K,
                                            c.stride, c.dilation, c.padding, side))
        name = c.target if side == "out" else c.source
        axis = next(n for n, a in enumerate(axes) if name in a)
        view = [1] * t.dim()
        view[axis] = -1
        mask = mask & inside.view(view)
    return t.detach()[mask].pow(2).mean().item() / source.detach().pow(2).mean().item()


def mean_ratio(layer: tnspec.Layer, mode: str, rel_se: float = 0.03, first: int = 20,
               most: int = 2000) -> tuple[float, float, int]:
    """Average over re-initializations (seeds 0, 1, ...) until the standard error is below
    ``rel_se`` of the mean: (mean, standard error, number of re-initializations)."""
    values: list[float] = []
    while True:
        values += [ratio(layer, len(values) + k, mode) for k in range(first if not values
                                                                          else len(values))]
        m = sum(values) / len(values)
        se = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))
        if se < rel_se * m or len(values) >= most:
            return m, se, len(values)
