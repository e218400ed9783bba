"""The cost model's constants, measured on the device that runs the layer.

The planner prices each step with :class:`~tnspec.planning.cost.CostModel`: rates for convolutions
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
import logging
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..progress import Progress
from . import cache
from . import choices as choices_
from .cost import Chooser, CostModel, Mixing
from .measure import MAX_RATE, batch_class, doubts, fit, measure, size_class, time_mixing

ENV_SWITCH = "TNSPEC_CALIBRATE"
ENV_DIR, FILE_NAME, FORMAT = cache.ENV_DIR, cache.FILE_NAME, cache.FORMAT

logger = logging.getLogger("tnspec")


@dataclass(frozen=True)
class Calibration:
    """A device's fitted cost model, with what it was fitted from."""

    key: str
    model: CostModel
    error: float  # median |log(predicted / measured)| over the samples, as a factor
    seconds: float  # how long measuring took
    samples: int
    #: what the machine was like: 1-minute load and CPUs before measuring, the repeats' spread,
    #: measurements taken, and the doubts that made it fall back to the built-in constants
    conditions: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """The constants in words, as ``tnspec calibrate`` prints them."""
        m = self.model

        def rate(value: float) -> str:  # MAX_RATE: the samples put no cost on that work
            return "unbounded" if value >= MAX_RATE else f"{value:.3g}"
        return (f"{self.key}\n"
                f"  conv {rate(m.conv_rate)} MAC/s, einsum {rate(m.einsum_rate)} MAC/s, "
                f"channels c0 {m.channels:.3g}, grouped x{m.grouped:.3g}\n"
                f"  bandwidth {rate(m.bandwidth)} elements/s (einsum "
                f"{rate(m.einsum_bandwidth)}), "
                f"overhead {m.overhead * 1e6:.0f} us per step\n"
                f"  fitted to {self.samples} steps measured in {self.seconds:.1f} s; "
                f"median error x{self.error:.2f}" + _conditions(self.conditions))


# ---- where and under which name --------------------------------------------------------------


def enabled() -> bool:
    """False when ``TNSPEC_CALIBRATE`` is 0, false, no or off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_path() -> Path:
    """The JSON file of calibrations (see :mod:`tnspec.planning.cache`)."""
    return cache.path()


def device_key(device: torch.device | str, dtype: torch.dtype) -> str:
    """What a calibration is valid for: the device model, dtype, CPU threads and torch."""
    device = torch.device(device)
    if device.type == "cuda":
        # "device time": orders timed without their launches since issue 58; the choices
        # timed with them, under the old key, are not recalled
        where = f"cuda {torch.cuda.get_device_name(device)} device time"
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
#: recalled choices this process has timed again (see ``autotune.fastest``)
rechecked: set[str] = set()


def measures(device: torch.device | str) -> bool:
    """Whether layers on ``device`` plan with measurements (calibration on, a timeable
    device; not e.g. ``meta``)."""
    return enabled() and torch.device(device).type in ("cpu", "cuda")


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream: nothing may be timed or
    synchronized then, so a layer planning inside a capture (a shape it was not warmed up
    on) takes cached measurements and the cost model instead of raising from inside torch."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cost_model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
               measure_now: bool = True) -> CostModel:
    """The cost model for ``device`` and ``dtype``: calibrated (measured once, then read from
    the cache), or the built-in constants when calibration is off or the device is not one
    tnspec can time (e.g. ``meta``). ``measure_now=False`` (while ``torch.compile`` or
    ``torch.export`` traces, where tensors are fake and nothing can be timed) takes a cached
    calibration if there is one and the built-in constants otherwise."""
    builtin = CostModel(scale=2.0 if dtype.itemsize == 8 else 1.0)
    if not measures(device):
        return builtin
    key = device_key(device, dtype)
    if key not in _memory:
        if not measure_now or capturing():
            found = _read()[0].get(key)
            return found.model if found is not None else builtin
        _memory[key] = calibrate(device, dtype).model
    return _memory[key]


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
              refresh: bool = False) -> Calibration:
    """The calibration of ``device`` and ``dtype``, from the cache unless ``refresh`` or
    absent; a new measurement is written to the cache."""
    global _choices
    key = device_key(device, dtype)
    entries = _read()[0]
    if not refresh and key in entries:
        return entries[key]
    start = time.perf_counter()
    progress = Progress(f"calibrating {key}")
    for attempt in (1, 2):  # a fit taken while the machine was busy is measured once more
        progress.update(f"attempt {attempt} of 2")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        before = others_running()
        samples = measure(device, dtype)
        model, error = fit(samples)
        spread = sorted(s.spread for s in samples)[len(samples) // 2]
        others = max((n for n in (before, others_running()) if n is not None), default=None)
        found_doubts = doubts(model, error, spread, torch.device(device).type)
        if others is not None and busy(torch.device(device).type, others):
            found_doubts.append(f"{others} other threads running on {os.cpu_count()} CPUs")
        if not found_doubts:
            break
        logger.info("calibration of %s, attempt %d, is not plausible (%s)", key, attempt,
                    "; ".join(found_doubts))
    progress.close()
    conditions = {"load": load, "cpus": os.cpu_count(), "others": others,
                  "spread": round(spread, 3),
                  "attempts": attempt, "doubts": found_doubts}
    seconds = time.perf_counter() - start
    logger.log(logging.INFO if seconds > 1 else logging.DEBUG, "calibrated %s in %.1f s",
               key, seconds)
    if found_doubts:
        # the decision is kept for FALLBACK_SECONDS, so that the processes started meanwhile
        # on the busy machine do not each measure (and warn) again
        conditions["until"] = time.time() + FALLBACK_SECONDS
        until = time.strftime("%H:%M", time.localtime(conditions["until"]))
        warnings.warn(f"tnspec: the calibration of {key} was not plausible twice "
                      f"({'; '.join(found_doubts)}), as on a busy machine: tnspec plans with "
                      f"the built-in constants until {until} and then measures again; run "
                      "`tnspec calibrate --refresh` when the machine is idle", stacklevel=2)
        builtin = CostModel(scale=2.0 if dtype.itemsize == 8 else 1.0)
        found = Calibration(key, builtin, error, seconds, len(samples), conditions)
    else:
        found = Calibration(key, model, error, seconds, len(samples), conditions)

    def store(devices: cache.Devices, choices: cache.Choices) -> None:
        devices[key] = _entry(found)
        if refresh:  # the device's measured choices go too
            for k in [k for k in choices if k.startswith(key + " | ")]:
                del choices[k]
    _memory[key] = found.model
    _choices = cache.update(store)[1]
    return found


#: how long a busy machine's decision to plan with the built-in constants is kept
FALLBACK_SECONDS = 3600.0


def others_running() -> int | None:
    """How many threads of other processes are running or ready to run now (the median of
    a few reads of ``/proc/loadavg``, less this process's threads that are: torch's own
    intra-op threads spin for a while after each parallel op, and counting them as others
    made a quiet machine look busy), or None where that file is absent."""
    counts = []
    for _ in range(5):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(max(running - _running_here(), 0))
        time.sleep(0.002)
    return sorted(counts)[2]


def _running_here() -> int:
    """This process's threads running or ready to run (at least this one)."""
    here = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                # the state follows the command name, which is in parentheses
                here += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(here, 1)


def busy(device_type: str = "cpu", others: int | None = None) -> bool:
    """Whether as many other threads run as there are CPUs (``others``, read now unless
    given); never for a device other than a CPU. A measurement taken then is not kept."""
    if device_type != "cpu":
        return False
    others = others_running() if others is None else others
    return others is not None and others >= (os.cpu_count() or 1)


def _conditions(c: dict[str, Any]) -> str:
    if not c:
        return ""
    load = "" if c.get("load") is None else f" at load {c['load']:.2f}"
    others = "" if c.get("others") is None else f", {c['others']} other threads running"
    text = (f"\n  measured{load} on {c.get('cpus')} CPUs{others}, {c.get('attempts')} attempt(s), "
            f"repeats spread x{c.get('spread')}")
    if c.get("doubts"):
        until = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.get("until", 0)))
        text += (f"\n  not plausible ({'; '.join(c['doubts'])}): the built-in constants are "
                 f"used until {until}, then it is measured again")
    return text


def forget() -> None:
    """Drop what this process has read or measured; the next plan reads the cache file again
    (for tests, and after editing the file by hand)."""
    global _choices
    _memory.clear()
    rechecked.clear()
    _choices = None
    cache.forget()


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


def chooser(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            training: bool = True, channels_last: bool = False) -> Chooser | None:
    """How channel-mixing steps run on ``device``: "conv1x1" or "einsum" for a
    :class:`~tnspec.planning.cost.Mixing`, from the cache, both timed the first time a size
    class is seen: forward and backward (without ``training``, served, forward alone), on
    ``channels_last`` or contiguous data as lowering runs each. None without calibration."""
    if not measures(device):
        return None
    kind = ("" if training else ", served") + (", channels_last" if channels_last else "")

    def choose(step: Mixing) -> str:
        # kept per size class, spatial sizes too (a layer seeing many sizes times each once)
        step = replace(step, spatial=tuple(size_class(n) for n in step.spatial))
        batch = batch_class(step)
        what = (f"mixing batch {batch}, groups {step.groups}, {step.inputs} -> {step.outputs} "
                f"over {'x'.join(map(str, step.spatial))}{kind}")
        found = recall(device, dtype, what)
        if found is None and capturing():
            return "conv1x1"  # nothing is timed inside a capture; the conv is the default
        if found is None:
            seconds = time_mixing(replace(step, batch=batch), device, dtype, repeats=9,
                                  backward=training, channels_last=channels_last)
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
    full = f"{device_key(device, dtype)} | {what}"
    _choices = {**(_choices or {}), **cache.update(lambda d, c: c.__setitem__(full, value))[1]}


def choices(pattern: str | None = None) -> dict[str, dict[str, Any]]:
    """The measured choices in the cache file (an op per mixing step, an order or cut per
    layer), by key, those matching ``pattern`` only where given (see :func:`drop`)."""
    found = _read()[1]
    return {k: v for k, v in found.items() if pattern is None or choices_.matches(k, pattern)}


def drop(pattern: str) -> int:
    """Drop the cached choices whose key matches ``pattern`` (a glob with ``*`` and ``?``;
    without them, a part of the key); returns how many. Layers time them again when next
    planned."""
    global _choices
    gone: list[str] = []

    def change(devices: cache.Devices, found: cache.Choices) -> None:
        gone.extend(k for k in found if choices_.matches(k, pattern))
        for k in gone:
            del found[k]
    _choices = cache.update(change)[1]
    rechecked.clear()
    return len(gone)


def _read() -> tuple[dict[str, Calibration], dict[str, dict[str, Any]]]:
    """The cache's calibrations and measured choices: a malformed or implausible calibration
    is left out with a warning (and measured again)."""
    devices, choices = cache.read()
    entries = {}
    names = {f.name for f in fields(CostModel)}
    for key, e in devices.items():
        try:
            model = CostModel(**{k: float(v) for k, v in e["model"].items() if k in names})
            found = Calibration(key, model, float(e["error"]), float(e["seconds"]),
                                int(e["samples"]), dict(e.get("conditions", {})))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            warnings.warn(f"tnspec: ignoring the corrupt cached calibration {key} "
                          f"({type(exc).__name__}: {exc}); it is measured again", stacklevel=3)
            continue
        if "until" in found.conditions:  # a busy machine's decision: the built-in constants
            if found.conditions["until"] > time.time() and model == CostModel(scale=model.scale):
                entries[key] = found
            continue  # expired (or edited): measured again
        dubious = doubts(model, found.error, 1.0, key.split(" ", 1)[0])
        if dubious:  # kept by an older tnspec, or edited by hand: measured again
            warnings.warn(f"tnspec: ignoring the cached calibration {key} "
                          f"({'; '.join(dubious)}), not plausible; measuring again",
                          stacklevel=3)
            continue
        entries[key] = found
    return entries, choices


def _entry(c: Calibration) -> dict[str, Any]:
    return {"model": asdict(c.model), "error": c.error, "seconds": c.seconds,
            "samples": c.samples, "conditions": c.conditions}
