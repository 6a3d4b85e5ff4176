"""A one-line progress indicator on a terminal, for commands that take tens of seconds (``trace``).

Only when the stream is a TTY (never in pipes, files or CI logs); the line is erased when the work ends, so the
command's own output is unchanged. A context manager with no module-level state: nothing outlives the ``with``.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


class Progress:
    """``with Progress("tracing qwen2.5-0.5b on fake tensors"):`` shows ``… 12 s`` on stderr while it runs."""

    def __init__(self, what: str, *, stream: TextIO | None = None, interval_s: float = 1.0) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    @property
    def active(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _line(self, elapsed: float) -> str:
        return f"{self.what}… {elapsed:.0f} s"

    def _run(self, start: float) -> None:
        while not self._stop.wait(self.interval_s):
            line = self._line(time.monotonic() - start)
            self._width = max(self._width, len(line))
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()

    def __enter__(self) -> Progress:
        if self.active:
            start = time.monotonic()
            line = self._line(0)
            self._width = len(line)
            self.stream.write(line)
            self.stream.flush()
            self._thread = threading.Thread(target=self._run, args=(start,), daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._thread = None
