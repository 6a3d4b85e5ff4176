"""Argument types for argparse: every number a flag takes is checked here, with its bounds, at parse time.

A value out of bounds is bad input (one line, exit 2), never something a search runs on: a number the user can
make huge must not decide how long a command takes. The bounds are far beyond any real setup (a micro-batch of
65,536 sequences, 16M-token sequences) yet small enough that every search over them stays instant.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

MAX_BATCH = 2**16
"""Sequences per micro-batch, global batch, accumulation steps."""
MAX_TOKENS = 2**24
"""Tokens per sequence (16,777,216; the longest context of any catalog model is 131,072)."""
MAX_EVAL_BATCH = 2**12
"""Evaluation batch: the advice searches eval batches below it one by one (``analytic/evaluation.py``)."""
MAX_FIT_BATCH = 2**10
"""``fit --max-batch``: the frontier searches the length for every micro-batch up to it."""
MAX_COUNT = 2**20
"""Other counts: LoRA rank, eval steps, generated tokens, frozen layers."""
MAX_SEED = 2**63 - 1
"""``torch.manual_seed`` takes a signed 64-bit integer."""


def count(lo: int = 1, hi: int = MAX_COUNT, *, what: str = "integer") -> Callable[[str], int]:
    """An integer in [lo, hi]; argparse reports the error as ``argument --flag: ...``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a {what} in [{lo}, {hi}]") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range; give a {what} in [{lo}, {hi:,}]")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


KILO = 1024
"""``32k`` is 32,768 tokens: context lengths are named in binary thousands (Qwen2.5's 32K is
``max_position_embeddings: 32768``, Llama 3.1's 128K is 131072)."""


def tokens(hi: int = MAX_TOKENS, *, what: str = "length") -> Callable[[str], int]:
    """A token count in [1, hi], written ``4096``, ``4_096``, ``32k`` or ``1.5k`` (a k is 1,024 tokens)."""
    plain = count(hi=hi, what=what)

    def parse(text: str) -> int:
        body = text.strip().replace("_", "")
        if body[-1:] not in ("k", "K"):
            return plain(text)
        try:
            thousands = float(body[:-1])
        except ValueError:
            thousands = math.nan
        value = thousands * KILO
        if not (math.isfinite(value) and value == int(value)):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number of tokens; give a {what} in [1, {hi:,}] (32k = {32 * KILO:,})"
            )
        return plain(str(int(value)))

    parse.__name__ = what
    return parse


def real(
    lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False, what: str = "number"
) -> Callable[[str], float]:
    """A finite float in [lo, hi] (open ends when asked); ``nan`` and ``inf`` are refused."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a {what} in {interval}") from None
        ok = (
            math.isfinite(value)
            and (value > lo if lo_open else value >= lo)
            and (value < hi if hi_open else value <= hi)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"{text} is out of range; give a {what} in {interval}")
        return value

    parse.__name__ = what
    return parse


MAX_IMAGE_SIDE = 1 << 16
"""Pixels per side of an image (``--image-size``): PIL's practical limit is far below this."""


def image_size(text: str) -> tuple[int, int]:
    """``WxH`` in pixels (``1024x768``), each side in [1, MAX_IMAGE_SIDE]."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        w, h = (int(p.strip()) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        w = h = 0
    if not (1 <= w <= MAX_IMAGE_SIDE and 1 <= h <= MAX_IMAGE_SIDE):
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT in pixels; e.g. 1024x768")
    return w, h


def name(text: str) -> str:
    """A non-empty word (a choice, a GPU, a format): an empty string is never a silent default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the value is empty; give one of the choices in --help")
    return text


def out_path(text: str) -> Path:
    """An output path; the empty string would be the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; name a file or folder")
    return Path(text)


def in_path(text: str) -> Path:
    """An input path (existence and kind are checked when it is read: ``vramledger.userfiles``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; name a file")
    return Path(text)


fraction = real(0.0, 1.0, hi_open=True, what="fraction")
"""A fraction in [0, 1) (headroom, dropout, momentum)."""


PATH_TYPES: tuple[object, ...] = (Path, in_path, out_path)
"""Every argparse type that names a file: what ``vramledger ui`` refuses in a request."""
