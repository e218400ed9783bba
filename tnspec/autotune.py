"""Autotuning: a layer's candidate contraction orders for one input shape, timed forward and
backward on the cores' device, the fastest kept (and remembered in the calibration cache).

Orders whose predicted costs are close are not told apart by any cost model, so where
calibration is on a layer's first call for a shape times its distinct candidates (auto's,
greedy's, dense-first's, left-to-right's; for a contiguous 2-D conv input also the model's
order run channels-last inside) in interleaved rounds and runs the fastest. ``Layer`` calls
these functions with itself; they read its network, sizes, cores and planning settings.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from . import calibration, runtime
from .errors import SpecError
from .plan import Plan, plan
from .shapes import bind_shape


def fastest(layer: Any, shape: tuple[int, ...], channels_last: bool = False,
            repeats: int = 5) -> tuple[type, Plan, str]:
    """The fastest distinct candidate order for ``shape``, timed forward and backward on
    the cores' device, or recalled from the calibration cache where a process timed the
    same candidates' code before (where another build of tnspec lowers them differently,
    they are timed again). For a 2-D conv's input that is not channels-last, the model's
    order run channels-last inside is a candidate too (``lower(..., convert=True)``). The
    model's order stays unless another is measured at least 10% faster
    (``calibration.MARGIN``), in the first rounds and again in as many more
    against the model's order alone; an order the cost model prices at more than
    ``calibration.PRUNE`` times the cheapest is not timed. A lead measured while as many
    other threads ran as there are CPUs is used but not kept in the cache; a recalled order
    other than the model's is timed against it once a process (``RECHECK_REPEATS`` rounds),
    and where its lead is gone the model's order runs and replaces it in the cache, so that
    a choice measured on a busy machine does not persist. Timing uses its own random
    generator and gradients, so that the global RNG, ``no_grad``, ``inference_mode`` and
    frozen cores are left as they are. Returns the class, the plan whose order it runs,
    and what was done in words."""
    bound = bind_shape(layer.network, shape)
    plans = []
    for name in ("auto", "greedy", "dense-first", "left-to-right"):
        try:
            plans.append(plan(bound, name, max_bytes=layer.max_bytes,
                              itemsize=layer._itemsize(), **layer._measured()))
        except SpecError:
            if name == "auto":
                raise  # the layer's own error for this shape
    predicted = [sum(s.seconds for s in p.steps) for p in plans]
    candidates: dict[str, tuple[type, Plan]] = {}  # distinct orders: their class and plan
    for i, candidate in enumerate(plans):
        if i and predicted[i] > calibration.PRUNE * min(predicted):
            continue  # not worth timing (see PRUNE); the model's own order always is
        key = repr(tuple((s.left.indices, s.right.indices, s.op) for s in candidate.steps))
        if key not in candidates:
            candidates[key] = (runtime.layer_class(layer.network, candidate, channels_last),
                               candidate)
    if layer._image and not channels_last:
        # the model's order run channels-last inside, the input and result converted
        key = "channels-last inside, " + next(iter(candidates))
        candidates[key] = (runtime.layer_class(layer.network, plans[0], convert=True), plans[0])
    if len(candidates) == 1:
        return (*next(iter(candidates.values())), "one candidate order, nothing timed")
    sizes = ", ".join(f"{k}={v}" for k, v in sorted(layer.sizes.items()))
    what = f"order of {layer.spec} ({sizes}) for {list(layer._shape_key(shape))}" + \
        (" channels_last" if channels_last else "")
    device, dtype = layer._where()
    kept = calibration.measures(device)
    found = calibration.recall(device, dtype, what) if kept else None
    keys, classes = list(candidates), [cls for cls, _ in candidates.values()]
    code = runtime.fingerprint(*classes)
    if found is not None and found.get("order") in candidates and found.get("code") == code:
        # timed among the very same code
        k = keys.index(found["order"])
        if k and what not in calibration.rechecked:
            # another order than the model's: it must still lead here, once a process
            calibration.rechecked.add(what)
            again = layer._time([classes[0], classes[k]], shape, RECHECK_REPEATS,
                                channels_last)
            if not again[1] < calibration.MARGIN * again[0]:
                if not _busy(device):  # on a busy machine: not kept either way
                    calibration.remember(device, dtype, what, {
                        **found, "order": keys[0], "seconds": again[0], "when": time.time(),
                        "dropped": f"{keys[k]} led no more ({again[1] / again[0]:.2f}x)"})
                return (*candidates[keys[0]], "recalled order re-checked, led no more: the "
                        "model's order runs")
        return (*candidates[found["order"]], "order recalled from the calibration cache")
    seconds = layer._time(classes, shape, repeats, channels_last)
    best = min(range(len(seconds)), key=seconds.__getitem__)
    if best and seconds[best] < calibration.MARGIN * seconds[0]:
        # a lead this size can be one unlucky stretch of rounds: it must hold in new ones
        again = layer._time([classes[0], classes[best]], shape, repeats, channels_last)
        seconds[best] = max(seconds[best], again[1] * seconds[0] / again[0])
    if seconds[best] >= calibration.MARGIN * seconds[0]:
        best = 0  # the model's order, which `tnspec compile` writes, unless clearly slower
    busy = bool(best) and _busy(device)
    if kept and not busy:
        # a lead measured while other threads took the CPUs runs here but is not kept: the
        # next process times again (the model's order is kept, busy or not: it is the default)
        calibration.remember(device, dtype, what, {
            "order": keys[best], "code": code, "seconds": seconds[best],
            "candidates": dict(zip(keys, seconds)), "when": time.time()})
    return (*list(candidates.values())[best],
            f"timed {len(classes)} candidate orders forward and backward" +
            (" (other threads took the CPUs: the choice is not kept)" if busy else ""))


def _busy(device: torch.device) -> bool:
    """Whether as many other threads run as there are CPUs (a CPU device only)."""
    others = calibration.others_running() if device.type == "cpu" else None
    return others is not None and others >= (os.cpu_count() or 1)


#: rounds of the once-a-process check of a recalled order that is not the model's
RECHECK_REPEATS = 3


def time_orders(layer: Any, classes: list[type], shape: tuple[int, ...], repeats: int,
                channels_last: bool = False) -> list[float]:
    """Median seconds of each class's forward and backward on a random input of
    ``shape`` (laid out channels-last if asked), in interleaved rounds."""
    first = next(iter(layer.parameters()))
    gen = torch.Generator(device=first.device).manual_seed(0)
    times: list[list[float]] = [[] for _ in classes]
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.randn(shape, dtype=first.dtype, device=first.device, generator=gen)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        inputs = [x] + [p for p in layer.parameters() if p.requires_grad]
        for n in range(repeats + 1):  # the first round warms up
            for cls, spent in zip(classes, times):
                start = time.perf_counter()
                y = cls.forward(layer, x)
                # a dense gradient in the output's layout, as the next layer gives
                grad = torch.ones_like(y)
                torch.autograd.grad(y, inputs, grad)
                if x.is_cuda:
                    torch.cuda.synchronize()
                if n:
                    spent.append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]
