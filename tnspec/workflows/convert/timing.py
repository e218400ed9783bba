"""The clocks of ``compress``: the one its phases read against ``max_seconds``, and the
timing of a candidate layer under ``latency=True``."""

from __future__ import annotations

import time

import torch
from torch import nn

from ...progress import now


class Clock:
    """The jobs' clock, read for the time left before a limit, and no more once it is past:
    under ``max_seconds`` the steps after the limit only wrap up."""

    def __init__(self, started: float) -> None:
        self.read = started  # the last reading
        self.past: set[float] = set()

    def left(self, limit: float) -> float:
        """Seconds until ``limit`` (0 once it was found past)."""
        if limit in self.past:
            return 0.0
        self.read = now()
        if limit - self.read <= 0:
            self.past.add(limit)
        return max(limit - self.read, 0.0)


def timed(module: nn.Module, shape: tuple[int, ...] | None, repeats: int = 7) -> float:
    """Median seconds of ``module``'s forward and backward on a random input of ``shape``
    (own generator; a contiguous gradient, as a next layer gives)."""
    first = next(module.parameters())
    gen = torch.Generator(device=first.device).manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=first.dtype, device=first.device)
    x.requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]  # a frozen layer's: none
    spent = []
    with torch.enable_grad():
        for n in range(repeats + 2):  # two warm-up rounds: planning, autotuning
            start = time.perf_counter()
            y = module(x)
            torch.autograd.grad(y, [x, *params], torch.ones_like(y))
            if n >= 2:
                spent.append(time.perf_counter() - start)
    return sorted(spent)[len(spent) // 2]
