"""Render the HTML page in headless Chromium and check that every figure is drawn with a non-zero size.

Chromium is Debian's ``chromium``; when it is absent the test tries ``apt-get install -y chromium`` (as root
only), and skips, saying why, when it can neither find nor install it. CI installs it beforehand
(see docs/report.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

FIGURES = ["bill", "cliff_grid", "cliff_curves", "timeline", "remedies"]
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _find() -> str | None:
    return next((p for p in map(shutil.which, _NAMES) if p), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    found = _find()
    if found:
        return found
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium not found, and cannot install it here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    try:
        if subprocess.run(install, capture_output=True, timeout=600, env=env).returncode != 0:
            # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, timeout=300, env=env)
            subprocess.run(install, check=True, capture_output=True, timeout=600, env=env)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"chromium not found and `apt-get install -y chromium` failed: {exc}")
    return _find() or pytest.skip("chromium installed but not on PATH")


# Appended to a copy of the page (the report itself has no script): writes each figure's drawn size, and how
# many of its SVG shapes and texts have a non-empty box, into the DOM, which --dump-dom then prints.
_PROBE = """<script>
const out = {};
for (const f of document.querySelectorAll("figure.vl-figure")) {
  const svg = f.querySelector("svg"), r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  let drawn = 0;
  if (svg) for (const e of svg.querySelectorAll("path, rect, text, use, image")) {
    const b = e.getBoundingClientRect(); if (b.width > 0 || b.height > 0) drawn++;
  }
  out[f.dataset.figure] = {width: r.width, height: r.height, drawn: drawn};
}
const pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _run(chromium: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1200,900",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_every_figure_is_drawn(chromium, full_page, tmp_path):
    _, page = full_page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    res = _run(chromium, tmp_path, "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="probe">(.*?)</pre>', res.stdout, re.S)
    assert m, f"no probe output; chromium said: {res.stderr[-800:]}"
    sizes = json.loads(m.group(1).replace("&quot;", '"'))
    print(sizes)
    assert list(sizes) == FIGURES
    for name, s in sizes.items():
        assert s["width"] > 300 and s["height"] > 150, (name, s)
        assert s["drawn"] > 20, (name, s)  # axes, ticks, labels and marks, not an empty frame


def test_screenshot_is_not_blank(chromium, full_page, tmp_path):
    """The untouched page renders to a PNG that is not one flat colour (a cheap check that pixels were painted)."""
    _, page = full_page
    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    shot = tmp_path / "shot.png"
    res = _run(chromium, tmp_path, f"--screenshot={shot}", path.as_uri())
    assert shot.exists(), res.stderr[-800:]
    matplotlib = pytest.importorskip("matplotlib.image")
    pixels = matplotlib.imread(shot)
    assert pixels.std() > 0.05
