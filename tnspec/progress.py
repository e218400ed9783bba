"""Progress of long operations (fits, ``tensorize``) on stderr, where a person watches it.

Shown only when stderr is a terminal, so logs, CI output and piped runs stay clean: a status
line rewritten in place at most once a second, and a permanent line per finished item.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
        if self.on and now - self.last >= self.every:
            self.last, self.open = now, True
            self._write(f"\r{self.what}: {text} ({now - self.start:.0f} s)\x1b[K")

    def line(self, text: str) -> None:
        """A line that stays (one finished item)."""
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
