"""The page driven as a person drives it (Playwright on Debian's Chromium): keys move the sliders, a click applies a
remedy, a file is chosen, a config is exported; after each step the numbers shown are the CLI's for that setup.

Playwright is not a dependency of vramledger (`pip install playwright`; it drives the system Chromium, nothing is
downloaded); without it, or without Chromium, these tests skip and say why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.ui.conftest import EXAMPLE, run_cli
from vramledger.adapters import load_config
from vramledger.units import fmt_bytes

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright to drive the page")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's)")


@pytest.fixture
def page(server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        # bypass_csp: the page's policy forbids eval, which Playwright's waiting functions use
        pg = browser.new_page(viewport={"width": 1400, "height": 1200}, accept_downloads=True, bypass_csp=True)
        pg.goto(server.url)
        _settled(pg)
        yield pg
        browser.close()


def _settled(pg) -> None:
    """Wait until the page has drawn the answer to its latest request (it numbers them on <body>) and no newer
    one is pending."""
    pg.wait_for_function("() => document.body.dataset.updateSeq !== undefined", timeout=30_000)
    while True:
        seq = pg.evaluate("() => document.body.dataset.updateSeq")
        pg.wait_for_timeout(300)
        if pg.evaluate("() => document.body.dataset.updateSeq") == seq:
            return


def _verdict(ledger: dict) -> str:
    v = ledger["verdict"]
    if ledger["fits"]:
        return f"FITS on {v['gpu']}: {fmt_bytes(v['margin_bytes'])} to spare"
    return f"DOES NOT FIT on {v['gpu']}: {fmt_bytes(-v['margin_bytes'])} over"


def _cli(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, ["estimate", *argv, "--gpu", "rtx-4090", "--json"])
    assert code in (0, 3), err
    return json.loads(out)


def test_sliders_moved_by_keys_show_the_clis_numbers(page, capsys):
    want = _cli(capsys, "--config", str(EXAMPLE))
    assert page.inner_text("#verdict-line") == _verdict(want)
    slider = page.locator('.slider[data-flag="batch"] input')
    slider.focus()
    for _ in range(2):
        page.keyboard.press("ArrowRight")  # micro-batch 1 → 3
    _settled(page)
    want = _cli(capsys, "--config", str(EXAMPLE), "--batch", "3")
    assert page.inner_text('.slider[data-flag="batch"] output') == "3"
    assert page.inner_text("#verdict-line") == _verdict(want)
    assert f"device total {fmt_bytes(want['device_total_bytes'])}" in page.inner_text("#verdict-sub")
    page.locator('.slider[data-flag="seq"] input').focus()
    page.keyboard.press("ArrowLeft")  # 2048 → 1536 on the page's length steps
    _settled(page)
    want = _cli(capsys, "--config", str(EXAMPLE), "--batch", "3", "--seq", "1536")
    assert page.inner_text("#verdict-line") == _verdict(want)
    assert "--batch 3 --seq 1536" in page.inner_text("#command")


def test_a_remedy_clicked_is_applied(page, capsys):
    page.wait_for_selector("#remedies g.remedy", timeout=30_000)
    row = page.locator("#remedies g.remedy", has_text="loss → fused")
    row.locator("text").first.click()
    page.wait_for_timeout(800)
    _settled(page)
    want = _cli(capsys, "--config", str(EXAMPLE), "--loss", "fused")
    assert page.input_value('select[data-flag="loss"]') == "fused"
    assert page.inner_text("#verdict-line") == _verdict(want)


def test_a_chosen_config_is_loaded_and_exported_back(page, capsys, tmp_path):
    """A TRL config chosen on the page: the controls take its values, the numbers are the CLI's for that file,
    and "as your config" gives back a TRL file that the adapters read to the same setup."""
    fixture = Path(__file__).resolve().parents[1] / "adapters" / "fixtures" / "trl_sft_lora.yaml"
    config = tmp_path / fixture.name  # names Qwen/Qwen2-0.5B, not in the catalog: the page names the model
    config.write_text(fixture.read_text())
    page.set_input_files("#files", str(config))
    page.wait_for_selector("#error", state="visible")  # the CLI's own message: the model is not in the catalog
    assert "Qwen/Qwen2-0.5B" in page.inner_text("#error")
    page.fill("#model", "Qwen/Qwen2.5-0.5B")
    page.dispatch_event("#model", "change")
    page.wait_for_selector("#error", state="hidden")
    _settled(page)
    want = _cli(capsys, "Qwen/Qwen2.5-0.5B", "--config", str(config))
    assert page.inner_text("#verdict-line") == _verdict(want)
    assert page.inner_text('.slider[data-flag="batch"] output') == "2"  # per_device_train_batch_size: 2
    assert "file: per_device_train_batch_size" in page.inner_text("#provenance")
    with page.expect_download() as download:
        page.click('[data-export="config"]')
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    back, original = load_config(saved), load_config(config, require_model=False)
    assert back.format == "trl" and back.model == "Qwen/Qwen2.5-0.5B"
    assert (back.train.micro_batch, back.train.grad_accum, back.train.packing) == (
        original.train.micro_batch,
        original.train.grad_accum,
        original.train.packing,
    )
