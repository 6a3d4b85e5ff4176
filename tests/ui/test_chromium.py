"""The page in a real browser: Debian's headless Chromium loads it from the test server, runs its script, and the
DOM it leaves shows the CLI's numbers for the same setup; a screenshot is painted.

Chromium is found (or installed, as root) by the fixture of ``tests/report/test_chromium.py``; without it these
tests skip and say why. The page's sliders are moved through its URL (``?batch=2&seq=4096`` goes through the same
``setValue`` → ``refresh`` path as a slider's input event).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.report.test_chromium import chromium  # noqa: F401 - the fixture
from tests.ui.conftest import EXAMPLE, run_cli
from vramledger.units import fmt_bytes


def _chrome(chromium: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:  # noqa: F811
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
        "--window-size=1400,1500",
        "--virtual-time-budget=15000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _text(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*>(.*?)</div>', dom, re.S)
    assert m, f"no #{element_id} in the DOM"
    return html.unescape(re.sub(r"<[^>]+>", "", m.group(1))).strip()


def _section(dom: str, element_id: str) -> str:
    start = dom.index(f'id="{element_id}"')
    return dom[start : dom.index("</svg>", start)]


@pytest.mark.parametrize(
    ("query", "argv"),
    [
        pytest.param("", [], id="the-config-as-loaded"),
        pytest.param("?batch=2&seq=4096", ["--batch", "2", "--seq", "4096"], id="sliders-moved"),
    ],
)
def test_the_page_shows_the_clis_numbers(chromium, server, client, capsys, tmp_path, query, argv):  # noqa: F811
    """The server runs with the docs' LLaMA-Factory example as --config; the page's GPU starts on the RTX 4090."""
    _, out, _ = run_cli(capsys, ["estimate", "--config", str(EXAMPLE), *argv, "--gpu", "rtx-4090", "--json"])
    ledger = json.loads(out)
    res = _chrome(chromium, tmp_path, "--dump-dom", server.url + query)
    dom = res.stdout
    assert 'id="bill"' in dom, res.stderr[-800:]
    v = ledger["verdict"]
    want = (
        f"FITS on {v['gpu']}: {fmt_bytes(v['margin_bytes'])} to spare"
        if ledger["fits"]
        else f"DOES NOT FIT on {v['gpu']}: {fmt_bytes(-v['margin_bytes'])} over"
    )
    got = _text(dom, "verdict-line")
    print("expected:", want, "| got:", got, "| match:", got == want)
    assert got == want
    assert f"device total {fmt_bytes(ledger['device_total_bytes'])}" in _text(dom, "verdict-sub")
    # one bar segment per (category, phase) with bytes, as in the CLI's items
    cells = {(i["category"], i["phase"]) for i in ledger["items"] if i["bytes"]}
    assert len(re.findall(r"<rect [^>]*data-category=", _section(dom, "bill"))) == len(cells)
    # the heatmap: one cell per grid point the API gives, and the frontier drawn
    status, raw = client.post("grid", {"startup_config": True, "gpu": "rtx-4090"})
    grid = json.loads(raw)
    heat = _section(dom, "heatmap")
    assert heat.count('class="cell"') == len(grid["batches"]) * len(grid["lengths"])
    assert "<path " in heat and "<circle " in heat
    assert 'id="remedies"' in dom and "<svg" in dom[dom.index('id="remedies"') :]


def test_a_screenshot_is_painted(chromium, server, tmp_path):  # noqa: F811
    shot = tmp_path / "ui.png"
    res = _chrome(chromium, tmp_path, f"--screenshot={shot}", server.url)
    assert shot.exists(), res.stderr[-800:]
    image = pytest.importorskip("matplotlib.image")
    pixels = image.imread(shot)
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000
    assert pixels.std() > 0.05
