"""The HTML page: self-contained (no external URL anywhere a browser would fetch), valid ids, the ledger's numbers."""

from __future__ import annotations

import re
from collections import Counter
from html.parser import HTMLParser

import pytest

from vramledger.ledger import Category
from vramledger.report.html import inline_svg, ledger_table
from vramledger.units import fmt_bytes

FIGURES = ["bill", "cliff_grid", "cliff_curves", "timeline", "remedies"]


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(page: str) -> _Collect:
    p = _Collect()
    p.feed(page)
    return p


def test_no_external_urls(full_page):
    _, page = full_page
    parsed = _parse(page)
    fetchers = {"script", "link", "iframe", "object", "embed", "img", "source", "video", "audio", "base"}
    assert not [t for t, _ in parsed.tags if t in fetchers], "the page must not load anything"
    for tag, attrs in parsed.tags:
        for name, value in attrs.items():
            if name in ("src", "href", "xlink:href", "action", "data", "poster") and value:
                assert value.startswith("#") or value.startswith("data:"), (tag, name, value)
            assert not re.search(r"https?://", value or ""), (tag, name, value)
    for ref in re.findall(r"url\(\s*['\"]?([^)'\"]*)", page):
        assert ref.startswith("#") or ref.startswith("data:"), ref
    assert "@import" not in page and "@font-face" not in page
    # no link of any kind in markup: the only http(s) text allowed is plain text (e.g. a model's config URL)
    markup = re.sub(r">[^<]*<", "><", page)
    assert not re.search(r"https?://", markup)


def test_every_figure_once_with_unique_ids(full_page):
    _, page = full_page
    parsed = _parse(page)
    figures = [a["data-figure"] for t, a in parsed.tags if t == "figure"]
    assert figures == FIGURES
    ids = Counter(a["id"] for _, a in parsed.tags if a.get("id"))
    assert [i for i, n in ids.items() if n > 1] == []
    # every in-page reference points at an id that exists
    for ref in re.findall(r'(?:url\(#|href="#)([^")]+)', page):
        assert ref in ids, ref


def test_table_and_figures_carry_the_ledgers_numbers(full_page):
    ledger, page = full_page
    text = " ".join(_parse(page).text)
    for p in ledger.phases:
        assert fmt_bytes(ledger.device(p)) in text
        assert fmt_bytes(ledger.allocated(p)) in text
    assert fmt_bytes(ledger.bytes_of(Category.LOGITS_LOSS, ledger.peak_phase)) in text
    assert "DOES NOT FIT" in text and fmt_bytes(-ledger.verdict.margin_bytes) in text
    # the bill figure labels its peak bar with the device total, as text in the SVG
    bill = page[page.index('data-figure="bill"') : page.index('data-figure="cliff_grid"')]
    assert f"{ledger.device_total / 2**30:.2f} GiB" in bill


def test_table_rows():
    from vramledger.ledger import Basis, Ledger, LineItem, Phase
    from vramledger.units import GiB

    items = (
        LineItem(category=Category.WEIGHTS, phase=Phase.FORWARD, bytes=3 * GiB, label="w", source="s"),
        LineItem(
            category=Category.CUDA_CONTEXT,
            phase=Phase.FORWARD,
            bytes=GiB,
            label="c",
            source="s",
            basis=Basis.ASSUMPTION,
        ),
    )
    table = ledger_table(Ledger(model="m", params=1, trainable_params=1, items=items, engine="test"))
    cells = re.findall(r"<td[^>]*>(?:<span[^>]*></span>)?([^<]*)</td>", table)
    assert cells == [
        "weights",
        "3.00 GiB",
        "peak allocated",
        "3.00 GiB",
        "+ allocator reserve",
        "–",
        "= peak reserved",
        "3.00 GiB",
        "+ CUDA context",
        "1.00 GiB",
        "= device total (nvidia-smi)",
        "4.00 GiB",
    ]


def test_inline_svg_prefixes_ids_and_strips_namespaces():
    svg = (
        '<?xml version="1.0"?>\n<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN"\n "http://www.w3.org/x.dtd">\n'
        '<svg xmlns:xlink="http://www.w3.org/1999/xlink" width="1pt" xmlns="http://www.w3.org/2000/svg">'
        '<metadata><rdf:RDF xmlns:dc="http://purl.org/dc/elements/1.1/"/></metadata>'
        '<defs><path id="m1" d="M0 0"/><clipPath id="p2"><rect/></clipPath></defs>'
        '<use xlink:href="#m1"/><g clip-path="url(#p2)"/><a href="#elsewhere"/></svg>'
    )
    out = inline_svg(svg, "bill")
    assert "http" not in out and "<?xml" not in out and "metadata" not in out
    assert 'id="bill-m1"' in out and 'xlink:href="#bill-m1"' in out and "url(#bill-p2)" in out
    assert 'href="#elsewhere"' in out  # not an id of this SVG: left alone
    assert out.startswith('<svg role="img" aria-labelledby="bill-caption"')


def test_missing_matplotlib_names_the_extra(monkeypatch, hand_ledger, tmp_path):
    import sys

    from vramledger.errors import VramledgerError
    from vramledger.report.html import write_html

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with pytest.raises(VramledgerError, match=r"vramledger\[report\]"):
        write_html(tmp_path / "r.html", hand_ledger)
