"""``--png DIR``: the HTML page's figures as PNG files, for terminals and issue trackers (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from vramledger.errors import VramledgerError
from vramledger.report.figures import Figures


def write_pngs(directory: Path, figures: Figures, *, dpi: int = 110) -> list[Path]:
    """Write ``<stem>.png`` for every figure present (bill, cliff_grid, cliff_curves, timeline, remedies).

    Creates ``directory`` if needed; returns the paths written, in display order.
    """
    from vramledger.report.plots import render

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VramledgerError(f"--png: cannot create folder {directory}: {exc.strerror}") from exc
    written = []
    for stem, _caption, data in render(figures, "png", dpi=dpi):
        path = directory / f"{stem}.png"
        path.write_bytes(data)
        written.append(path)
    return written
