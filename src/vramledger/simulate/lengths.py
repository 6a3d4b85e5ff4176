"""The token lengths of the samples a run will see: from a file, summary statistics, or a dataset.

Accepted by ``read_lengths(spec)``:
- ``mean,p50,p99,max`` (four numbers): a log-normal with median p50 and 99th percentile p99 (so
  ``mu = ln p50``, ``sigma = (ln p99 − ln p50) / 2.3263``, z(0.99) = 2.3263), drawn with ``random.Random(seed)``
  and capped at ``max``. The mean is only checked: a log-normal with these quantiles has mean
  ``exp(mu + sigma²/2)``; a warning says when the given mean is more than 25% away;
- a ``.json`` file: a list of lengths, an object with ``lengths``, or the ground-truth runner's
  ``lengths.json`` (``train_lengths`` in the order the run used them, ``eval_lengths``);
- a text file with one length per line;
- a dataset (``.jsonl``, ``.json`` list of records, ``.csv``, ``.parquet``) with a length column (``length``,
  ``num_tokens``, ``n_tokens``, ``input_length``, ``len``) or text (``text``, ``content``, alpaca's
  ``instruction``/``input``/``output``, ``messages``/``conversations`` lists): tokenised with the model's
  tokenizer when transformers has it in the local cache (never downloaded), else at
  ``CHARS_PER_TOKEN`` characters per token.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError

CHARS_PER_TOKEN = 4.0
"""Fallback without a local tokenizer: about 4 characters of English text per token for the BPE tokenizers of
current LLMs (OpenAI's published rule of thumb; Llama-3's tokenizer averages about 4.2 on English prose)."""
Z99 = 2.3263  # standard normal quantile at 0.99
_STATS = re.compile(r"^\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){3}$")
_LENGTH_KEYS = ("length", "num_tokens", "n_tokens", "input_length", "len", "tokens")
_TEXT_KEYS = ("text", "content", "prompt", "completion", "instruction", "input", "output", "response", "chosen")
_CHAT_KEYS = ("messages", "conversations")


@dataclass(frozen=True, kw_only=True, slots=True)
class Lengths:
    """Sample lengths in tokens, before truncation."""

    train: tuple[int, ...]
    eval: tuple[int, ...] = ()
    """Evaluation samples, when the source has them (``lengths.json``)."""
    ordered: bool = False
    """The source gives the order a real run used (the ground-truth ``lengths.json``)."""
    source: str = ""
    """Where the lengths came from, in words (tokenizer or fallback included)."""
    warnings: tuple[str, ...] = ()
    stats: tuple[float, float, float, float] | None = None
    """The summary statistics the lengths were drawn from (another seed draws again)."""

    def redraw(self, n: int, seed: int) -> tuple[int, ...]:
        """The training lengths for another shuffle: a new draw from ``stats``, else the same samples."""
        return tuple(lognormal_lengths(self.stats, n, seed)) if self.stats is not None else self.train


def lognormal_lengths(stats: tuple[float, float, float, float], n: int, seed: int) -> list[int]:
    """``n`` lengths from the log-normal matching p50 and p99 (see the module docstring), capped at max."""
    _mean, p50, p99, mx = stats
    mu = math.log(p50)
    sigma = (math.log(p99) - mu) / Z99 if p99 > p50 else 0.0
    rng = random.Random(seed)
    return [min(int(mx), max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def _parse_stats(spec: str) -> tuple[float, float, float, float]:
    mean, p50, p99, mx = (float(x) for x in spec.split(","))
    if not 0 < p50 <= p99 <= mx:
        raise VramledgerError(
            "--lengths mean,p50,p99,max: needs 0 < p50 <= p99 <= max; e.g. --lengths 420,300,1800,2048"
        )
    if mean <= 0:
        raise VramledgerError("--lengths mean,p50,p99,max: the mean must be positive")
    return mean, p50, p99, mx


def read_lengths(spec: str, *, n: int, seed: int = 0, tokenizer_name: str | None = None) -> Lengths:
    """Lengths from ``spec`` (see the module docstring); ``n`` samples are drawn from summary statistics."""
    if _STATS.match(spec) and not Path(spec).exists():
        stats = _parse_stats(spec)
        mean, p50, p99, _ = stats
        sigma = (math.log(p99) - math.log(p50)) / Z99
        implied = p50 * math.exp(sigma**2 / 2)
        warnings: tuple[str, ...] = ()
        if abs(implied - mean) > 0.25 * mean:
            warnings = (
                f"--lengths: a log-normal with p50 {p50:g} and p99 {p99:g} has mean {implied:.0f}, not "
                f"{mean:g}; the draw follows p50 and p99",
            )
        return Lengths(
            train=tuple(lognormal_lengths(stats, n, seed)),
            warnings=warnings,
            stats=stats,
            source=f"log-normal with p50 {p50:g}, p99 {p99:g}, capped at {stats[3]:g} (seed {seed})",
        )
    path = Path(spec)
    if not path.is_file():
        raise VramledgerError(
            f"--lengths: {spec!r} is neither a file nor mean,p50,p99,max; e.g. --lengths lengths.json"
        )
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = _load_json(path)
        if isinstance(data, dict) and ("train_lengths" in data or "lengths" in data):
            train = _int_list(data.get("train_lengths", data.get("lengths")), path)
            ev = _int_list(data.get("eval_lengths", []), path)
            return Lengths(train=train, eval=ev, ordered="train_lengths" in data, source=str(path))
        if isinstance(data, list) and all(isinstance(x, int) for x in data):
            return Lengths(train=_int_list(data, path), source=str(path))
        if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
            return _from_records(data, path, tokenizer_name)
        raise VramledgerError(
            f"--lengths {path}: expected a list of lengths, {{'lengths': [...]}} or a list of records"
        )
    if suffix == ".jsonl":
        records = []
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise VramledgerError(f"--lengths {path}: line {k} is not JSON ({exc.msg})") from None
        return _from_records(records, path, tokenizer_name)
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return _from_records(list(csv.DictReader(f)), path, tokenizer_name)
    if suffix == ".parquet":
        return _from_records(_read_parquet(path), path, tokenizer_name)
    return Lengths(train=_int_lines(path), source=str(path))


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise VramledgerError(f"--lengths {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _int_list(values: Any, path: Path) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in values
    ):
        raise VramledgerError(f"--lengths {path}: lengths must be a list of positive integers")
    return tuple(values)


def _int_lines(path: Path) -> tuple[int, ...]:
    out = []
    for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        s = line.strip()
        if not s:
            continue
        if not s.isdigit() or int(s) <= 0:
            raise VramledgerError(f"--lengths {path}: line {k} is {s!r}, not a positive whole number of tokens")
        out.append(int(s))
    if not out:
        raise VramledgerError(f"--lengths {path}: no lengths in the file")
    return tuple(out)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise VramledgerError("--lengths: reading Parquet needs pyarrow (pip install pyarrow)") from None
    return list(pq.read_table(path).to_pylist())


def _record_text(rec: dict[str, Any]) -> str | None:
    for key in _CHAT_KEYS:
        msgs = rec.get(key)
        if isinstance(msgs, list):
            return "\n".join(str(m.get("content", m.get("value", ""))) if isinstance(m, dict) else str(m) for m in msgs)
    parts = [str(rec[k]) for k in _TEXT_KEYS if isinstance(rec.get(k), str)]
    return "\n".join(parts) if parts else None


def _local_tokenizer(name: str | None) -> Any:
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - not in the local cache (or transformers missing): fall back, said in output
        return None


def _from_records(records: list[Any], path: Path, tokenizer_name: str | None) -> Lengths:
    if not records or not all(isinstance(r, dict) for r in records):
        raise VramledgerError(f"--lengths {path}: expected records (objects) with a length or text column")
    first = records[0]
    key = next((k for k in _LENGTH_KEYS if k in first), None)
    if key is not None:
        try:
            lens = tuple(int(r[key]) for r in records)
        except (KeyError, ValueError, TypeError):
            raise VramledgerError(f"--lengths {path}: column {key!r} must hold a whole number in every row") from None
        return Lengths(train=lens, source=f"{path} (column {key})")
    texts = [_record_text(r) for r in records]
    if any(t is None for t in texts):
        raise VramledgerError(
            f"--lengths {path}: no length column ({', '.join(_LENGTH_KEYS)}) and no text column "
            f"({', '.join(_TEXT_KEYS + _CHAT_KEYS)}) in every row"
        )
    tok = _local_tokenizer(tokenizer_name)
    if tok is not None:
        lens = tuple(max(1, len(tok(t)["input_ids"])) for t in texts if t is not None)
        return Lengths(train=lens, source=f"{path} (tokenized with the local {tokenizer_name} tokenizer)")
    lens = tuple(max(1, math.ceil(len(t) / CHARS_PER_TOKEN)) for t in texts if t is not None)
    return Lengths(
        train=lens,
        source=f"{path} (no local tokenizer: {CHARS_PER_TOKEN:g} characters per token)",
        warnings=(
            f"--lengths: no tokenizer of {tokenizer_name or 'the model'} in the local cache; "
            f"lengths estimated at {CHARS_PER_TOKEN:g} characters per token",
        ),
    )
