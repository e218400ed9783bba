"""Measuring steps on a device and fitting the cost model's constants to them.

:func:`measure` times a fixed set of small convolutions and einsums forward and backward;
:func:`fit` finds the :class:`~tnspec.planning.cost.CostModel` that predicts them best;
:func:`time_mixing` times one channel-mixing step both ways; :func:`doubts` says why a fitted
model is not plausible (one taken on a busy machine, or from noise). Everything here draws from
its own random generator and makes its own gradients, so the global RNG, ``no_grad`` /
``inference_mode`` and frozen parameters are left as they are.
:mod:`tnspec.planning.calibration` decides when to measure and keeps the results.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from itertools import product
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .cost import CostModel, Mixing


@dataclass(frozen=True)
class Sample:
    """One timed step: ``kind`` "conv" (grouped, kernel ``kernel`` taps, 1 for a 1x1 conv)
    or "einsum" (channel mixing ``oc,bcs->bos``); seconds forward and backward."""

    kind: str
    batch: int
    groups: int
    cin: int
    cout: int
    positions: int
    kernel: int
    seconds: float
    spread: float = 1.0  # the median of its repeats over the fastest: how noisy the timing was

    @property
    def traffic(self) -> int:
        """Elements read and written: input, output and weight."""
        return (self.batch * self.groups * (self.cin + self.cout) * self.positions
                + self.groups * self.cin * self.cout * self.kernel)

    def predicted(self, model: CostModel) -> float:
        if self.kind == "conv":
            return model.conv(self.batch, self.groups, self.cin, self.cout, self.positions,
                              self.kernel, self.traffic)
        macs = self.batch * self.cin * self.cout * self.positions
        return model.einsum(macs, self.traffic)


# ---- measuring -------------------------------------------------------------------------------

#: (batch, groups, in channels, out channels, side, kernel side): regular, few-channel,
#: grouped and depthwise convolutions, 1x1 convolutions that expand and reduce channels
CONVS = [(8, 1, 32, 32, 32, 3), (8, 1, 64, 64, 16, 3), (8, 1, 4, 4, 32, 3),
         (8, 1, 10, 10, 32, 3), (8, 4, 8, 8, 32, 3), (8, 16, 1, 1, 32, 3),
         (16, 1, 96, 10, 32, 1), (16, 1, 10, 96, 32, 1), (32, 1, 64, 64, 16, 1),
         (8, 1, 16, 16, 32, 1), (8, 1, 2, 2, 8, 1)]
#: channel mixing as an einsum: (batch, in channels, out channels, positions)
EINSUMS = [(16, 96, 10, 1024), (16, 10, 96, 1024), (32, 64, 64, 256), (8, 16, 16, 1024),
           (8, 2, 2, 64), (256, 64, 64, 1), (64, 8, 64, 16)]


class Bench:
    """Random inputs from its own generator and interleaved timing rounds, forward and
    backward, on one device and dtype (the global RNG and grad mode are left alone)."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator(device=self.device).manual_seed(0)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype,
                           requires_grad=True)

    @staticmethod
    def step(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
             backward: bool = True) -> Callable[[], None]:
        def run() -> None:
            if not backward:  # served: the forward alone, nothing kept for a backward
                with torch.no_grad():
                    fn(*inputs)
                return
            y = fn(*inputs)
            # a contiguous gradient, as the next layer gives (ones_like would copy an einsum's
            # permuted strides and spare its backward the copy it makes in a real network)
            grad = torch.ones(y.shape, device=y.device, dtype=y.dtype)
            torch.autograd.grad(y, inputs, grad)
        return run

    def rounds(self, runs: list[Callable[[], None]], repeats: int) -> list[list[float]]:
        """Seconds of each run in each of ``repeats`` rounds over all of them (after one
        warm-up round), so that a busy spell of the machine hits every run alike."""
        times: list[list[float]] = [[] for _ in runs]
        for rep in range(repeats + 1):
            for j, run in enumerate(runs):
                seconds = timed(run, self.device)
                if rep:
                    times[j].append(seconds)
        return times


def measure(device: torch.device | str, dtype: torch.dtype, repeats: int = 5) -> list[Sample]:
    """Time the fixed set of steps, forward and backward; the fastest round per step (and how
    far the median round was from it)."""
    bench = Bench(device, dtype)
    rand, step = bench.rand, bench.step
    samples, runs = [], []
    with torch.inference_mode(False), torch.enable_grad():
        for n, g, cin, cout, side, k in CONVS:
            runs.append(step(lambda x, w, g=g, k=k: F.conv2d(x, w, padding=k // 2, groups=g),
                             rand(n, g * cin, side, side), rand(g * cout, cin, k, k)))
            samples.append(Sample("conv", n, g, cin, cout, side * side, k * k, 0.0))
        for n, cin, cout, s in EINSUMS:
            runs.append(step(lambda x, w: torch.einsum("oc,bcs->bos", w, x), rand(n, cin, s),
                             rand(cout, cin)))
            samples.append(Sample("einsum", n, 1, cin, cout, s, 1, 0.0))
        times = bench.rounds(runs, repeats)
    return [replace(sample, seconds=min(t), spread=sorted(t)[len(t) // 2] / min(t))
            for sample, t in zip(samples, times)]


#: a channel-mixing step is timed at a batch of at most this many elements per operand side
#: (the ratio of the two ops, not the time, is what is kept)
MIXING_ELEMENTS = 1 << 22


def size_class(batch: int) -> int:
    """The nearest power of two (0 for 0): batch sizes that share a plan and a measurement
    (1, 2, 3-5, 6-11, 12-22, ...)."""
    return 1 << round(math.log2(batch)) if batch > 0 else 0


def batch_class(step: Mixing) -> int:
    """The batch a step is timed and cached under: its size class, capped so that the timed
    tensors stay small; a new batch size in the same class is not timed again."""
    per_sample = step.groups * max(step.inputs, step.outputs) * math.prod(step.spatial)
    cap = max(1, MIXING_ELEMENTS // max(per_sample, 1))
    return max(1, min(size_class(step.batch), 1 << int(math.log2(cap))))


def time_mixing(step: Mixing, device: torch.device | str, dtype: torch.dtype,
                repeats: int = 5, backward: bool = True,
                channels_last: bool = False) -> dict[str, float]:
    """Seconds, forward and backward (the forward alone without ``backward``), of ``step``
    as a grouped 1x1 convolution and as an einsum, each laid out as lowering emits it, on
    contiguous data or (2-D, ``channels_last``) channels-last data (median of interleaved
    repetitions)."""
    bench = Bench(device, dtype)
    b, g, cin, cout, spatial = step.batch, step.groups, step.inputs, step.outputs, step.spatial
    conv = getattr(F, f"conv{len(spatial)}d")
    last = channels_last and len(spatial) == 2
    with torch.inference_mode(False), torch.enable_grad():
        data = bench.rand(b, g * cin, *spatial)
        if last:
            data = data.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
        if g == 1:  # lowering runs the einsum as a matmul over views of the data
            product = (_mixed_last if last else _mixed), data, bench.rand(cout, cin)
        elif last:
            product = (lambda x, w: torch.einsum("bgchw,gco->bgohw", x.view(
                b, g, cin, *spatial), w)), data, bench.rand(g, cin, cout)
        else:
            product = (lambda x, w: torch.einsum("bgcs,gco->bgos", x, w)), \
                data.detach().reshape(b, g, cin, -1).requires_grad_(), bench.rand(g, cin, cout)
        cases = [(lambda x, w: conv(x, w, groups=g), data,
                  bench.rand(g * cout, cin, *(1,) * len(spatial))), product]
        runs = [bench.step(fn, *inputs, backward=backward) for fn, *inputs in cases]
        times = bench.rounds(runs, repeats)
    return {op: sorted(t)[len(t) // 2] for op, t in zip(("conv1x1", "einsum"), times)}


def _mixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w[o, c] x[b, c, ...]`` over contiguous ``x``, as lowering emits it: the data viewed
    as ``(b, c, positions)`` and the result viewed back (the views are part of the step's
    time, which at batch 1 is tens of microseconds)."""
    b, c = x.shape[:2]
    return torch.bmm(w.expand(b, -1, -1), x.reshape(b, c, -1)).reshape(b, -1, *x.shape[2:])


def _mixed_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w[o, c] x[b, c, h, w]`` over channels-last ``x``, as lowering emits it."""
    b, c, h, width = x.shape
    y = torch.mm(x.permute(0, 2, 3, 1).reshape(b * h * width, c), w.permute(1, 0))
    return y.reshape(b, h, width, -1).permute(0, 3, 1, 2)


def timed(run: Callable[[], None], device: torch.device) -> float:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# ---- fitting ---------------------------------------------------------------------------------

#: the two nonlinear constants are searched on a grid; the five others are then linear
_CHANNELS = (0.5, 1, 2, 4, 8, 16, 32)
_GROUPED = (1.0, 1.25, 1.5, 2.0, 3.0)
MAX_RATE = 1e16  # a rate the samples cannot bound (zero coefficient) is taken as this


def fit(samples: list[Sample]) -> tuple[CostModel, float]:
    """The CostModel that best predicts ``samples`` (least squares of relative errors) and its
    median error as a factor (1.3 means predictions within x1.3 for half the samples)."""
    seconds = np.array([s.seconds for s in samples])
    best: tuple[float, CostModel] | None = None
    for c0, grouped in product(_CHANNELS, _GROUPED):
        # seconds = a * conv work + b * einsum work + c * conv traffic + e * einsum traffic
        # + d, each term nonnegative
        rows = []
        for s in samples:
            if s.kind == "conv":
                eff = (s.cin / (s.cin + c0)) * (s.cout / (s.cout + c0))
                if s.groups > 1 and max(s.cin, s.cout) > 1:
                    eff /= grouped
                work = 3 * s.batch * s.groups * s.cin * s.cout * s.positions * s.kernel / eff
                rows.append((work, 0.0, 3 * s.traffic, 0.0, 1.0))
            else:
                rows.append((0.0, 3 * s.batch * s.cin * s.cout * s.positions, 0.0,
                             3 * s.traffic, 1.0))
        a, b, c, e, d = _nonnegative_lstsq(np.array(rows) / seconds[:, None],
                                           np.ones(len(rows)))
        model = CostModel(conv_rate=_rate(a), einsum_rate=_rate(b), channels=c0,
                          bandwidth=_rate(c), overhead=d, grouped=grouped,
                          einsum_bandwidth=_rate(e))
        error = _median_log_error(model, samples)
        if best is None or error < best[0]:
            best = (error, model)
    assert best is not None
    return best[1], math.exp(best[0])


def _rate(coefficient: float) -> float:
    return 1.0 / coefficient if coefficient > 1.0 / MAX_RATE else MAX_RATE


def _median_log_error(model: CostModel, samples: list[Sample]) -> float:
    return float(np.median([abs(math.log(s.predicted(model) / s.seconds)) for s in samples]))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, for a few columns: least squares on the free
    columns, dropping the most negative coefficient until none is negative."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x / scale


#: what no idle measurement gives: a fit past these was taken under load, or from noise
MAX_OVERHEAD = 2e-3  # seconds per step (idle: about 0.1-0.3 ms on a CPU, 10 us on a GPU)
MAX_ERROR = 2.5  # the fit's median error, as a factor
MAX_SPREAD = 1.5  # the median step's median repeat over its fastest
MAX_CPU_RATE = 1e13  # multiply-adds per second, beyond any CPU's peak
MAX_CPU_BANDWIDTH = 1e12  # elements per second


#: the constants that must be above zero (the overhead and c0 may be zero)
_POSITIVE = frozenset({"conv_rate", "einsum_rate", "bandwidth", "einsum_bandwidth", "grouped",
                       "scale"})


def doubts(model: CostModel, error: float, spread: float, device_type: str) -> list[str]:
    """Why a fitted model is not plausible (empty when it is): a constant that is not a
    finite number, negative, or a zero rate; a per-step overhead, a fit
    error or a spread between repeats that only a busy machine gives, or, on a CPU, a fitted
    rate no CPU reaches. (A rate the samples do not bound at all, ``MAX_RATE``, is no doubt:
    idle fits give it too, where that work costs too little to show beside the rest.)"""
    found = []
    for f in fields(CostModel):
        value = getattr(model, f.name)
        if not (math.isfinite(value) and value >= 0) or (value == 0 and f.name in _POSITIVE):
            found.append(f"{f.name} {value!r}")
    if found:  # a rate of zero would make every step free (or raise deep inside planning)
        return found
    if model.overhead > MAX_OVERHEAD:
        found.append(f"overhead {model.overhead * 1e6:.0f} us per step")
    if error > MAX_ERROR:
        found.append(f"median error x{error:.2f}")
    if spread > MAX_SPREAD:
        found.append(f"repeats spread x{spread:.2f}")
    if device_type == "cpu":
        for name, value, limit, unit in (
                ("conv", model.conv_rate, MAX_CPU_RATE, "MAC/s"),
                ("einsum", model.einsum_rate, MAX_CPU_RATE, "MAC/s"),
                ("bandwidth", model.bandwidth, MAX_CPU_BANDWIDTH, "elements/s"),
                ("einsum bandwidth", model.einsum_bandwidth, MAX_CPU_BANDWIDTH, "elements/s")):
            if limit < value < MAX_RATE:
                found.append(f"{name} {value:.3g} {unit}")
    return found
