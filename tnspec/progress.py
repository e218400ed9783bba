"""Progress of long operations (fits, ``tensorize``, ``compress``): always to the ``tnspec``
logger (a record at INFO per finished item, at DEBUG per status update), and on stderr where a
person watches it.

The stderr lines show only when stderr is a terminal, so CI output and piped runs stay clean: a
status line rewritten in place at most once a second, and a permanent line per finished item.
``logging.basicConfig(level=logging.INFO)`` shows the items anywhere.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("tnspec")

#: the clock that bounds long jobs (the ``max_seconds`` of fits and of ``compress``), read in
#: this one place so that a test can run them on a clock of its own (``tests/conftest.py``
#: stops it: no test's outcome depends on how busy the machine is)
clock = time.monotonic


def now() -> float:
    """Seconds on :data:`clock`."""
    return clock()


class Progress:
    """A status line for ``what``; silent unless ``stream`` (stderr) is a terminal."""

    def __init__(self, what: str, every: float = 1.0, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.what, self.every = what, every
        self.start = self.last = time.monotonic()
        self.open = False  # a status line is on screen

    def update(self, text: str) -> None:
        """Rewrite the status line, at most once per ``every`` seconds."""
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.debug("%s: %s (%.0f s)", self.what, text, now - self.start)
        if self.on and self.last == now:
            self.open = True
            self._write(f"\r{self.what}: {text} ({now - self.start:.0f} s)\x1b[K")

    def line(self, text: str) -> None:
        """A line that stays (one finished item)."""
        log.info("%s: %s", self.what, text)
        if self.on:
            self.open = False
            self._write(f"\r{self.what}: {text}\x1b[K\n")

    def close(self) -> None:
        """End the status line, if one is shown."""
        if self.open:
            self.open = False
            self._write("\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
