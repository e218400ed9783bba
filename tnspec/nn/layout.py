"""A model-wide memory format, for ``tensorize(memory_format=...)``: every 4-D (or 5-D) parameter
and buffer converted to ``torch.channels_last`` (``channels_last_3d``), or back, and, with
``"auto"``, the layout chosen by timing a training step of the whole model both ways.

PyTorch's CPU and GPU convolutions run channels-last when their input or weight is; a network
converted end to end keeps its activations channels-last from the first conv on, with no
conversion between layers. Whether that is faster depends on the machine and the network, so
``"auto"`` measures it: forward and backward of the model on an example input, both layouts in
interleaved rounds, the other layout taken only where it leads by ``calibration.MARGIN`` and by
more than the spread of either, in two independent sets of rounds, on a machine no busier than
its CPUs (the rule of the layer's own autotuning). Timing restores the model's buffers (batch
norm statistics) and the global random state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..errors import SpecError
from ..planning import calibration
from .autotune import Timing

#: what timing reads (tests put a fake one here)
clock = time.perf_counter

logger = logging.getLogger("tnspec")


@dataclass(frozen=True)
class LayoutChoice:
    """The memory format ``tensorize`` left the model in, and why: ``asked`` (``"auto"`` or the
    format given), ``converted`` (how many tensors changed layout), ``timings`` (with "auto":
    the model's layout and the other, each with the :class:`Timing` of a training step) and
    ``note`` (why a measured lead was not taken, or "")."""

    format: str
    asked: str
    converted: int
    timings: tuple[tuple[str, Timing], ...] = ()
    note: str = ""

    def __str__(self) -> str:
        if self.asked != "auto":
            return (f"memory format: {self.format} (asked), {self.converted} tensor(s) "
                    "converted; feed it inputs in that format")
        (kept, t0), (other, t1) = self.timings
        ratio = (f"{other} took {t1.median / t0.median:.2f}x the time of {kept} "
                 f"({1e3 * t1.median:.1f} against {1e3 * t0.median:.1f} ms, medians of "
                 "interleaved training steps on the example)")
        if self.format == other:
            return (f"memory format: {other} end to end, measured faster: {ratio}; "
                    f"{self.converted} tensor(s) converted; feed it inputs as "
                    f"x.contiguous(memory_format=torch.{other})")
        why = self.note or (f"not clearly faster (a lead of {1 - calibration.MARGIN:.0%} and "
                            "beyond the rounds' spread, in two sets of rounds, is needed)")
        return f"memory format: kept {kept}: {ratio}; {why}"


def resolve(memory_format: str | torch.memory_format | None,
            example: torch.Tensor | Sequence[int] | None) -> str | None:
    """``memory_format`` checked (before the model is touched): None, ``"auto"`` (which needs
    ``example``) or a torch memory format, as its name."""
    if memory_format is None:
        if example is not None:
            raise SpecError("example= is what memory_format='auto' times; without it nothing "
                            "reads it", hint="pass memory_format='auto' or drop example=")
        return None
    names = {torch.channels_last: "channels_last", torch.channels_last_3d: "channels_last_3d",
             torch.contiguous_format: "contiguous_format"}
    if memory_format == "auto":
        if example is None:
            raise SpecError("memory_format='auto' times the model on an example input",
                            hint="pass example= (an input batch, or its shape)")
        if not isinstance(example, torch.Tensor):
            try:
                if isinstance(example, (str, bytes)):  # iterable, but not a shape
                    raise TypeError
                example = tuple(int(n) for n in example)
            except (TypeError, ValueError):
                raise SpecError(f"example={example!r}", hint="an input batch or its shape, "
                                "such as (32, 3, 224, 224)") from None
        dims = len(example.shape if isinstance(example, torch.Tensor) else example)
        if dims not in (4, 5):
            raise SpecError("memory_format='auto' chooses the layout of images (4-D input) or "
                            f"volumes (5-D); the example has {dims} dimension(s)")
        return "auto"
    name = names.get(memory_format) if isinstance(memory_format, torch.memory_format) else \
        memory_format if memory_format in names.values() else None
    if name is None:
        raise SpecError(f"memory_format={memory_format!r}",
                        hint="None (leave it), 'auto' (measured, with example=), "
                        "torch.channels_last, torch.channels_last_3d or torch.contiguous_format")
    return name


def convert(model: nn.Module, name: str) -> int:
    """Lay out every 4-D (``channels_last``) or 5-D (``channels_last_3d``) parameter and buffer
    of ``model`` in ``name``'s format, or all of them contiguous (``contiguous_format``), in
    place (the parameters stay the same objects). Unlike ``model.to(memory_format=...)`` it
    leaves tensors of other ranks alone (a 5-D core is not an error). Returns how many changed."""
    rank = {"channels_last": 4, "channels_last_3d": 5}.get(name)
    fmt = getattr(torch, name)
    changed = 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if (rank is None or t.dim() == rank) and not t.is_contiguous(memory_format=fmt):
                t.data = t.data.contiguous(memory_format=fmt)
                changed += 1
    return changed


def apply(model: nn.Module, asked: str | None,
          example: torch.Tensor | Sequence[int] | None) -> LayoutChoice | None:
    """Leave ``model`` in the layout ``asked`` (a name :func:`resolve` gave): measured for
    ``"auto"``, converted for a format, untouched for None."""
    if asked is None:
        return None
    if asked == "auto":
        assert example is not None  # resolve saw to it
        return choose(model, example)
    return LayoutChoice(asked, asked, convert(model, asked))


def choose(model: nn.Module, example: torch.Tensor | Sequence[int],
           repeats: int = 5) -> LayoutChoice:
    """Time a training step of ``model`` (forward, and backward to its trainable parameters) on
    ``example`` in its present layout and channels-last (channels-last-3d for a 5-D input),
    the input converted with it, and leave the model in the faster one by the rule above."""
    resolve("auto", example)
    x = _example(model, example)
    last = "channels_last" if x.dim() == 4 else "channels_last_3d"
    kept, other = (last, "contiguous_format") if _laid_out(model, last) else \
        ("contiguous_format", last)
    layouts = (kept, other)
    # restored afterwards: each parameter's own data (its layout), each buffer's values too
    # (a training step updates batch-norm statistics in place)
    tensors = [(p, p.data) for p in model.parameters()] + \
        [(b, b.data.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
            first = _time(model, x, layouts, repeats)
            lead = first[1].leads(first[0])
            if lead:  # one lucky stretch of rounds is not a lead: it must hold again
                again = _time(model, x, layouts, repeats)
                lead = again[1].leads(again[0])
    finally:
        for t, data in tensors:
            t.data = data
    busy = lead and calibration.busy(x.device.type)
    chosen = other if lead and not busy else kept
    changed = convert(model, chosen) if chosen != kept else 0  # kept: left as it is
    note = "other threads took the CPUs while it was timed: the lead is not trusted" \
        if busy else ""
    choice = LayoutChoice(chosen, "auto", changed, ((kept, first[0]), (other, first[1])), note)
    logger.info("%s", choice)
    return choice


def check_example(model: nn.Module, example: torch.Tensor | Sequence[int]) -> None:
    """Raise the SpecError that timing would, before the caller changes the model: run it on
    ``example`` as it is (in eval mode and without gradients, so that no batch-norm statistic
    moves; the modules' modes are restored)."""
    x = _example(model, example)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise _failed(exc) from exc
    finally:
        for m, training in modes:
            m.training = training


def _failed(exc: Exception) -> SpecError:
    return SpecError(f"memory_format='auto': the model failed on the example "
                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})",
                     hint="example= must be an input the model takes")


def _laid_out(model: nn.Module, name: str) -> bool:
    """Whether some parameter of the format's rank is laid out in it and not contiguous (a
    1x1 kernel is both)."""
    rank = 4 if name == "channels_last" else 5
    fmt = getattr(torch, name)
    return any(p.dim() == rank and p.is_contiguous(memory_format=fmt) and not p.is_contiguous()
               for p in model.parameters())


def _example(model: nn.Module, example: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The example batch: the tensor given, or a random one of the shape given (own
    generator), on the model's device and in its dtype."""
    if isinstance(example, torch.Tensor):
        return example.detach()
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    shape = tuple(int(n) for n in example)  # checked by resolve
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randn(shape, generator=gen, device=device,
                       dtype=first.dtype if first is not None else torch.float32)


def _time(model: nn.Module, x: torch.Tensor, layouts: tuple[str, str],
          repeats: int) -> list[Timing]:
    """Each layout's :class:`Timing` of a training step, in interleaved rounds after one that
    warms up (plans, autotuning, allocator), the model converted before each."""
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = {name: x.contiguous(memory_format=getattr(torch, name)) for name in layouts}
    times: list[list[float]] = [[] for _ in layouts]
    for n in range(repeats + 1):
        for name, spent in zip(layouts, times):
            convert(model, name)
            start = clock()
            try:
                with torch.enable_grad():
                    out = model(inputs[name])
                    ys = [y for y in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(y, torch.Tensor) and y.requires_grad]
                    if ys and params:
                        torch.autograd.grad(ys, params, [torch.ones_like(y) for y in ys],
                                            allow_unused=True)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise _failed(exc) from exc
            if x.is_cuda:
                torch.cuda.synchronize()
            if n:
                spent.append(clock() - start)
    return [Timing.of(t) for t in times]
