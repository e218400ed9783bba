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
import os
import platform
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from .cost import Chooser, CostModel, Mixing
from .measure import batch_class, fit, measure, time_mixing

ENV_DIR = "TNSPEC_CACHE_DIR"
ENV_SWITCH = "TNSPEC_CALIBRATE"
FILE_NAME = "calibration.json"
FORMAT = 2  # bumped when the measurement or the model changes; older entries are re-measured


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


#: how much faster a measured alternative must be to replace the default (the einsum for the
#: 1x1 conv, another order for the model's): a smaller lead is within the spread of repeated
#: timings of one op or layer
MARGIN = 0.9

#: a candidate order the measured cost model prices at more than PRUNE times the cheapest is
#: not timed: the model's errors are well inside this factor, and such an order (einconv's
#: left-to-right on a loopy network) can take seconds and gigabytes per repetition
PRUNE = 4.0


def chooser(device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> Chooser | None:
    """How channel-mixing steps run on ``device``: a function that answers "conv1x1" or
    "einsum" for a :class:`~tnspec.cost.Mixing` from the cache, timing both the first time a
    size class is seen. None when calibration is off (the cost model decides)."""
    if not measures(device):
        return None

    def choose(step: Mixing) -> str:
        batch = batch_class(step)
        what = (f"mixing batch {batch}, groups {step.groups}, {step.inputs} -> {step.outputs} "
                f"over {'x'.join(map(str, step.spatial))}")
        found = recall(device, dtype, what)
        if found is None:
            seconds = time_mixing(replace(step, batch=batch), device, dtype, repeats=9)
            # the einsum only when clearly faster (MARGIN): the conv keeps the data contiguous
            # and can add the bias itself
            op = "einsum" if seconds["einsum"] < MARGIN * seconds["conv1x1"] else "conv1x1"
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
