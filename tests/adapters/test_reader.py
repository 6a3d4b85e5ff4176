"""``Reader.origin``: the provenance of a setting read from one key, as the adapters record it."""

from __future__ import annotations

import pytest

from vramledger.adapters._base import Reader


@pytest.mark.parametrize(
    ("raw", "overridden", "expected"),
    [
        ({"cutoff_len": 4096}, (), "file: cutoff_len"),
        ({"cutoff_len": 4096}, ("cutoff_len",), "override: cutoff_len"),
        ({}, (), "default: llamafactory (hparams/data_args.py cutoff_len=2048)"),
        # YAML ``cutoff_len:`` with nothing after it is unset, so the framework's default applies
        ({"cutoff_len": None}, (), "default: llamafactory (hparams/data_args.py cutoff_len=2048)"),
    ],
    ids=["file", "override", "absent", "empty"],
)
def test_origin_names_the_file_or_the_cited_default(
    raw: dict[str, object], overridden: tuple[str, ...], expected: str
) -> None:
    r = Reader(raw, framework="llamafactory", source="x.yaml", overridden=overridden)
    assert r.origin("cutoff_len", "hparams/data_args.py cutoff_len=2048") == expected


def test_origin_marks_nothing_used() -> None:
    """Only reading a value marks its key used; asking where it came from does not hide an unread key."""
    r = Reader({"cutoff_len": 4096}, framework="llamafactory", source="x.yaml")
    r.origin("cutoff_len", "cite")
    r.finish(())
    assert r.warnings == [
        "ignored: cutoff_len (not a llamafactory setting vramledger knows; if it changes memory, the estimate "
        "leaves it out)"
    ]
