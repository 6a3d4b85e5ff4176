"""The progress line: on a terminal only, erased at the end, so piped output is unchanged."""

from __future__ import annotations

import io
import time

from vramledger.report.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("tracing", stream=out, interval_s=0.01):
        time.sleep(0.05)
    assert out.getvalue() == ""


def test_on_a_terminal_it_counts_and_erases_itself() -> None:
    out = _Tty()
    with Progress("tracing x", stream=out, interval_s=0.01):
        time.sleep(0.1)
    text = out.getvalue()
    assert text.startswith("tracing x… 0 s") and "\r" in text
    assert text.endswith("\r") and text.rsplit("\r", 2)[-2].strip() == ""  # the last thing written is blanks
