"""``--png DIR``: the HTML page's figures as PNG files, for terminals and issue trackers (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from vramledger.errors import VramledgerError
from vramledger.report.figures import Figures

FIGURE_STEMS = ("bill", "cliff_grid", "cliff_curves", "timeline", "remedies")
"""Every file ``--png DIR`` may write, as ``DIR/<stem>.png`` (``report.plots.render`` names them)."""


def png_paths(directory: Path) -> list[Path]:
    """The files ``--png DIR`` may write, checked before any command runs (``vramledger.userfiles``)."""
    return [directory / f"{stem}.png" for stem in FIGURE_STEMS]


def write_pngs(directory: Path, figures: Figures, *, dpi: int = 110) -> list[Path]:
    """Write ``<stem>.png`` for every figure present (bill, cliff_grid, cliff_curves, timeline, remedies).

    Creates ``directory`` if needed; every file goes through a temporary file renamed into place
    (``userfiles.write_atomic``); returns the paths written, in display order.
    """
    from vramledger.report.plots import render
    from vramledger.userfiles import write_atomic

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VramledgerError(f"--png: cannot create folder {directory}: {exc.strerror}; pick another folder") from None
    rendered = render(figures, "png", dpi=dpi)
    for stem, _caption, _data in rendered:
        if (directory / f"{stem}.png").is_dir():
            raise VramledgerError(f"--png: {directory / f'{stem}.png'} is a folder; pick another folder")
    return [write_atomic(directory / f"{stem}.png", data, "--png") for stem, _caption, data in rendered]
