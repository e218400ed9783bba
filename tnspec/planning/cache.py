"""The calibration cache file: JSON in the user's cache directory, shared by every process.

It holds ``devices`` (a fitted cost model per device, dtype and threads; ``calibration`` turns
them into :class:`~tnspec.planning.calibration.Calibration`) and ``choices`` (measured op per mixing
step, measured order per layer and shape). Several processes read and write it at once (DDP
ranks, a second job), so:

- every entry is checked on read, and a bad one (a mixing step holding an ``order``, an order
  that is not a string) is dropped with a warning, not trusted by every later forward;
- every write is a read-modify-write of the file under a lock (``fcntl.flock`` on a lock
  file beside it, where the platform has it), so that what another process stored in the
  meantime is merged, not overwritten;
- the file is written whole to a temporary file and renamed over it, and the temporary file
  is removed when that fails (a full disk, a directory in the way);
- it keeps at most ``MAX_CHOICES`` choices, the oldest written dropped first.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

ENV_DIR = "TNSPEC_CACHE_DIR"
FILE_NAME = "calibration.json"
FORMAT = 3  # bumped when the measurement or the model changes; older entries are re-measured
#: the most measured choices kept; the oldest written go first (a layer that sees many shapes,
#: or many layers over months, would otherwise grow the file without end)
MAX_CHOICES = 4096

Devices = dict[str, dict[str, Any]]
Choices = dict[str, dict[str, Any]]


def path() -> Path:
    """The JSON file of calibrations."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]) / FILE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tnspec" / FILE_NAME


def read() -> tuple[Devices, Choices]:
    """The file's device entries and valid choices (empty when absent or unreadable; a file
    that is not a cache at all is ignored whole, with a warning)."""
    where = path()
    try:
        text = where.read_bytes()  # decoded by json: a file that is not UTF-8 is corrupt
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return {}, {}
    except OSError as exc:
        warnings.warn(f"tnspec: cannot read the calibration cache {where} ({exc}); "
                      "measuring again", stacklevel=4)
        return {}, {}
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            return {}, {}  # an older tnspec's measurement: measured again
        devices, choices = data["devices"], data.get("choices", {})
        if not isinstance(devices, dict) or not isinstance(choices, dict):
            raise TypeError("devices and choices must be objects")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        warnings.warn(f"tnspec: ignoring the corrupt calibration cache {where} "
                      f"({type(exc).__name__}: {exc}); it is measured again and rewritten",
                      stacklevel=4)
        return {}, {}
    good = {}
    for key, value in choices.items():
        why = invalid_choice(key, value)
        if why and (str(where), key) not in _warned:  # once a process: later reads drop it too
            _warned.add((str(where), key))
            warnings.warn(f"tnspec: dropping the calibration cache entry {key!r} ({why}); it "
                          "is measured again", stacklevel=4)
        elif not why:
            good[key] = value
    return dict(devices), good


_warned: set[tuple[str, str]] = set()  # (file, key) of the bad entries warned of


def forget() -> None:
    """Warn again of bad entries (after ``calibration.forget``)."""
    _warned.clear()


def invalid_choice(key: str, value: Any) -> str | None:
    """Why a choice entry cannot be used (None when it can): a mixing step's entry names an
    op of two, an order's entry an order and the digest of the code it was timed among."""
    if not isinstance(value, dict):
        return "not an object"
    what = " | ".join(key.split(" | ")[3:])  # after the device, dtype and torch version
    if what.startswith("mixing "):
        if value.get("op") not in ("conv1x1", "einsum"):
            return f"a mixing step's op must be conv1x1 or einsum, not {value.get('op')!r}"
    elif what.startswith("order of "):
        if not isinstance(value.get("order"), str) or not isinstance(value.get("code"), str):
            return "an order's entry needs an 'order' and a 'code' string"
    else:
        return "neither a mixing step nor an order"
    seconds = value.get("seconds")
    if not isinstance(seconds, (int, float, dict)) or isinstance(seconds, bool):
        return "its seconds are not a number"
    return None


def update(change: Callable[[Devices, Choices], None]) -> tuple[Devices, Choices]:
    """Apply ``change`` to the file's current content and write it back, under the lock;
    return what was written. Where the file cannot be written, warn and return the changed
    content all the same (the caller keeps it for this process)."""
    where = path()
    with _locked(where):
        devices, choices = read()
        change(devices, choices)
        for key in list(choices)[:max(len(choices) - MAX_CHOICES, 0)]:
            del choices[key]
        _write(where, {"format": FORMAT, "devices": devices, "choices": choices})
    return devices, choices


@contextlib.contextmanager
def _locked(where: Path) -> Iterator[None]:
    """An exclusive lock on ``<file>.lock`` for a read-modify-write; none where the platform
    or the directory does not allow one (the write is then still atomic, not merged)."""
    try:
        import fcntl
        where.parent.mkdir(parents=True, exist_ok=True)
        handle = open(where.with_name(where.name + ".lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks: as without fcntl
        yield


def _write(where: Path, data: dict[str, Any]) -> None:
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: a reader never sees half a file
        fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=".calibration-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, where)
        tmp = None
    except OSError as exc:
        warnings.warn(f"tnspec: cannot write the calibration cache {where} ({exc}); the "
                      f"calibration is kept for this process only (set {ENV_DIR} to a "
                      "writable directory)", stacklevel=5)
    finally:
        if tmp is not None:  # a failed write leaves no copy of the cache behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
