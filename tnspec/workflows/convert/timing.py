"""The clocks of ``compress``: the one its phases read against ``max_seconds``, and the
timing of a candidate layer under ``latency``."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ...errors import SpecError
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


#: ``timer(module, shape) -> seconds``: how ``compress(latency=...)`` times a layer
Timer = Callable[[nn.Module, tuple[int, ...]], float]


def timed(module: nn.Module, shape: tuple[int, ...] | None, repeats: int = 7,
          training: bool = False) -> float:
    """Median seconds of ``module``'s forward on a random input of ``shape`` (own
    generator) under ``no_grad``, as a served model runs it; with ``training``, its forward
    and backward (a contiguous gradient, as a next layer gives)."""
    first = next(module.parameters())
    gen = torch.Generator(device=first.device).manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=first.dtype, device=first.device)
    x.requires_grad_(training)
    params = [p for p in module.parameters() if p.requires_grad]  # a frozen layer's: none
    spent = []
    with torch.set_grad_enabled(training):
        for n in range(repeats + 2):  # two warm-up rounds: planning, autotuning
            start = time.perf_counter()
            y = module(x)
            if training:
                torch.autograd.grad(y, [x, *params], torch.ones_like(y))
            if n >= 2:
                spent.append(time.perf_counter() - start)
    return sorted(spent)[len(spent) // 2]


def latency_timer(latency: bool | str, timer: Timer | None = None
                  ) -> Callable[[nn.Module, tuple[int, ...] | None], tuple[float, ...]]:
    """``times(module, shape)``: the seconds ``compress`` compares a candidate by, one per
    input shape timed (none without ``latency`` or a shape). Served (``latency=True``): the
    forward at the data's shape and at batch 1, where the data's batch is larger, since a
    layer can be faster at one and slower at the other; ``"training"``: forward and backward
    at the data's shape. ``timer`` replaces the clock."""
    if latency not in (False, True, "training"):
        raise SpecError(f"latency={latency!r} is not a timing",
                        hint="latency=True (served: forward without autograd) or "
                             "latency='training' (forward and backward)")
    if timer is not None and not latency:
        raise SpecError("timer= is the clock of latency=, which is off",
                        hint="give latency=True (or 'training') with it, or leave timer= out")
    training = latency == "training"

    def times(module: nn.Module, shape: tuple[int, ...] | None) -> tuple[float, ...]:
        if not latency or shape is None:
            return ()
        shapes = [tuple(shape)]
        if not training and len(shape) > 1 and shape[0] > 1:
            shapes.append((1, *shape[1:]))
        if timer is not None:
            return tuple(timer(module, s) for s in shapes)
        return tuple(timed(module, s, training=training) for s in shapes)
    return times


def drop_slower(choices: list[Any], picks: Sequence[int],
                times: Callable[[nn.Module, tuple[int, ...] | None], tuple[float, ...]],
                shapes: Mapping[str, tuple[int, ...] | None], left: Callable[[], float]
                ) -> tuple[int, int]:
    """Time each candidate the allocation ``picks`` that is not timed yet (``choices``: rows
    ``(name, dense params, [(candidate, layer)], sensitivity, dense layer's times)``): one
    slower than its dense layer at any shape timed leaves its row, the others keep their
    seconds. Only the picks are timed, never every candidate: the allocation redone without
    the slower ones is the one every candidate's timing would give. Once ``left()`` is 0
    (``max_seconds`` spent) nothing more is timed. Returns how many left, and how many picks
    stay untimed for want of time."""
    dropped = untimed = 0
    for (name, _, options, _, dense), k in zip(choices, picks):
        candidate, layer = options[k]
        if layer is None or candidate.seconds is not None or not dense:
            continue  # dense, timed before, or a layer the data never reached: untimed
        if left() <= 0:
            untimed += 1
            continue
        seconds = times(layer, shapes[name])
        if any(t > d for t, d in zip(seconds, dense)):
            del options[k]
            dropped += 1
        else:
            options[k] = (dataclasses.replace(candidate, seconds=seconds[0]), layer)
    return dropped, untimed
