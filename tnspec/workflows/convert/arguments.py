"""``compress``'s arguments checked before anything runs: each refused with what was given and
what to give instead."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...errors import SpecError
from ...nn import formats as format_names


def check_budget_and_formats(budget: float, formats: Sequence[str]) -> None:
    """``budget`` a share in (0, 1]; ``formats`` a non-empty tuple of format names."""
    if not 0 < budget <= 1:
        raise SpecError(f"budget={budget!r} is a share of the dense parameters",
                        hint="a number in (0, 1], e.g. budget=0.25")
    if isinstance(formats, str):
        raise SpecError(f"formats={formats!r} must be a tuple of format names",
                        hint=f"e.g. formats=({formats!r},)")
    unknown = [f for f in formats if f not in format_names.NAMES]
    if unknown or not formats:
        raise SpecError(f"formats={tuple(formats)!r}" +
                        (f": unknown format {unknown[0]!r}" if unknown else " is empty"),
                        hint=f"names from {', '.join(format_names.NAMES)}")


def fit_options(fit: Mapping[str, Any] | None, heal: int, defaults: Mapping[str, Any]
                ) -> dict[str, Any]:
    """``heal`` a number of steps; the fits' options: ``defaults`` updated by ``fit``."""
    if isinstance(heal, bool) or not isinstance(heal, int) or heal < 0:
        raise SpecError(f"heal={heal!r} is a number of training steps",
                        hint="e.g. heal=200, or 0 for none")
    unknown = sorted(set(fit or {}) - set(defaults))
    if unknown:
        raise SpecError(f"fit= has no option {unknown[0]!r}",
                        hint=f"the options are {', '.join(defaults)}")
    return {**defaults, **dict(fit or {})}


def shares_to_fit(shares: Sequence[float] | None, budget: float, lower_shares: Sequence[float]
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``compress``'s shares: those fitted first, and those fitted only where the first cannot
    hold the budget (``shares=None``: the budget, then the smaller of ``lower_shares``)."""
    if shares is None:
        return (budget,), tuple(s for s in lower_shares if s < budget)
    if isinstance(shares, (str, int, float)) or not shares or any(
            isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1
            for s in shares):
        raise SpecError(f"shares={shares!r} must be a tuple of shares of a layer's parameters",
                        hint="numbers in (0, 1], e.g. shares=(0.1, 0.25, 0.5), or None: every "
                        "layer at the budget")
    return tuple(shares), ()
