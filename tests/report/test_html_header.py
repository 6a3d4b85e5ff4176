"""The HTML page's header names the settings in words: no Python repr of a mapping or an object."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest


def test_header_has_no_python_repr(hand_ledger) -> None:
    pytest.importorskip("matplotlib")
    from vramledger.report.html import render_html

    class Conf:  # what the trace keeps, e.g. an allocator configuration object
        pass

    settings = {"method": "lora", "targets": ("q_proj", "v_proj"), "allocator": {"oom": None}, "conf": Conf()}
    ledger = dataclasses.replace(hand_ledger, settings=MappingProxyType(settings))
    header = render_html(ledger).split('<p class="sub">', 1)[1].split("</p>", 1)[0]
    assert "method lora" in header and "targets q_proj, v_proj" in header
    assert "{" not in header and "object at 0x" not in header and "(" not in header.split("<br>", 1)[1]
