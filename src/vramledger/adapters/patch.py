"""A plan as a patch of the user's own config: their keys, comments and dataset settings kept, only the keys the
plan changes changed, each listed.

The keys to change are those whose value the config writer (``adapters.writers``) writes differently for the
user's setup and for the plan's, plus the keys given as ``key=value`` overrides on the command line. A YAML file
is patched line by line at the top level (a key's line and its indented block are replaced by one line; a key
the plan drops is commented out; a new key is appended); a JSON file is re-written with the keys updated. The
result is read back through the adapter, and it is only used when it resolves to exactly the plan's setup.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Patch:
    text: str
    """The user's file with the changes applied."""
    changes: tuple[str, ...]
    """One line per key: ``key: old -> new``, ``key: added``, ``key: removed``."""


def _scalar(value: Any) -> str:
    """One YAML line's value (flow style for mappings and lists)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].rstrip() if text.endswith("\n...") or text.endswith(" ...") else text


def _patch_yaml(text: str, sets: dict[str, Any], drops: set[str], tag: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    done: set[str] = set()
    key_re = re.compile(r"^([A-Za-z0-9_.\-]+)\s*:(.*)$")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = key_re.match(line)
        key = m.group(1) if m else None
        if key is not None and (key in sets or key in drops) and key not in done:
            # the key's block: following lines that are indented, blank or comments
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t", "-")) or not lines[j].strip()):
                if not lines[j].strip() and j + 1 < len(lines) and not lines[j + 1].startswith((" ", "\t", "-")):
                    break
                j += 1
            if key in sets:
                out.append(f"{key}: {_scalar(sets[key])}  # {tag}")
            else:
                out += [f"# {x}" if x.strip() else x for x in lines[i:j]]
                out[-(j - i)] += f"  # {tag}: removed"
            done.add(key)
            i = j
            continue
        out.append(line)
        i += 1
    added = [k for k in sets if k not in done]
    if added:
        out.append(f"# {tag}:")
        out += [f"{k}: {_scalar(sets[k])}" for k in added]
    return "\n".join(out) + "\n"


def changed_keys(
    fmt: str, model: str, before: TrainSpec, after: TrainSpec, *, after_model: str | None = None
) -> tuple[str, ...]:
    """The ``key: value`` lines (``fmt``'s own keys) that take a ``before`` config to ``after``; a key set to
    ``null`` is one to remove."""
    from vramledger.adapters.writers import write_config

    old, _ = write_config(model, before, fmt)
    new, _ = write_config(after_model or model, after, fmt)
    lines = [f"{k}: {_scalar(v)}" for k, v in new.items() if old.get(k) != v]
    lines += [f"{k}: null (remove)" for k in old if k not in new]
    return tuple(lines)


def patch_config(
    path: Path,
    raw: dict[str, Any],
    *,
    fmt: str,
    model: str,
    before: TrainSpec,
    after: TrainSpec,
    after_model: str | None = None,
    overridden: dict[str, Any] | None = None,
    tag: str = "vramledger plan",
) -> Patch:
    """The user's ``path`` (whose content is ``raw``, in ``fmt``) changed from ``before`` to ``after``.

    ``overridden``: top-level keys the user gave as ``key=value`` (with their values), which the file must
    carry too. Raises VramledgerError when the patched file does not read back as ``after``.
    """
    from vramledger.adapters.writers import write_config
    from vramledger.userfiles import read_text

    old, _ = write_config(model, before, fmt)
    new, _ = write_config(after_model or model, after, fmt)
    overridden = overridden or {}
    keys = [k for k in new if old.get(k) != new[k] or k in overridden]
    sets = {k: new[k] for k in keys}
    for k, v in overridden.items():
        sets.setdefault(k, v)
    drops = {k for k in old if k not in new and k in raw}
    changes = []
    for k, v in sets.items():
        changes.append(f"{k}: {_scalar(raw[k])} -> {_scalar(v)}" if k in raw else f"{k}: {_scalar(v)} (added)")
    changes += [f"{k}: {_scalar(raw[k])} (removed)" for k in sorted(drops)]
    text = read_text(path)
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        for k in drops:
            data.pop(k, None)
        data.update(sets)
        patched = json.dumps(data, indent=2) + "\n"
    else:
        patched = _patch_yaml(text, sets, drops, tag)
    _check_round_trip(patched, path, fmt, after)
    return Patch(text=patched, changes=tuple(changes))


def _check_round_trip(text: str, path: Path, fmt: str, want: TrainSpec) -> None:
    """Read the patched text back (from a private temporary folder) and require exactly ``want``."""
    import tempfile

    from vramledger.adapters import load_config

    with tempfile.TemporaryDirectory(prefix="vramledger-") as tmp:
        probe = Path(tmp) / path.name
        probe.write_text(text, encoding="utf-8")
        try:
            got = load_config(probe, fmt=fmt, require_model=False).train
        except VramledgerError as exc:
            raise VramledgerError(f"the patched config does not read back ({exc})") from None
    if got != want:
        raise VramledgerError("the patched config reads back as another setup than the plan")
