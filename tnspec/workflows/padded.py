"""Convs whose own forward adds a step to the conv of their weight, read as that conv.

Checkpoints ported from TensorFlow hold every conv as an ``nn.Conv2d`` subclass that pads
"same" in its forward (EfficientNet-PyTorch's ``Conv2dStaticSamePadding`` and
``Conv2dDynamicSamePadding``, timm's ``Conv2dSame``); BiT and NF-nets standardize the weight
per output channel in forward (timm's ``StdConv2d``). What such a layer computes is found by
trying, on random inputs of two sizes (an even and an odd one), the steps that can be
expressed:

- its configured padding, or "same" on top of it, symmetric: a plain conv, nothing around it;
- a fixed pad before a conv of padding 0 (asymmetric where "same" was worked out once, for
  one image size, at stride 2);
- TensorFlow's "same" pad worked out for each input's size, before a conv of padding 0;

each with the stored weight, or the weight standardized per output channel
(``(W - mean) / sqrt(var + eps)`` or ``/ (std + eps)``, the layer's ``eps`` or a usual
one). The first that matches
is a :class:`Reading`: the plain conv the workflows fit, adapt and time (the stored
parameters themselves, or a copy of the standardized weight), and the :class:`SamePad` a
replacement keeps in front of it (:class:`Padded`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: the epsilons tried for a standardized weight, after the layer's own ``eps``
EPSILONS = (1e-5, 1e-6, 1e-8, 1e-10, 0.0)


@dataclass(frozen=True)
class SamePad:
    """The zero pad a conv subclass makes in its forward before its conv: ``fixed``
    (``F.pad``'s order, last axis first) where it does not depend on the input, else
    TensorFlow's "same" for each input's size, from ``kernel``, ``stride`` and ``dilation``
    (more on the right where the total is odd)."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    fixed: tuple[int, ...] | None = None

    def amounts(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """``F.pad``'s amounts for an input of spatial ``sizes``."""
        if self.fixed is not None:
            return self.fixed
        pads: list[int] = []
        for n, k, s, d in zip(reversed(sizes), reversed(self.kernel), reversed(self.stride),
                              reversed(self.dilation)):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads += [total // 2, total - total // 2]
        return tuple(pads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        pads = self.amounts(tuple(x.shape[-len(self.kernel):]))
        return F.pad(x, pads) if any(pads) else x

    def __str__(self) -> str:
        if self.fixed is not None:
            return f"a fixed pad {self.fixed}"
        return "TensorFlow's 'same' pad for each input's size"


class Padded(nn.Module):
    """``layer`` run on its input padded by ``pad`` first: what replaces (or holds the base
    of) a conv that padded in its own forward, so that the pad stays around the new layer.
    ``weight`` and ``bias`` are the layer's."""

    def __init__(self, pad: SamePad, layer: nn.Module) -> None:
        super().__init__()
        self.pad, self.layer = pad, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.pad(x))

    @property
    def weight(self) -> torch.Tensor:
        """The layer's weight."""
        return self.layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The layer's bias."""
        return self.layer.bias

    def extra_repr(self) -> str:
        return str(self.pad)


@dataclass(frozen=True)
class Reading:
    """What a dense layer computes as a plain layer: ``layer`` (the module itself where its
    forward is the base class's) run on its input padded by ``pad`` (None: as it comes);
    ``standardized`` where ``layer`` holds a copy of the weight standardized as the
    module's forward does."""

    layer: nn.Module
    pad: SamePad | None = None
    standardized: bool = False

    def around(self, new: nn.Module) -> nn.Module:
        """``new`` (a layer computing what :attr:`layer` does) with the pad kept in front."""
        return new if self.pad is None else Padded(self.pad, new)

    def base(self, original: nn.Module) -> nn.Module:
        """What an adapted layer keeps as its base: ``original`` itself where nothing is
        padded before its conv (so that it computes what it did, bit for bit), else the
        plain conv in a :class:`Padded`."""
        return original if self.pad is None else Padded(self.pad, self.layer)

    def note(self, original: nn.Module, verb: str) -> str:
        """The report's words for a subclass read this way (empty for a plain layer)."""
        if self.layer is original:
            return ""
        what = []
        if self.pad is not None:
            what.append(f"pads in its forward ({self.pad})")
        elif not self.standardized:  # "same" made symmetric: the plain conv's own padding
            what.append("pads in its forward")
        if self.standardized:
            what.append("standardizes its weight in its forward (the standardized weight is "
                        "what was read; the new layer does not standardize again)")
        return f"a {type(original).__name__} that {' and '.join(what)}: {verb} the plain conv " \
            "it computes"


def reading(module: nn.Module, base: type) -> Reading | None:
    """``module`` (an ``nn.ConvNd`` subclass of type ``base`` overriding its forward) as a
    plain conv: the first expressible reading that computes what it does on random inputs of
    two sizes; None where none does."""
    if module.padding_mode != "zeros" or isinstance(module.padding, str) or \
            module.transposed or module.weight.is_meta:
        return None
    weight = module.weight.detach()
    dims = weight.dim() - 2
    conv = getattr(F, f"conv{dims}d")
    same = tuple(d * (k - 1) for k, d in zip(module.kernel_size, module.dilation))
    configured = tuple(module.padding)
    gen = torch.Generator(device=weight.device).manual_seed(0)
    side = max(same) + 2 * max(module.stride) + 3
    inputs = [torch.randn(1, module.in_channels, *([n] * dims), generator=gen,
                          device=weight.device, dtype=weight.dtype) for n in (side, side + 1)]
    try:
        with torch.no_grad():
            wanted = [module(x) for x in inputs]
    except Exception:  # noqa: BLE001 (its own forward fails on a probe: not a plain conv)
        return None
    weights = _weights(module, weight)
    for pad, padding in _pads(module, same, configured):
        best = None  # the closest weight: standardized with nearby epsilons all pass
        for w, standardized in weights:
            with torch.no_grad():
                got = [conv(x if pad is None else pad(x), w, module.bias, module.stride,
                            padding, module.dilation, module.groups) for x in inputs]
            if not all(g.shape == t.shape for g, t in zip(got, wanted)):
                break  # this pad gives other sizes, whatever the weight
            if all(torch.allclose(g, t, rtol=1e-4, atol=1e-5 * float(t.abs().max()) + 1e-12)
                   for g, t in zip(got, wanted)):
                error = max(float((g - t).abs().max() / (t.abs().max() + 1e-30))
                            for g, t in zip(got, wanted))
                if best is None or error < best[0]:
                    best = (error, w, standardized)
                if not standardized:
                    break  # the stored weight: nothing closer to look for
        if best is not None:
            return Reading(_plain(module, base, padding, best[1] if best[2] else None), pad,
                           best[2])
    return None


def _pads(module: nn.Module, same: tuple[int, ...], configured: tuple[int, ...]
          ) -> list[tuple[SamePad | None, tuple[int, ...]]]:
    """The candidate ``(pad before, the conv's padding)``, simplest first."""
    found: list[tuple[SamePad | None, tuple[int, ...]]] = [(None, configured)]
    if all(s % 2 == 0 for s in same) and any(same):
        found.append((None, tuple(p + s // 2 for p, s in zip(configured, same))))
    if any(configured):
        return found
    kernel, stride, dilation = (tuple(v) for v in
                                (module.kernel_size, module.stride, module.dilation))
    zero = tuple(0 for _ in same)
    # "same" worked out once for some image size: its total lies between eff_k - s and
    # eff_k - 1 on each axis, the odd one out on the right
    per_axis = [[(t // 2, t - t // 2) for t in range(max(e + 1 - s, 0), e + 1)]
                for e, s in zip(same, stride)]
    for combo in itertools.product(*reversed(per_axis)):  # F.pad's order: last axis first
        fixed = tuple(v for pair in combo for v in pair)
        if any(fixed) and any(a != b for a, b in combo):
            found.append((SamePad(kernel, stride, dilation, fixed), zero))
    found.append((SamePad(kernel, stride, dilation), zero))
    return found


def _weights(module: nn.Module, weight: torch.Tensor
             ) -> list[tuple[torch.Tensor, bool]]:
    """The stored weight, then the weight standardized per output channel with the layer's
    ``eps`` and the usual ones: over ``sqrt(var + eps)`` (timm's, BiT's) or ``std + eps``,
    with the biased and the unbiased variance."""
    found = [(weight, False)]
    own = getattr(module, "eps", None)
    epsilons = ([float(own)] if isinstance(own, (int, float)) else []) + list(EPSILONS)
    flat = weight.reshape(weight.shape[0], -1).double()
    for unbiased in (False, True):
        var, mean = torch.var_mean(flat, dim=1, keepdim=True, correction=int(unbiased))
        for eps in dict.fromkeys(epsilons):
            for scale in (torch.sqrt(var + eps), torch.sqrt(var) + eps):
                found.append((((flat - mean) / scale).reshape(weight.shape).to(weight.dtype),
                              True))
    return found


def _plain(module: nn.Module, base: type, padding: tuple[int, ...],
           standardized: torch.Tensor | None) -> nn.Module:
    """A ``base`` conv of ``module``'s geometry and ``padding`` holding its parameters (or a
    copy of its standardized weight, of the same flags)."""
    plain = base(module.in_channels, module.out_channels, module.kernel_size,
                 stride=module.stride, padding=padding, dilation=module.dilation,
                 groups=module.groups, bias=module.bias is not None, device="meta")
    plain.weight = module.weight if standardized is None else \
        nn.Parameter(standardized.clone(), requires_grad=module.weight.requires_grad)
    plain.bias = module.bias
    plain.train(module.training)
    return plain
