"""Shared machinery for the config adapters: reading files safely, typed access to keys, provenance and warnings.

Every adapter reads a plain mapping (``yaml.safe_load`` / ``json.loads``; nothing is ever executed), asks a
``Reader`` for typed values, and records on it the TrainSpec fields it sets with where each came from. Keys the
adapter never asked for are reported as warnings unless they are known to leave memory unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.specs import Attention, Optimizer

# -- reading files ----------------------------------------------------------------------------------------------


def read_mapping(path: Path, what: str = "config") -> dict[str, Any]:
    """A YAML or JSON file as a dict (YAML through ``yaml.SafeLoader`` only; JSON is a subset of YAML), read
    with ``vramledger.userfiles``' bounds: a regular file, a size limit, aliases and nesting bounded."""
    from vramledger.userfiles import load_file

    data = load_file(path, what)
    if data is None:
        raise VramledgerError(f"{what}: {path} is empty; pass a training config")
    if not isinstance(data, dict):
        raise VramledgerError(
            f"{what}: {path} must hold a mapping of keys to values (got a {type(data).__name__}); pass a training "
            "config"
        )
    return {str(k): v for k, v in data.items()}


_KEY_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")
_MAX_OVERRIDE = 4096


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], set[str]]:
    """LLaMA-Factory / OmegaConf style ``key=value`` overrides; dotted keys reach into nested mappings.

    Values are parsed as YAML scalars (``true`` → bool, ``8`` → int), as ``OmegaConf.from_cli`` does
    (LLaMA-Factory ``hparams/parser.py`` ``read_args``). Returns the new mapping and the top-level keys touched.
    """
    import yaml

    out = dict(raw)
    touched: set[str] = set()
    for item in overrides:
        if "=" not in item:
            raise VramledgerError(f"override {item!r}: expected KEY=VALUE (e.g. per_device_train_batch_size=2)")
        key, _, text = item.partition("=")
        key = key.strip().lstrip("-")
        parts = key.split(".")
        if not key or not all(_KEY_PART.fullmatch(p) for p in parts):
            raise VramledgerError(
                f"override {_short(item)!r}: {'the key is empty' if not key else 'not a config key'}; expected "
                "KEY=VALUE with KEY a name or dotted names (e.g. lora_rank=8, model.lora_rank=8)"
            )
        if len(text) > _MAX_OVERRIDE:
            raise VramledgerError(f"override {key}: the value is longer than {_MAX_OVERRIDE} characters")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
        touched.add(parts[0])
    return out, touched


# -- optimizers -------------------------------------------------------------------------------------------------

# HF ``TrainingArguments.optim`` names (transformers 5.23 ``training_args.py`` ``OptimizerNames``) that we model,
# and the spellings axolotl/LLaMA-Factory pass through to it.
OPTIMIZER_NAMES: dict[str, Optimizer] = {o.value: o for o in Optimizer} | {
    "adamw": Optimizer.ADAMW,
    "adamw_torch_foreach": Optimizer.ADAMW,
    "adamw_bnb_8bit": Optimizer.ADAMW_8BIT,  # OptimizerNames.ADAMW_8BIT is "just an alias for adamw_bnb_8bit"
    "paged_adamw": Optimizer.PAGED_ADAMW_32BIT,
    # torchao AdamW8bit (trainer_optimizer.py: adamw_torch_8bit → torchao.optim.AdamW8bit): int8 states with one
    # fp32 scale per 256 values (torchao optim/README.md), the layout analytic/optimizer.py models for 8-bit AdamW
    "adamw_torch_8bit": Optimizer.ADAMW_8BIT,
}


# torchao's low-bit AdamW, which transformers builds for ``adamw_torch_4bit`` (trainer_optimizer.py →
# ``torchao.optim.AdamW4bit``): 4-bit states with one fp32 scale per 128 values (torchao optim/README.md).
# Estimated as the 8-bit AdamW, with what that changes said in a warning.
APPROXIMATED_OPTIMIZERS: dict[str, tuple[Optimizer, str]] = {
    "adamw_torch_4bit": (
        Optimizer.ADAMW_8BIT,
        "torchao AdamW4bit (two 4-bit states, one fp32 scale per 128 values: about 1.06 bytes per trainable "
        "parameter) is estimated as the 8-bit AdamW (about 2.03 bytes): the optimizer state shown is an upper bound",
    ),
}


def set_optimizer(r: Reader, key: str, name: Any, provenance: str) -> None:
    """``optimizer`` from an HF ``optim`` name, with a warning where the optimizer is approximated."""
    approx = APPROXIMATED_OPTIMIZERS.get(name.strip().lower()) if isinstance(name, str) else None
    if approx is None:
        r.set("optimizer", optimizer_from_name(name, key, r.source), provenance)
        return
    r.set("optimizer", approx[0], provenance + f" (approximated as {approx[0].value})")
    r.warn(f"{key}: {name}: {approx[1]}")


def optimizer_from_name(name: Any, key: str, source: str) -> Optimizer:
    if not isinstance(name, str):
        raise VramledgerError(f"{source}: {key} must be an optimizer name (got {name!r})")
    opt = OPTIMIZER_NAMES.get(name.strip().lower())
    if opt is None:
        raise VramledgerError(
            f"{source}: {key}: optimizer {name!r} is not modelled; use one of {', '.join(sorted(OPTIMIZER_NAMES))}"
        )
    return opt


# transformers' ``attn_implementation`` names (``modeling_utils.py`` ``_check_and_adjust_attn_implementation``).
ATTN_NAMES: dict[str, Attention] = {
    "eager": Attention.EAGER,
    "sdpa": Attention.SDPA,
    "flash_attention_2": Attention.FLASH2,
    "flash_attention_3": Attention.FLASH2,
    "kernels-community/flash-attn": Attention.FLASH2,
    "kernels-community/flash-attn2": Attention.FLASH2,
    "kernels-community/vllm-flash-attn3": Attention.FLASH2,
    # torch/nn/attention/flex_attention.py: one fused kernel (forward and backward) over score blocks, with the
    # logsumexp saved, as FlashAttention does; the block mask is O(L²/128²)
    "flex_attention": Attention.FLASH2,
}
"""FlashAttention 3, FlexAttention and hub kernels keep no attention matrix either: modelled as
``flash_attention_2``."""


def attn_from_name(name: Any, key: str, source: str) -> Attention:
    if not isinstance(name, str) or name.strip().lower() not in ATTN_NAMES:
        raise VramledgerError(
            f"{source}: {key}: attention {name!r} is not modelled; use one of eager, sdpa, flash_attention_2"
        )
    return ATTN_NAMES[name.strip().lower()]


# -- typed access with provenance ---------------------------------------------------------------------------------

_MISSING = object()
_MAX_UNKNOWN_WARNINGS = 20
"""Unknown keys named one by one; the rest are counted in one line."""


class Reader:
    """Typed access to one config mapping, recording what was used, what was set and why."""

    def __init__(self, raw: Mapping[str, Any], *, framework: str, source: str, overridden: Iterable[str] = ()) -> None:
        self.raw = raw
        self.overridden = set(overridden)
        """Top-level keys given as ``key=value`` overrides (their provenance says ``override``)."""
        self.framework = framework
        self.source = source
        self.used: set[str] = set()
        self.fields: dict[str, Any] = {}
        self.provenance: dict[str, str] = {}
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self.extras: dict[str, Any] = {}
        """Adapter-specific results that are not TrainSpec fields (trainer flags, DeepSpeed source, …)."""

    # value access ------------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """Present with a value (YAML ``key:`` with nothing after it means unset, as in axolotl's examples)."""
        return self.raw.get(key) is not None

    def value(self, key: str) -> Any:
        self.used.add(key)
        return self.raw.get(key)

    def _bad(self, key: str, want: str, got: Any) -> VramledgerError:
        return VramledgerError(f"{self.source}: {key} must be {want} (got {got!r}); fix the value in the file")

    def flag(self, key: str, default: Any = _MISSING) -> Any:
        v = self.value(key)
        if v is None:
            return None if default is _MISSING else default
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"):
            return v.strip().lower() in ("true", "yes")
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise self._bad(key, "true or false", v)

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int | None = None) -> Any:
        v = self.value(key)
        if v is None:
            return None if default is _MISSING else default
        out = as_int(v)
        if out is None:
            raise self._bad(key, "an integer", v)
        if minimum is not None and out < minimum:
            raise self._bad(key, f"an integer ≥ {minimum}", v)
        return out

    def number(self, key: str, default: Any = _MISSING) -> Any:
        v = self.value(key)
        if v is None:
            return None if default is _MISSING else default
        if isinstance(v, bool):
            raise self._bad(key, "a number", v)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
        raise self._bad(key, "a number", v)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        v = self.value(key)
        if v is None:
            return None if default is _MISSING else default
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise self._bad(key, "a string", v)
        return str(v)

    def names(self, key: str) -> tuple[str, ...] | None:
        """A comma-separated string or a list of strings."""
        v = self.value(key)
        if v is None:
            return None
        if isinstance(v, str):
            items = [s.strip() for s in v.split(",")]
        elif isinstance(v, list) and all(isinstance(s, str) for s in v):
            items = [s.strip() for s in v]
        else:
            raise self._bad(key, "a module name or a list of them", v)
        items = [s for s in items if s]
        if not items:
            raise self._bad(key, "a non-empty list of module names", v)
        return tuple(items)

    def mapping(self, key: str) -> dict[str, Any] | None:
        v = self.value(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._bad(key, "a mapping", v)
        return {str(k): x for k, x in v.items()}

    # recording ---------------------------------------------------------------------------------------------
    def set(self, field: str, value: Any, provenance: str) -> None:
        self.fields[field] = value
        self.provenance[field] = provenance

    def file(self, *keys: str) -> str:
        given = [k for k in keys if k.split(".")[0].split("=")[0] in self.overridden]
        if given and len(given) == len(keys):
            return "override: " + " + ".join(keys)
        return "file: " + " + ".join(keys)

    def default(self, cite: str) -> str:
        return f"default: {self.framework} ({cite})"

    def origin(self, key: str, cite: str) -> str:
        """Where a setting read from ``key`` came from: the file (or an override) when the key is set there, else
        the framework's default, ``cite`` naming the upstream file that sets it."""
        return self.file(key) if self.has(key) else self.default(cite)

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.warnings.append(message)

    def ignore(self, key: str, reason: str, *, when: Any = True) -> None:
        """Warn about a memory-relevant key we do not model, if it is present (and ``when`` holds)."""
        self.used.add(key)
        if self.has(key) and when and self.raw.get(key) is not False:
            self.warn(f"ignored: {key}={_short(self.raw[key])} ({reason})")

    def finish(self, harmless: Iterable[str]) -> None:
        """Warn about every key neither used nor known to leave memory unchanged."""
        skip = set(harmless)
        unknown = [
            key
            for key in self.raw
            if key not in self.used and key not in skip and self.raw[key] is not None and not key.startswith("_")
        ]
        for key in unknown[:_MAX_UNKNOWN_WARNINGS]:
            self.warn(
                f"ignored: {_short(key)} (not a {self.framework} setting vramledger knows; if it changes memory, "
                "the estimate leaves it out)"
            )
        if len(unknown) > _MAX_UNKNOWN_WARNINGS:
            self.warn(f"ignored: {len(unknown) - _MAX_UNKNOWN_WARNINGS} more keys vramledger does not know")


def as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**62:
        return int(v)
    if isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
        if f.is_integer() and abs(f) < 2**62:
            return int(f)
    return None


def _short(v: Any) -> str:
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


def resolve_relative(name: str, config_path: Path | None) -> Path:
    """A path named inside a config: as given (relative to the working directory, as the frameworks open it),
    else relative to the config file's folder."""
    from vramledger.userfiles import path_exists, user_path

    path = user_path(name)
    if path.is_absolute() or path_exists(str(path)) or config_path is None:
        return path
    beside = config_path.parent / path
    return beside if path_exists(str(beside)) else path
