"""``compress(heal=steps)``: a short distillation of the compressed model toward the original's
outputs on the data ``compress`` was given (CompactifAI's healing pass, without labels).

Only the new layers' parameters train (Adam; those frozen as the layer they replaced was stay
frozen); the rest of the model stays as it is, frozen
for the pass and its ``requires_grad`` flags put back after. The loss on a batch is the squared
distance of the model's flattened output to the original's, relative to the original's size.
The model runs in eval mode (no dropout, no batch statistics updated). The pass ends after
``steps`` steps or when the time is spent; the new layers then keep whichever is lower on all
batches, the healed parameters or those they started from, and an error or Ctrl-C puts back
those they started from before it propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..feeding import Runner, call, evaluated
from .observe import flat


@dataclass(frozen=True)
class Healed:
    """What the healing pass did: steps run, the loss on the data before and after."""

    steps: int
    before: float
    after: float
    kept: bool  # False: the pass did not lower the loss (or ran no step): nothing changed
    why: str = ""  # where it ran no step, why


def heal(model: nn.Module, layers: list[nn.Module], data: list[Any],
         targets: list[torch.Tensor], run: Runner | None, steps: int, lr: float,
         left: Callable[[], float]) -> Healed:
    """Train the parameters of ``layers`` (set in ``model``) for at most ``steps`` Adam steps
    of learning rate ``lr``, cycling over ``data``, toward ``targets`` (the original model's
    flat outputs, one per batch), while ``left()`` (seconds) is positive."""
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    before = _loss(model, data, targets, run)
    if not params:  # no layer replaced, or each frozen as the one it replaced was
        return Healed(0, before, before, False, "nothing to train (no layer replaced, or each "
                      "frozen as the layer it replaced was)")
    flags = {p: p.requires_grad for p in model.parameters()}
    start = [p.detach().clone() for p in params]
    done = 0
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=lr)
        with evaluated(model), torch.enable_grad():
            while done < steps and left() > 0:
                batch, target = data[done % len(data)], targets[done % len(data)]
                loss = _distance(flat(call(model, batch, run)), target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                done += 1
        if not done:
            return Healed(0, before, before, False, "max_seconds was spent before a step")
        after = _loss(model, data, targets, run)
        kept = after < before
        if not kept:
            _put_back(params, start)
        return Healed(done, before, after if kept else before, kept)
    except BaseException:
        _put_back(params, start)
        raise
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)


def _distance(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-30)


def _loss(model: nn.Module, data: list[Any], targets: list[torch.Tensor],
          run: Runner | None) -> float:
    """The mean relative squared distance to the targets over all batches."""
    with evaluated(model):
        return sum(float(_distance(flat(call(model, b, run)), t))
                   for b, t in zip(data, targets)) / len(data)


def _put_back(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
