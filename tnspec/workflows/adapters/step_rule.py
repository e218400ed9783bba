"""``adapt(step_rule="spectral")``: the adapter's inner cores keep their init spectral norm.

Why (docs/adapters.md, "What grows"): under Adam every element of every core moves by about
``lr`` per step, and in a chain or a ring of cores the cores then align along their bonds, so
that the product's norm climbs toward the product of the cores' norms. A tensor-train or ring
adapter's output grows by orders of magnitude in a few dozen steps where LoRA's grows a few
times. Holding each *inner* core (one with two bonds or more: a chain's or ring's middle
cores, Tucker's core) at the largest singular value it had at init, over every unfolding,
bounds that compounding; the cores at the ends of the graph stay free, as LoRA's two factors
are, and the zero core carries the adapter's magnitude.

The bound is a :mod:`torch.nn.utils.parametrize` parametrization: the optimizer moves the core's
``original``; the network reads ``original * sigma / spectral(original)``, whatever the
original's scale. The original is stored at unit RMS, so that Adam, moving each element by
about ``lr``, turns every bounded core by about ``lr`` per step, whatever its size, its rank
and the number of cores (stored at its Graph-in std, about 0.1, the cores turned about ten
times as fast, and TR and tt_lora trained worse; docs/adapters.md). ``sigma`` is a
buffer: ``adapter_state_dict`` holds it as the model's ``state_dict`` names it
(``...parametrizations.<core>.0.sigma``, beside ``...parametrizations.<core>.original``),
``adapter_config`` names the rule, and ``load_adapters`` and ``hotswap`` restore both.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ...errors import SpecError
from ...nn.module import Layer

#: the rules ``adapt(step_rule=...)`` knows (None: every core free, as built)
RULES = ("spectral",)


def check(rule: str | None) -> None:
    """A SpecError for a rule that is not None or one of :data:`RULES`."""
    if rule is not None and rule not in RULES:
        raise SpecError(f"unknown step_rule {rule!r}",
                        hint=f"choose None (every core free) or one of {', '.join(RULES)}")


def spectral(core: torch.Tensor) -> torch.Tensor:
    """The largest singular value over the core's unfoldings (each index against the rest)."""
    return torch.stack([torch.linalg.matrix_norm(core.movedim(d, 0).reshape(core.shape[d], -1),
                                                 ord=2) for d in range(core.dim())]).max()


class SpectralBound(nn.Module):
    """A core held at the spectral norm ``sigma`` (see :func:`spectral`): only its direction
    and its singular values' ratios learn."""

    def __init__(self, sigma: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("sigma", sigma.detach().clone())

    def forward(self, core: torch.Tensor) -> torch.Tensor:
        return core * (self.sigma / spectral(core).clamp_min(torch.finfo(core.dtype).tiny))


def inner(layer: Layer, zeroed: str) -> list[str]:
    """The cores of ``layer`` other than ``zeroed`` that share two indices or more with the
    network's other cores."""
    indices = {c.name: set(c.indices) for c in layer.network.cores}
    return [name for name, own in indices.items() if name != zeroed and
            len(own & set().union(*(ix for n, ix in indices.items() if n != name))) >= 2]


def bound(layer: Layer, rule: str | None, zeroed: str) -> None:
    """Apply ``rule`` to ``layer``'s inner cores, in place: each held at its present spectral
    norm, its original rescaled to unit RMS (the network reads the same values)."""
    if rule is None:
        return
    for name in inner(layer, zeroed):
        core = getattr(layer, name).detach()
        parametrize.register_parametrization(layer, name, SpectralBound(spectral(core)))
        original = getattr(layer.parametrizations, name).original
        with torch.no_grad():
            original.div_(original.pow(2).mean().sqrt().clamp_min(torch.finfo(core.dtype).tiny))


def bounds(layer: nn.Module) -> dict[str, float]:
    """``{core: sigma}`` of ``layer``'s bounded cores (empty where the rule is off)."""
    held = getattr(layer, "parametrizations", {})
    return {name: float(p[0].sigma) for name, p in held.items()
            if isinstance(p[0], SpectralBound)}


def rule_of(layer: nn.Module) -> str | None:
    """The step rule ``layer``'s cores are under (None: every core free)."""
    return RULES[0] if bounds(layer) else None


def raw(layer: nn.Module) -> dict[str, nn.Parameter]:
    """``{core: the parameter the optimizer moves}``: a bounded core's ``original``."""
    return {name.removeprefix("parametrizations.").removesuffix(".original"): p
            for name, p in layer.named_parameters()}
