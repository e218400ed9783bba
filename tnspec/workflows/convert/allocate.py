"""The allocation of ``compress``: one candidate per layer (item 0 the dense layer) within a
parameter budget at the least total cost, as a multiple-choice knapsack over the parameters
in units (at most ``units`` of them, so that the table stays small)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import SpecError


def allocate(items: list[list[tuple[int, float]]], budget: float, units: int = 2000
              ) -> list[int]:
    """The multiple-choice knapsack: per layer, the index of one ``(params, cost)`` item (item
    0: dense) minimizing the total cost with ``sum params <= budget * sum dense params``."""
    capacity_params = math.floor(budget * sum(layer[0][0] for layer in items))
    unit = max(1, math.ceil(capacity_params / units))
    capacity = capacity_params // unit
    inf = math.inf
    best = np.full(capacity + 1, inf)
    best[0] = 0.0
    back = []
    for layer in items:
        new = np.full(capacity + 1, inf)
        arg = np.full(capacity + 1, -1, dtype=np.int64)
        for k, (params, cost) in enumerate(layer):
            need = -(-params // unit)  # rounded up: the budget holds exactly
            if need > capacity:
                continue
            shifted = np.full(capacity + 1, inf)
            shifted[need:] = best[:capacity + 1 - need] + cost
            better = shifted < new
            new[better], arg[better] = shifted[better], k
        back.append(arg)
        best = new
    end = int(np.argmin(best))
    if not math.isfinite(best[end]) and sum(layer[0][0] for layer in items) <= capacity_params:
        return [0] * len(items)  # only rounding up to the unit ruled the dense layers out
    if not math.isfinite(best[end]):
        smallest = sum(min(p for p, _ in layer) for layer in items)
        raise SpecError(f"budget={budget:g} is below what the smallest candidates need "
                        f"({smallest:,} of {sum(layer[0][0] for layer in items):,} parameters)",
                        hint="give a larger budget, more formats or smaller shares")
    picks = []
    for layer, arg in zip(reversed(items), reversed(back)):
        k = int(arg[end])
        picks.append(k)
        end -= -(-layer[k][0] // unit)
    return picks[::-1]
