"""Which of ``compress``'s candidates are not worth fitting (``prune=True``).

Two rules, each on what was fitted before it, so that the formats fitted first (the cheap
closed-form ones) decide which of the slow ones (TT and TR: iterative fits, seconds each) run:

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
and TR's were 1.5-5.9 times low-rank's at the first two and never below it after.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from torch import nn

from .report import Candidate

LAYERS = 2  # a format far behind at this many layers of a kind and shape is not fitted after
FAR = 1.5  # how many times another's error is far behind


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
