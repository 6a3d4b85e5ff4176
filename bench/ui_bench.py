"""Latency of the page's requests, over real HTTP to `vramledger ui` running in its own process.

What one slider move costs: the page sends /api/estimate and /api/setup at once (the bill and the verdict are
redrawn when both answer), then, 60 ms after the last move, /api/fit and /api/grid (the heatmap), and 250 ms
after it /api/plan (the remedies). A "slider move" here is a new micro-batch or length: the grid's cells do not
change, so they come from the planner's cache; a "toggle" (checkpointing on/off, another optimizer) is a setup
none of the caches has seen. Then, when Playwright and Chromium are installed, the page itself: the time from a
slider's input event to the bill (and to the heatmap) redrawn, as the page measures it (``performance.now()``,
written on <body> as ``data-update-ms`` and ``data-heatmap-ms``).

Run: nice -n 10 python bench/ui_bench.py   (target: a slider move's estimate + setup well under 50 ms)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
BASE = {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "gpu": "rtx-4090", "grad_ckpt": True}
BATCHES = [1, 2, 3, 4, 6, 8]
LENGTHS = [512, 1024, 2048, 3072, 4096]


def start_server() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "vramledger", "ui", "--no-browser", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[2]


def post(url: str, endpoint: str, body: dict[str, object]) -> float:
    """Seconds for one request, from sending to the last byte of the answer."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + f"api/{endpoint}", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as res:
        res.read()
    return time.perf_counter() - t0


def summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"  {name:<38} median {statistics.median(ms):7.1f} ms   p95 {p95:7.1f} ms   (n={len(ms)})"


def slider_moves(url: str) -> list[str]:
    moves = [{**BASE, "batch": b, "seq": L} for L in LENGTHS for b in BATCHES]
    for body in moves[:3]:  # imports and first resolutions
        post(url, "estimate", body)
    out = []
    for endpoint in ("estimate", "setup"):
        out.append(summary(f"{endpoint} (slider move)", [post(url, endpoint, m) for m in moves]))
    both = []
    for m in moves:
        t0 = time.perf_counter()
        post(url, "estimate", m)
        post(url, "setup", m)
        both.append(time.perf_counter() - t0)
    out.append(summary("estimate + setup, one after the other", both))
    post(url, "fit", moves[0])
    post(url, "grid", moves[0])
    for endpoint in ("fit", "grid", "plan"):
        out.append(summary(f"{endpoint} (slider move)", [post(url, endpoint, m) for m in moves[::3]]))
    return out


def toggles(url: str) -> list[str]:
    """Setups no cache has seen: each optimizer × checkpointing × loss, at a fixed shape."""
    setups = [
        {**BASE, "batch": 2, "seq": 2048, "optimizer": o, "grad_ckpt": c, "loss": x}
        for o in ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "sgd")
        for c in (True, False)
        for x in ("standard", "chunked")
    ]
    out = []
    for k, endpoint in enumerate(("estimate", "fit", "grid", "plan")):
        # a headroom of its own per endpoint (part of the planner cache's key): none finds another's ledgers
        out.append(
            summary(
                f"{endpoint} (toggle: unseen setup)",
                [post(url, endpoint, {**s, "headroom": 0.08 + k / 1000}) for s in setups],
            )
        )
    return out


# Moves the batch slider as a person does (an input event on the range input) and waits for the page to say it
# has redrawn: the bill (data-update-seq) or the heatmap (data-heatmap-seq, 60 ms of debounce included).
_MOVE = """async ([value, seqKey, msKey]) => {
  const input = document.querySelector('.slider[data-flag="batch"] input');
  const before = document.body.dataset[seqKey];
  input.value = value;
  input.dispatchEvent(new Event("input"));
  while (document.body.dataset[seqKey] === before) await new Promise((r) => setTimeout(r, 1));
  return Number(document.body.dataset[msKey]);
}"""


def in_browser(url: str) -> list[str]:
    """The page in Chromium, driven by Playwright when it is installed (it is not a dependency of vramledger)."""
    chrome = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return ["  in the browser: skipped (pip install playwright to drive the page; it uses the system chromium)"]
    if chrome is None:
        return ["  in the browser: skipped (no chromium)"]
    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chrome, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1200}, bypass_csp=True)  # lets it evaluate
        page.goto(url + "?seq=2048")
        page.wait_for_function("document.body.dataset.heatmapSeq !== undefined", timeout=60_000)
        for seq_key, ms_key, name, wait in (
            ("updateSeq", "updateMs", "slider → bill and verdict redrawn", 0),
            ("heatmapSeq", "heatmapMs", "slider → heatmap redrawn", 300),
        ):
            times = []
            for b in [2, 3, 4, 5, 6, 7, 8, 1] * 3:
                times.append(page.evaluate(_MOVE, [b, seq_key, ms_key]) / 1e3)
                page.wait_for_timeout(wait)  # let the plan of the last move finish, as after a person's move
            out.append(summary(f"in Chromium: {name}", times))
        browser.close()
    return out


def main() -> None:
    proc, url = start_server()
    try:
        print(f"vramledger ui at {url} (its own process); {os.cpu_count()} CPUs here")
        print("slider moves (micro-batch 1-8 x length 512-4096, Llama-3.1-8B LoRA, RTX 4090):")
        for line in slider_moves(url):
            print(line)
        print("toggles:")
        for line in toggles(url):
            print(line)
        for line in in_browser(url):
            print(line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
