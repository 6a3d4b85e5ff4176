"""Byte sizes: parsing user input and formatting for display. Bytes everywhere else; units only here.

GiB = 2**30 bytes, GB = 10**9 bytes; we print GiB (what torch and nvidia-smi's MiB are based on).
"""

from __future__ import annotations

import re

KiB = 2**10
MiB = 2**20
GiB = 2**30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
    "k": KiB,
    "m": MiB,
    "g": GiB,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int | None:
    """``"24GiB"`` → 25769803776; ``"80GB"`` → 80e9; ``None`` when the text is not a size."""
    m = _SIZE.match(text)
    if not m or (m.group(2).lower() not in _UNITS) or not m.group(2):
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n: int) -> float:
    return n / GiB


def fmt_bytes(n: int, *, signed: bool = False) -> str:
    """Human size in binary units: ``1.50 GiB``, ``812.0 MiB``, ``0 B``."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    a = abs(n)
    if a >= GiB:
        return f"{sign}{a / GiB:.2f} GiB"
    if a >= MiB:
        return f"{sign}{a / MiB:.1f} MiB"
    if a >= KiB:
        return f"{sign}{a / KiB:.1f} KiB"
    return f"{sign}{a} B"
