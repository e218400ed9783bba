"""What a model's layers see: the inputs that reach them (recorded by forward pre-hooks, as the
second moment ``tnspec.fit.moments`` builds) and how much the model's output depends on each
layer's output (its sensitivity). The model is run in eval mode without gradients; its
train/eval modes are restored after, whatever happens."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree
from torch import nn
from torch.nn import functional as F

from ...errors import SpecError
from ...fit import moments
from ..dense_layers import is_linear, weight_of
from ..feeding import Runner, call, evaluated
from . import replay

def batches(data: Any, max_batches: int, run: Runner | None = None) -> list[Any]:
    """At most ``max_batches`` batches of ``data`` (a tensor is one batch), each checked to be
    something :func:`call` can feed the model."""
    if isinstance(data, (torch.Tensor, Mapping)):
        return [data]
    out = []
    for batch in data:
        if run is None and not isinstance(batch, (torch.Tensor, tuple, list, Mapping)):
            raise SpecError(f"a batch of data= is a {type(batch).__name__}",
                            hint="batches are tensors (model(x)), tuples (model(*batch)) or "
                            "dicts (model(**batch)); for anything else pass run=lambda model, "
                            "batch: ...")
        out.append(batch)
        if len(out) >= max_batches:
            break
    return out


def inputs(model: nn.Module, layers: list[tuple[str, nn.Module]], data: list[Any],
           max_batches: int, run: Runner | None = None,
           called: Mapping[str, nn.Module] | None = None,
           left: Callable[[], float] | None = None
           ) -> tuple[dict[str, tuple[tuple[int, ...], torch.Tensor]], int]:
    """``{layer: (an input shape it saw, the metric factor of its inputs)}``, in the order
    the model first calls them (layers it never reaches left out), and how many batches were
    read. ``called``: the module the model calls for a layer where it is not the layer itself
    (the layer replacing it, during sequential refits). ``left()``: the seconds left; once it
    is 0 no further batch is read (the first always is)."""
    rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in layers}
    shapes: dict[str, tuple[int, ...]] = {}

    def hook(name: str, module: nn.Module) -> Callable:
        def record(_: nn.Module, args: tuple) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return  # called with keywords: nothing to record
            x = args[0].detach()
            shapes.setdefault(name, tuple(x.shape))
            keep = max(moments.MAX_ROWS // max_batches, 1)
            # a copy (a later in-place op may change x), in x's dtype: moments.factor decides
            rows[name].append(sampled(module, x, keep, len(rows[name])).clone())
        return record
    read = _run(model, layers, data, hook, run, called or {}, left)
    found = dict(layers)
    out = {}
    for name, shape in shapes.items():  # in the order called
        if rows[name]:
            try:
                out[name] = shape, moments.factor(torch.cat(rows[name]),
                                                  getattr(found[name], "groups", 1))
            except SpecError as exc:
                raise SpecError(f"layer {name!r}: {exc.message}", hint=exc.hint) from None
    return out, read


def sampled(module: nn.Module, x: torch.Tensor, keep: int, seed: int) -> torch.Tensor:
    """``(rows, P)``: what the dense ``module`` reads from its input ``x`` (a linear layer's
    rows, a conv's patches), at most ``keep`` of them: a subset drawn by ``seed`` (the same
    rows for the same shape and seed)."""
    if is_linear(module):
        r = x.reshape(-1, x.shape[-1])
        return r[moments.subset(r.shape[0], keep, seed).to(r.device)] if r.shape[0] > keep \
            else r
    x = x if x.dim() == len(module.kernel_size) + 2 else x.unsqueeze(0)
    return moments.patches(x, module.kernel_size, module.stride, _padding(module),
                           module.dilation, keep, seed)  # sampled before any patch is copied


def _padding(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module.padding, str):  # "same" / "valid", symmetric where tnspec takes it
        pads = module._reversed_padding_repeated_twice
        return tuple(pads[0::2][::-1])
    return tuple(module.padding)


def _run(model: nn.Module, layers: list[tuple[str, nn.Module]], data: list[Any],
         make_hook: Callable, run: Runner | None, called: Mapping[str, nn.Module],
         left: Callable[[], float] | None = None) -> int:
    """Feed the batches with the hooks on; how many were fed (at least one, then while
    ``left()`` is above 0)."""
    handles = [called.get(n, m).register_forward_pre_hook(make_hook(n, m)) for n, m in layers]
    fed = 0
    try:
        with evaluated(model):
            for batch in data:
                if fed and left is not None and left() <= 0:
                    break
                call(model, batch, run)
                fed += 1
    finally:
        for h in handles:
            h.remove()
    return fed


def sensitivities(model: nn.Module, layers: list[tuple[str, nn.Module]], data: list[Any],
                  run: Runner | None = None, noise: float = 0.01,
                  called: Mapping[str, nn.Module] | None = None, max_batches: int = 4,
                  left: Callable[[], float] | None = None) -> dict[str, float]:
    """Per layer: ``||f(x; layer output + e) - f(x)|| / (noise ||f(x)||)``, where ``e`` is
    what a random weight (Gaussian, drawn once per layer by its own generator, random signs
    on the channels for each sample: :func:`_random_term`) computes from the layer's input,
    scaled to ``noise`` times the output's rms: the norms summed over the
    first ``max_batches`` batches (``called`` as for :func:`inputs`). A fit's error is such a
    term, ``(W - W_fit) x``: correlated across the positions and tokens as the inputs are.
    Noise drawn independently for each output element is not, and a mean or average pool
    after the layer averages it away by the square root of the positions pooled, which a
    fit's error is not (MobileNetV2's last 1x1 conv, pooled over 3x3 positions: 0.34 so,
    0.92 with the random weight; that allocation cut it to a tenth of its parameters).
    ``left()``: the seconds left; once it is 0 no further batch is taken (the first always
    is) and the layers not reached are left out. The blocks that return before a layer is
    first called are not run again for it: they hand back what they returned in the
    unperturbed run (``replay``), which is what they would compute."""
    sample: list[Any] = []
    references: list[torch.Tensor] = []
    recorded: list[replay.Recording] = []
    moved = {name: 0.0 for name, _ in layers}
    reached = {name: (called or {}).get(name, module) for name, module in layers}
    with evaluated(model):
        for x in data[:max_batches]:
            if sample and left is not None and left() <= 0:
                break
            sample.append(x)
            used = sum(r.bytes for r in recorded)
            with replay.recording(model, reached, replay.MAX_BYTES - used) as rec:
                references.append(flat(call(model, x, run)))
            rec.prune(list(reached))
            recorded.append(rec)
        size = sum(float(r.pow(2).sum()) for r in references)
        for name, module in layers:
            if left is not None and left() <= 0:
                del moved[name]
                continue
            term = _random_term(module, torch.Generator().manual_seed(0))

            def perturb(_: nn.Module, args: tuple, y: torch.Tensor, term=term
                        ) -> torch.Tensor:
                e = term(args[0])
                return y + noise * y.pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(
                    1e-30) * e
            handle = (called or {}).get(name, module).register_forward_hook(perturb)
            try:
                for x, reference, rec in zip(sample, references, recorded):
                    with replay.replaying(rec.before(name)):  # what ran before it, as it ran
                        y = flat(call(model, x, run))
                    moved[name] += float((y - reference).pow(2).sum())
            finally:
                handle.remove()
    return {name: (m / (size + 1e-60)) ** 0.5 / noise for name, m in moved.items()}


def _random_term(module: nn.Module, gen: torch.Generator
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the plain layer ``module`` computes from an input with a Gaussian weight of its
    weight's shape in place of its own and no bias (a conv with its own padding, stride and
    groups), its input and output channels multiplied by random signs drawn for each sample
    (the first axis). One weight's term lands in a few of the output's directions, and where
    the model's output reads few (a small head), one draw measured a layer anywhere within a
    factor of 2.5; the signs make each sample's term independent of the others' (the
    expectation is the same), so a batch averages as many draws as it holds samples."""
    shape = weight_of(module).shape
    wrong = torch.randn(shape, generator=gen, dtype=torch.float64).to(module.weight)
    linear = is_linear(module)
    # the channels' axis, and how many axes an input without a batch axis has
    axis, unbatched = (-1, 1) if linear else (-1 - len(module.kernel_size),
                                              1 + len(module.kernel_size))

    def signs(t: torch.Tensor) -> torch.Tensor:
        drawn = [1] * t.dim()
        drawn[axis] = t.shape[axis]
        if t.dim() > unbatched:
            drawn[0] = t.shape[0]
        return (torch.randint(0, 2, drawn, generator=gen) * 2 - 1).to(t)

    def term(x: torch.Tensor) -> torch.Tensor:
        x = x * signs(x)
        e = F.linear(x, wrong) if linear else module._conv_forward(x, wrong, None)
        return e * signs(e)
    return term


def outputs(model: nn.Module, data: list[Any], run: Runner | None = None
            ) -> list[torch.Tensor]:
    """The model's output on each batch, flat (what healing distils toward)."""
    with evaluated(model):
        return [flat(call(model, x, run)) for x in data]


def flat(output: Any) -> torch.Tensor:
    """A model's output (a tensor, or tensors in tuples, lists, dicts) as one flat tensor."""
    leaves = [t.reshape(-1).float() for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor)]
    if not leaves:
        raise SpecError(f"the model's output ({type(output).__name__}) holds no tensor",
                        hint="compress measures sensitivities on the model's output")
    return torch.cat(leaves)


def filled(measured: dict[str, float], layers: list[tuple[str, nn.Module]]
           ) -> tuple[dict[str, float], int]:
    """The sensitivities with the median of the measured ones for each layer left unmeasured,
    and how many those are."""
    missing = [name for name, _ in layers if name not in measured]
    if missing and measured:
        middle = sorted(measured.values())[len(measured) // 2]
        measured = {**measured, **{name: middle for name in missing}}
    return measured, len(missing) if measured else 0
