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
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SpecError
from ..shapes import bind_shape
from ..planning import calibration, choices
from ..planning.lookup import LookupPlan, lookup_candidates
from ..planning.plan import Plan, plan
from ..emit import runtime


def fastest(layer: Any, shape: tuple[int, ...], channels_last: bool = False,
            repeats: int = 5) -> tuple[type, Plan, str]:
    """The fastest distinct candidate order for ``shape``, timed forward and backward on the
    cores' device (the forward alone for a layer called without autograd, kept apart in the
    cache: a served layer's order), or recalled from the calibration cache where a process
    timed the same candidates' code before (where another build of tnspec lowers them
    differently, they are timed again). For a 2-D conv's input that is not channels-last, the
    model's order run channels-last inside is a candidate too (``lower(..., convert=True)``);
    for an index input the candidates are the cuts of its modes (``lookup_candidates``). The
    model's order stays unless another leads it (:meth:`Timing.leads`: by 10%,
    ``calibration.MARGIN``, and by more than the spread of either) in two independent sets of
    rounds, the second against the model's order alone; an order the cost model prices at more
    than ``calibration.PRUNE`` times the cheapest is not timed, except dense-first (the kernel
    rebuilt, then the dense op: what the dense layer costs, and a floor where the model
    overprices it). The cache entry keeps every candidate's median and spread, the machine's
    load and threads, and when; it is keyed by the network with its names made canonical
    (``choices.canonical``), so that the same network under other names recalls it. A lead
    measured while as many other threads ran as there are CPUs is used but not kept in the
    cache; a recalled order other than the model's is timed against it once a process
    (``RECHECK_REPEATS`` rounds), and where its lead is gone the model's order runs and
    replaces it in the cache, so that a choice measured on a busy machine does not persist.
    Timing uses its own random generator and gradients, so that the global RNG, ``no_grad``,
    ``inference_mode`` and frozen cores are left as they are. Returns the class, the plan whose
    order it runs, and what was done in words."""
    bound = bind_shape(layer.network, shape)
    measured = layer._measured(channels_last)
    plans: list[Any] = []
    if layer.network.lookup:  # an index input: the cuts of its modes into gathered runs
        plans = lookup_candidates(bound, measured["model"], max_bytes=layer.max_bytes,
                                  itemsize=layer._itemsize())
        predicted = [measured["model"].einsum(p.flops // 2, p.elements) for p in plans]
    else:
        for name in ("auto", "greedy", "dense-first", "left-to-right"):
            try:
                plans.append(plan(bound, name, max_bytes=layer.max_bytes,
                                  itemsize=layer._itemsize(), **measured))
            except SpecError:
                if name == "auto":
                    raise  # the layer's own error for this shape
        predicted = [sum(s.seconds for s in p.steps) for p in plans]
    candidates: dict[str, tuple[type, Plan]] = {}  # distinct orders: their class and plan
    for i, candidate in enumerate(plans):
        if i and predicted[i] > calibration.PRUNE * min(predicted) and \
                candidate.planner != "dense-first":
            # not worth timing (see PRUNE); the model's own order always is, and so is the
            # reconstruct-first one, which costs what the dense layer would
            continue
        key = _describe(candidate)
        if key not in candidates:
            candidates[key] = (runtime.layer_class(layer.network, candidate, channels_last),
                               candidate)
    if layer._image and not channels_last:
        # the model's order run channels-last inside, the input and result converted
        key = "channels-last inside, " + next(iter(candidates))
        candidates[key] = (runtime.layer_class(layer.network, plans[0], convert=True), plans[0])
    if len(candidates) == 1:
        return (*next(iter(candidates.values())), "one candidate order, nothing timed")
    canon = choices.canonical(layer.spec)
    # in order of first appearance in the spec (the canonical names' order)
    sizes = ", ".join(f"{canon(k)}={v}" for k, v in sorted(
        layer.sizes.items(), key=lambda kv: int(canon(kv[0])[1:])))
    served = not torch.is_grad_enabled()  # timed forward alone, and kept apart
    what = f"order of {canon(layer.spec)} ({sizes}) for {list(layer._shape_key(shape))}" + \
        (" channels_last" if channels_last else "") + (" served" if served else "")
    device, dtype = layer._where()
    kept = calibration.measures(device)
    found = calibration.recall(device, dtype, what) if kept else None
    keys = [canon(k) for k in candidates]
    classes = [cls for cls, _ in candidates.values()]
    pairs = list(candidates.values())
    code = runtime.fingerprint(*classes, rename=canon)
    if found is not None and found.get("order") in keys and found.get("code") == code:
        # timed among the very same code
        k = keys.index(found["order"])
        if k and what not in calibration.rechecked:
            # another order than the model's: it must still lead here, once a process
            calibration.rechecked.add(what)
            again = layer._time([classes[0], classes[k]], shape, RECHECK_REPEATS,
                                channels_last)
            if not again[1].median < calibration.MARGIN * again[0].median:
                if not calibration.busy(device.type):  # on a busy machine: not kept either way
                    calibration.remember(device, dtype, what, {
                        **found, "order": keys[0], "seconds": again[0].median,
                        "when": time.time(), "dropped": f"{keys[k]} led no more "
                        f"({again[1].median / again[0].median:.2f}x)"})
                return (*pairs[0], "recalled order re-checked, led no more: the model's "
                        "order runs")
        return (*pairs[k], "order recalled from the calibration cache")
    conditions = _conditions(device)
    timings = layer._time(classes, shape, repeats, channels_last)
    best = min(range(len(timings)), key=lambda i: timings[i].median)
    if best and timings[best].leads(timings[0]):
        # a lead can be one unlucky stretch of rounds: it must hold in a new set of them
        again = layer._time([classes[0], classes[best]], shape, repeats, channels_last)
        if not again[1].leads(again[0]):
            best = 0
    else:
        best = 0  # the model's order, which `tnspec compile` writes, unless clearly faster
    busy = bool(best) and calibration.busy(device.type)
    if kept and not busy:
        # a lead measured while other threads took the CPUs runs here but is not kept: the
        # next process times again (the model's order is kept, busy or not: it is the default)
        calibration.remember(device, dtype, what, {
            "order": keys[best], "code": code, "seconds": timings[best].median,
            "spec": layer.spec,  # as the layer that timed it wrote it (the key is canonical)
            "candidates": {k: {"median": t.median, "spread": t.spread}
                           for k, t in zip(keys, timings)},
            "conditions": conditions, "when": time.time()})
    return (*pairs[best], f"timed {len(classes)} candidate "
            f"{'cuts' if layer.network.lookup else 'orders'} " +
            ("forward alone" if served else "forward and backward") +
            (" (other threads took the CPUs: the choice is not kept)" if busy else ""))


@dataclass(frozen=True)
class Timing:
    """A candidate's forward and backward time over interleaved rounds: the median and the
    spread (upper quartile less lower quartile), in seconds."""

    median: float
    spread: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        """The median and spread of repeated timings."""
        t = sorted(seconds)
        return cls(t[len(t) // 2], t[(3 * len(t)) // 4] - t[len(t) // 4])

    def leads(self, other: Timing) -> bool:
        """Whether this is clearly faster than ``other``: by ``calibration.MARGIN``, and by
        more than either's spread (a lead inside the spread is noise)."""
        lead = other.median - self.median
        return self.median < calibration.MARGIN * other.median and \
            lead > max(self.spread, other.spread)


def _conditions(device: torch.device) -> dict[str, Any]:
    """What the machine was like when a choice was timed: 1-minute load, other threads, CPUs
    and torch's threads."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    others = calibration.others_running() if device.type == "cpu" else None
    return {"load": None if load is None else round(load, 2), "others": others,
            "cpus": os.cpu_count(), "threads": torch.get_num_threads()}


def _describe(candidate: Any) -> str:
    """A candidate's key among its layer's: its steps, or the runs of a lookup's cut."""
    if isinstance(candidate, LookupPlan):
        return "cut " + " | ".join(" ".join(r.modes) for r in candidate.runs)
    return repr(tuple((s.left.indices, s.right.indices, s.op) for s in candidate.steps))


#: rounds of the once-a-process check of a recalled order that is not the model's
RECHECK_REPEATS = 3

#: what timing reads on the host (tests put a fake clock here)
clock = time.perf_counter


class HostWatch:
    """A step's time as the host sees it, the device synchronized at its end: on a CPU, the
    step itself."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.started = 0.0

    def start(self) -> None:
        self.started = clock()

    def stop(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return clock() - self.started


class DeviceWatch:
    """A step's time on a GPU with the launch cost taken out, as a captured (CUDA-graph) or
    compiled step runs it: the stream is held busy (``torch.cuda._sleep``) while the host
    queues the step, so the events around it time its kernels back to back. Launches are
    host time that capture removes, and timing them made the orders of fewer, larger kernels
    (``dense-first``) lose where they ran the step 1.3-1.7x faster on the device. The sleep
    grows to outlast the queueing measured in the warm-up round."""

    #: device cycles per host second assumed in sizing the sleep (a GPU's clock is 1-2 GHz;
    #: sleeping too long costs only time)
    CYCLES = 2e9

    def __init__(self, device: torch.device) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.cycles = 1_000_000
        self.queued = 0.0

    def start(self) -> None:
        torch.cuda._sleep(self.cycles)
        self.begin.record()
        self.queued = clock()

    def stop(self) -> float:
        self.end.record()
        queued = clock() - self.queued
        self.end.synchronize()
        self.cycles = max(self.cycles, min(int(3 * queued * self.CYCLES), 200_000_000))
        return self.begin.elapsed_time(self.end) / 1e3


def stopwatch(device: torch.device) -> HostWatch | DeviceWatch:
    """What times candidates on ``device``: the device's own time on a GPU, the host's on a
    CPU (tests replace this)."""
    return DeviceWatch(device) if device.type == "cuda" else HostWatch(device)


def time_orders(layer: Any, classes: list[type], shape: tuple[int, ...], repeats: int,
                channels_last: bool = False) -> list[Timing]:
    """The :class:`Timing` of each class's forward and backward on a random input of
    ``shape`` (laid out channels-last if asked; indices for an index input), in interleaved
    rounds, by :func:`stopwatch`: on a GPU the device's time without the launches. Called
    without autograd (a served layer), the forward alone."""
    served = not torch.is_grad_enabled()
    first = next(iter(layer.parameters()))
    gen = torch.Generator(device=first.device).manual_seed(0)
    times: list[list[float]] = [[] for _ in classes]
    watch = stopwatch(first.device)
    with torch.inference_mode(False), torch.set_grad_enabled(not served):
        inputs = [p for p in layer.parameters() if p.requires_grad]
        if layer.network.lookup:  # indices (the planned shape ends in the one-hot axis)
            x = torch.randint(0, shape[-1], shape[:-1], device=first.device, generator=gen)
        else:
            x = torch.randn(shape, dtype=first.dtype, device=first.device, generator=gen)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            inputs.insert(0, x.requires_grad_(not served))
        for n in range(repeats + 1):  # the first round warms up
            for cls, spent in zip(classes, times):
                watch.start()
                y = cls.forward(layer, x)
                if not served:  # a dense gradient in the output's layout, as a next layer's
                    torch.autograd.grad(y, inputs, torch.ones_like(y))
                seconds = watch.stop()
                if n:
                    spent.append(seconds)
    return [Timing.of(t) for t in times]
