"""The cost model's constants, measured on the device that runs the layer.

The planner prices each step with :class:`~tnspec.cost.CostModel`: rates for convolutions
and einsums, a channels-per-group efficiency, memory bandwidth and a per-step overhead. Those
differ from one CPU or GPU to the next, and so does the best implementation of a step (a 1x1
convolution or an einsum for channel mixing). So on first use for a device, dtype and thread
count, tnspec times a fixed set of small steps forward and backward (under a second on two CPU
threads), fits the constants to them and keeps them in a JSON file in the user's cache
directory; later processes read the file and time nothing. The model orders the contraction.
How each channel-mixing step of that order runs (a 1x1 convolution or an einsum, whose speeds
differ most between machines) is then decided by timing both at the step's own sizes, once per
device and size class, kept in the same file; so is the fastest of a layer's candidate orders,
timed on its first call for a shape (see ``Layer``'s ``autotune``).

``TNSPEC_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/tnspec``, else
``~/.cache/tnspec``); ``TNSPEC_CALIBRATE=0`` turns calibration off (the built-in constants
are used, so plans are the same on every machine). ``tnspec calibrate`` shows and refreshes
the cache. Measuring uses its own random generator and gradients: the global RNG,
``no_grad``/``inference_mode`` and frozen parameters are left as they are.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from itertools import product
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from .cost import Chooser, CostModel, Mixing

ENV_DIR = "TNSPEC_CACHE_DIR"
ENV_SWITCH = "TNSPEC_CALIBRATE"
FILE_NAME = "calibration.json"
FORMAT = 2  # bumped when the measurement or the model changes; older entries are re-measured


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


@dataclass(frozen=True)
class Calibration:
    """A device's fitted cost model, with what it was fitted from."""

    key: str
    model: CostModel
    error: float  # median |log(predicted / measured)| over the samples, as a factor
    seconds: float  # how long measuring took
    samples: int

    def describe(self) -> str:
        """The constants in words, as ``tnspec calibrate`` prints them."""
        m = self.model
        return (f"{self.key}\n"
                f"  conv {m.conv_rate:.3g} MAC/s, einsum {m.einsum_rate:.3g} MAC/s, "
                f"channels c0 {m.channels:.3g}, grouped x{m.grouped:.3g}\n"
                f"  bandwidth {m.bandwidth:.3g} elements/s (einsum {m.einsum_bandwidth:.3g}), "
                f"overhead {m.overhead * 1e6:.0f} us per step\n"
                f"  fitted to {self.samples} steps measured in {self.seconds:.1f} s; "
                f"median error x{self.error:.2f}")


# ---- where and under which name --------------------------------------------------------------


def enabled() -> bool:
    """False when ``TNSPEC_CALIBRATE`` is 0, false, no or off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_path() -> Path:
    """The JSON file of calibrations."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]) / FILE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tnspec" / FILE_NAME


def device_key(device: torch.device | str, dtype: torch.dtype) -> str:
    """What a calibration is valid for: the device model, dtype, CPU threads and torch."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        where = f"cuda {name}"
    else:
        where = f"{device.type} {_cpu_name()} {torch.get_num_threads()} threads"
    return f"{where} | {str(dtype).replace('torch.', '')} | torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- the cache -------------------------------------------------------------------------------

_memory: dict[str, CostModel] = {}
_choices: dict[str, dict[str, Any]] | None = None  # the file's measured choices, read once


def measures(device: torch.device | str) -> bool:
    """Whether layers on ``device`` plan with measurements (calibration on, a timeable
    device; not e.g. ``meta``)."""
    return enabled() and torch.device(device).type in ("cpu", "cuda")


def cost_model(device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> CostModel:
    """The cost model for ``device`` and ``dtype``: calibrated (measured once, then read from
    the cache), or the built-in constants when calibration is off or the device is not one
    tnspec can time (e.g. ``meta``)."""
    if not measures(device):
        return CostModel(scale=2.0 if dtype.itemsize == 8 else 1.0)
    key = device_key(device, dtype)
    if key not in _memory:
        _memory[key] = calibrate(device, dtype).model
    return _memory[key]


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
              refresh: bool = False) -> Calibration:
    """The calibration of ``device`` and ``dtype``, from the cache unless ``refresh`` or
    absent; a new measurement is written to the cache."""
    global _choices
    key = device_key(device, dtype)
    entries, choices = _read()
    if not refresh and key in entries:
        return entries[key]
    start = time.perf_counter()
    samples = measure(device, dtype)
    model, error = fit(samples)
    found = Calibration(key, model, error, time.perf_counter() - start, len(samples))
    entries[key] = found
    if refresh:  # the device's measured choices go too
        choices = {k: v for k, v in choices.items() if not k.startswith(key + " | ")}
    _write(entries, choices)
    _memory[key] = model
    _choices = choices
    return found


def forget() -> None:
    """Drop what this process has read or measured; the next plan reads the cache file again
    (for tests, and after editing the file by hand)."""
    global _choices
    _memory.clear()
    _choices = None


def cached() -> list[Calibration]:
    """Every calibration in the cache file."""
    return list(_read()[0].values())


#: how much faster the einsum must be measured than the 1x1 conv to be chosen
_MARGIN = 0.9


def chooser(device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> Chooser | None:
    """How channel-mixing steps run on ``device``: a function that answers "conv1x1" or
    "einsum" for a :class:`~tnspec.cost.Mixing` from the cache, timing both the first time a
    size class is seen. None when calibration is off (the cost model decides)."""
    if not measures(device):
        return None

    def choose(step: Mixing) -> str:
        batch = _batch_class(step)
        what = (f"mixing batch {batch}, groups {step.groups}, {step.inputs} -> {step.outputs} "
                f"over {'x'.join(map(str, step.spatial))}")
        found = recall(device, dtype, what)
        if found is None:
            seconds = time_mixing(replace(step, batch=batch), device, dtype, repeats=9)
            # the einsum only when clearly faster: timings of one op vary by 10-20% here, and
            # the conv keeps the data contiguous and can add the bias itself
            op = "einsum" if seconds["einsum"] < _MARGIN * seconds["conv1x1"] else "conv1x1"
            found = {"op": op, "seconds": seconds}
            remember(device, dtype, what, found)
        return str(found["op"])
    return choose


def recall(device: torch.device | str, dtype: torch.dtype, what: str) -> dict[str, Any] | None:
    """A choice measured on ``device`` and ``dtype`` and kept in the cache under ``what``
    (an op per mixing step, an order per layer), or None."""
    global _choices
    if _choices is None:
        _choices = _read()[1]
    return _choices.get(f"{device_key(device, dtype)} | {what}")


def remember(device: torch.device | str, dtype: torch.dtype, what: str,
             value: dict[str, Any]) -> None:
    """Keep a measured choice in the cache (merged with what other processes wrote)."""
    global _choices
    entries, on_disk = _read()
    _choices = {**on_disk, **(_choices or {}), f"{device_key(device, dtype)} | {what}": value}
    _write(entries, _choices)


def _read() -> tuple[dict[str, Calibration], dict[str, dict[str, Any]]]:
    """The cache file's calibrations and measured choices (empty when absent or unreadable)."""
    path = cache_path()
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}, {}
    except OSError as exc:
        warnings.warn(f"tnspec: cannot read the calibration cache {path} ({exc}); "
                      "measuring again", stacklevel=3)
        return {}, {}
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            return {}, {}  # an older tnspec's measurement: measured again
        names = {f.name for f in fields(CostModel)}
        entries = {}
        for key, e in data["devices"].items():
            model = CostModel(**{k: float(v) for k, v in e["model"].items() if k in names})
            entries[key] = Calibration(key, model, float(e["error"]), float(e["seconds"]),
                                       int(e["samples"]))
        choices = dict(data.get("choices", {}))
        for key, c in choices.items():  # an op per mixing step, or an order per layer
            if "order" not in c and c["op"] not in ("conv1x1", "einsum"):
                raise ValueError(f"choice {key!r} names the unknown op {c['op']!r}")
        return entries, choices
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        warnings.warn(f"tnspec: ignoring the corrupt calibration cache {path} "
                      f"({type(exc).__name__}: {exc}); it is measured again and rewritten",
                      stacklevel=3)
        return {}, {}


def _write(entries: dict[str, Calibration], choices: dict[str, dict[str, Any]]) -> None:
    path = cache_path()
    data = {"format": FORMAT, "devices": {
        k: {"model": asdict(c.model), "error": c.error, "seconds": c.seconds,
            "samples": c.samples} for k, c in entries.items()}, "choices": choices}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: a reader never sees half a file
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"tnspec: cannot write the calibration cache {path} ({exc}); the "
                      f"calibration is kept for this process only (set {ENV_DIR} to a "
                      "writable directory)", stacklevel=3)


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


class _Bench:
    """Random inputs from its own generator and interleaved timing rounds, forward and
    backward, on one device and dtype (the global RNG and grad mode are left alone)."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.gen = torch.Generator(device=self.device).manual_seed(0)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype,
                           requires_grad=True)

    @staticmethod
    def step(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
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
                seconds = _timed(run, self.device)
                if rep:
                    times[j].append(seconds)
        return times


def measure(device: torch.device | str, dtype: torch.dtype, repeats: int = 5) -> list[Sample]:
    """Time the fixed set of steps, forward and backward; the fastest round per step."""
    bench = _Bench(device, dtype)
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
    return [replace(sample, seconds=min(t)) for sample, t in zip(samples, times)]


#: a channel-mixing step is timed at a batch of at most this many elements per operand side
#: (the ratio of the two ops, not the time, is what is kept)
MIXING_ELEMENTS = 1 << 22


def size_class(batch: int) -> int:
    """The nearest power of two (0 for 0): batch sizes that share a plan and a measurement
    (1, 2, 3-5, 6-11, 12-22, ...)."""
    return 1 << round(math.log2(batch)) if batch > 0 else 0


def _batch_class(step: Mixing) -> int:
    """The batch a step is timed and cached under: its size class, capped so that the timed
    tensors stay small; a new batch size in the same class is not timed again."""
    per_sample = step.groups * max(step.inputs, step.outputs) * math.prod(step.spatial)
    cap = max(1, MIXING_ELEMENTS // max(per_sample, 1))
    return max(1, min(size_class(step.batch), 1 << int(math.log2(cap))))


def time_mixing(step: Mixing, device: torch.device | str, dtype: torch.dtype,
                repeats: int = 5) -> dict[str, float]:
    """Seconds, forward and backward, of ``step`` as a grouped 1x1 convolution and as an
    einsum, each laid out as lowering emits it (median of interleaved repetitions)."""
    bench = _Bench(device, dtype)
    b, g, cin, cout, spatial = step.batch, step.groups, step.inputs, step.outputs, step.spatial
    conv = getattr(F, f"conv{len(spatial)}d")
    with torch.inference_mode(False), torch.enable_grad():
        runs = [bench.step(lambda x, w: conv(x, w, groups=g), bench.rand(b, g * cin, *spatial),
                           bench.rand(g * cout, cin, *(1,) * len(spatial))),
                bench.step(lambda x, w: torch.einsum("bgcs,gco->bgos", x, w),
                           bench.rand(b, g, cin, math.prod(spatial)), bench.rand(g, cin, cout))]
        times = bench.rounds(runs, repeats)
    return {op: sorted(t)[len(t) // 2] for op, t in zip(("conv1x1", "einsum"), times)}


def _timed(run: Callable[[], None], device: torch.device) -> float:
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
_MAX_RATE = 1e16  # a rate the samples cannot bound (zero coefficient) is taken as this


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
    return 1.0 / coefficient if coefficient > 1.0 / _MAX_RATE else _MAX_RATE


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
