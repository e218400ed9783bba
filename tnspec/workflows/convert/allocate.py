"""The candidates of ``compress``: which are not worth fitting (``prune=True``), and the
allocation among those fitted.

**Pruning**: two rules, each on what was fitted before it, so that the formats fitted first
(the cheap closed-form ones) decide which of the slow ones (TT and TR: iterative fits, seconds
each) run:

- at one layer, a format beaten at its two smallest shares is not fitted at the larger ones;
- across layers, a format far behind at the first two layers of a kind and weight shape (a
  transformer's query, key, value and output projections; its MLP's two linears), its error
  at least ``FAR`` times another format's at every share it was fitted, is not fitted at the
  other layers of that kind and shape.

"Beaten" at a share: another format's candidate at that share has no larger error. Why "far"
across layers: how two formats compare varies from layer to layer of one shape, more than it
does between two shares of one layer. On all-MiniLM-L6-v2's encoder at 50% with data, a tensor
ring's error was 1.26 and 1.39 times low-rank's at the first two 384 x 384 projections and 0.83
times it at the last block's attention output, where it was chosen; at the MLP's linears TT's
and TR's were 1.5-5.9 times low-rank's at the first two and never below it after
(``python -m experiments.models.compress_pruning`` prints them).

**Allocation**: one candidate per layer (item 0 the dense layer) within a parameter budget at
the least total cost, as a multiple-choice knapsack over the parameters in units (at most
``units`` of them, so that the table stays small).

Counting parameters in units loses the exact counts. Rounded up, every candidate looks larger
than it is, and an allocation that fits the budget with a few parameters to spare (all of a
model's layers at one rank, say) is ruled out, so the table settles for worse candidates
elsewhere. Rounded down, the table may pick an allocation a few units over the budget. So the
table is solved rounded down, its pick checked in exact parameters, and solved again with the
capacity lowered by the overshoot until the pick fits. The first pick, where it fits, is the
optimum (rounding down only relaxes the table); a repaired one is not, so then the
rounded-up table's pick (which always fits) and each layer's smallest candidate are kept as
fallbacks, and the cheapest pick that fits in exact parameters is the answer."""

from __future__ import annotations

import math
from typing import Any, Hashable, Sequence

import numpy as np
from torch import nn

from ...errors import SpecError
from .report import Candidate

Items = list[list[tuple[int, float]]]
LAYERS = 2  # a format far behind at this many layers of a kind and shape is not fitted after
FAR = 1.5  # how many times another's error is far behind


def allocate(items: Items, budget: float, units: int = 2000, repairs: int = 8) -> list[int]:
    """The multiple-choice knapsack: per layer, the index of one ``(params, cost)`` item (item
    0: dense) minimizing the total cost with ``sum params <= budget * sum dense params``, the
    sum counted exactly. ``repairs``: how many times the rounded-down table is solved again
    with a lower capacity before the rounded-up one's pick is taken."""
    dense = sum(layer[0][0] for layer in items)
    capacity_params = math.floor(budget * dense)
    smallest = [min(range(len(layer)), key=lambda k: layer[k][0]) for layer in items]
    if (need := _total(items, smallest, 0)) > capacity_params:
        raise SpecError(f"budget={budget:g} is below what the smallest candidates need "
                        f"({need:,} of {dense:,} parameters)",
                        hint="give a larger budget, more formats or smaller shares")
    unit = max(1, math.ceil(capacity_params / units))
    fits = [smallest]
    capacity = capacity_params // unit
    for repair in range(repairs):
        picks = _solve(items, capacity, unit, up=False)
        if picks is None:
            break
        over = _total(items, picks, 0) - capacity_params
        if over <= 0 and repair == 0:
            return picks  # rounding down only relaxes the table: a pick that fits is optimal
        if over <= 0:
            fits.append(picks)
            break
        capacity -= -(-over // unit)
    picks = _solve(items, capacity_params // unit, unit, up=True)
    if picks is not None:
        fits.append(picks)
    return min(fits, key=lambda picks: _total(items, picks, 1))


def _total(items: Items, picks: list[int], field: int) -> float:
    """The picks' sum of parameters (``field`` 0) or of costs (1)."""
    return sum(items[i][k][field] for i, k in enumerate(picks))


def _solve(items: Items, capacity: int, unit: int, up: bool) -> list[int] | None:
    """The table's optimum with each candidate's parameters counted in whole units, rounded
    ``up`` or down, and at most ``capacity`` units in all; None where nothing fits."""
    if capacity < 0:
        return None

    def count(params: int) -> int:
        return -(-params // unit) if up else params // unit

    best = np.full(capacity + 1, math.inf)
    best[0] = 0.0
    back = []
    for layer in items:
        new = np.full(capacity + 1, math.inf)
        arg = np.full(capacity + 1, -1, dtype=np.int64)
        for k, (params, cost) in enumerate(layer):
            need = count(params)
            if need > capacity:
                continue
            shifted = np.full(capacity + 1, math.inf)
            shifted[need:] = best[:capacity + 1 - need] + cost
            better = shifted < new
            new[better], arg[better] = shifted[better], k
        back.append(arg)
        best = new
    end = int(np.argmin(best))
    if not math.isfinite(best[end]):
        return None
    picks = []
    for layer, arg in zip(reversed(items), reversed(back)):
        k = int(arg[end])
        picks.append(k)
        end -= count(layer[k][0])
    return picks[::-1]


def kind(module: nn.Module) -> Hashable:
    """What makes two layers alike to the rule across layers: class, weight shape, groups."""
    return type(module), tuple(module.weight.shape), getattr(module, "groups", 1)


def beaten(cand: Candidate, options: Sequence[tuple[Candidate, Any]], by: float = 1.0
           ) -> bool:
    """Whether another format's candidate at ``cand``'s share has an error at most ``1 / by``
    of ``cand``'s."""
    return any(c.format not in ("dense", cand.format) and c.share == cand.share and
               c.error * by <= cand.error for c, _ in options if c is not cand)


class Pruning:
    """The two rules' state over one ``compress`` call; ``on=False`` prunes nothing."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._lost: dict[tuple[str, Hashable], int] = {}  # layers where it was far behind
        self._kept: set[tuple[str, Hashable]] = set()  # not far behind at one of them

    def skips_layer(self, fmt: str, module: nn.Module) -> bool:
        """Whether ``fmt`` is not fitted at ``module``: far behind at the first layers like it."""
        key = (fmt, kind(module))
        return self.on and key not in self._kept and self._lost.get(key, 0) >= LAYERS

    def skips_rest(self, beaten_at: int, shares_before: int) -> bool:
        """Whether the layer's larger shares are not fitted: beaten at its two smallest."""
        return self.on and beaten_at == 2 == shares_before

    def record(self, fmt: str, module: nn.Module, fitted: Sequence[Candidate],
               options: Sequence[tuple[Candidate, Any]]) -> None:
        """``fmt``'s candidates ``fitted`` at ``module``, among the layer's ``options``."""
        if not fitted:
            return
        key = (fmt, kind(module))
        if all(beaten(c, options, FAR) for c in fitted):
            self._lost[key] = self._lost.get(key, 0) + 1
        else:
            self._kept.add(key)
