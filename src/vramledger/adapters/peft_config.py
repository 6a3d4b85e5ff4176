"""PEFT ``adapter_config.json`` files: read as JSON (bounded, never executed), checked field by field, and turned
into the TrainSpec fields they set.

The file is what ``PeftConfig.save_pretrained`` writes (PEFT 0.21 ``config.py``): ``peft_type`` names the
method, the other keys are that method's config fields. ``get_peft_config`` (``mapping.py``) rebuilds the config
from it, which is what ``trace`` does; ``estimate`` reads the fields its formulas need.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramledger.errors import VramledgerError
from vramledger.specs import LoraSpec, Method, TrainSpec

if TYPE_CHECKING:
    from vramledger.adapters._base import Reader

PEFT_TYPES = (
    "PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "LORA", "ADALORA", "ADAMSS", "BOFT",
    "ADAPTION_PROMPT", "IA3", "BEFT", "LILY", "LOHA", "LOKR", "OFT", "POLY", "LN_TUNING", "VERA", "FROD", "PVERA",
    "FOURIERFT", "GLORA", "XLORA", "HRA", "VBLORA", "UNILORA", "CPT", "MISS", "RANDLORA", "ROAD",
    "TRAINABLE_TOKENS", "HIRA", "SHIRA", "C3A", "WAVEFT", "OSF", "DELORA", "GRALORA", "CARTRIDGE", "TINYLORA",
    "PSOFT", "PEANUT", "SHADOW", "SUPERTUNING", "DEFT",
)  # fmt: skip
"""PEFT 0.21 ``utils/peft_types.py`` ``PeftType`` values (``trace`` runs any; ``estimate`` models twelve)."""

_INTEGERS = (
    "r",
    "num_virtual_tokens",
    "token_dim",
    "encoder_hidden_size",
    "init_r",
    "target_r",
    "total_step",
    "oft_block_size",
    "boft_block_size",
    "boft_block_num",
    "boft_n_butterfly_factor",
    "decompose_factor",
    "num_layers",
    "num_attention_heads",
)
_NUMBERS = ("lora_alpha", "lora_dropout", "alpha", "module_dropout", "rank_dropout")
_NAME_LISTS = ("target_modules", "feedforward_modules", "modules_to_save", "exclude_modules")
_FLAGS = ("use_dora", "use_rslora", "decompose_both", "block_share", "prefix_projection", "fan_in_fan_out")
_LORA_DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}
"""PEFT 0.21 ``tuners/lora/config.py`` ``LoraConfig`` defaults."""
_LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")
"""PEFT ``utils/constants.py`` ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` for Llama-like models."""


def config_path(path: Path, what: str = "--peft-config") -> Path:
    """The ``adapter_config.json`` a path names: the file itself, or the one inside a folder."""
    if path.is_dir():
        inner = path / "adapter_config.json"
        if not inner.is_file():
            raise VramledgerError(
                f"{what}: {path} is a folder without adapter_config.json; pass the file or its folder"
            )
        return inner
    return path


def read_peft_config(path: Path, what: str = "--peft-config") -> dict[str, Any]:
    """The checked mapping of an ``adapter_config.json`` (or of the folder holding one)."""
    from vramledger.userfiles import load_mapping_text, read_text

    file = config_path(path, what)
    if file.suffix.lower() != ".json":
        raise VramledgerError(f"{what}: {file} is not a .json file; pass PEFT's adapter_config.json")
    return check_peft_config(load_mapping_text(read_text(file, what), what, file), f"{what} {file}")


def _bad(where: str, key: str, want: str, got: Any) -> VramledgerError:
    return VramledgerError(f"{where}: {key} must be {want} (got {got!r}); fix the file")


def check_peft_config(raw: Any, where: str) -> dict[str, Any]:
    """Check the fields the estimate and the trace read; return the mapping (``inference_mode`` off: a saved
    adapter is trained again with ``is_trainable=True``, which PEFT's ``from_pretrained`` turns it off for)."""
    if not isinstance(raw, Mapping):
        raise VramledgerError(f"{where}: expected a JSON object (PEFT's adapter_config.json); fix the file")
    cfg = dict(raw)
    peft_type = cfg.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() not in PEFT_TYPES:
        raise _bad(where, "peft_type", f"a PEFT method ({', '.join(PEFT_TYPES[:6])}, …)", peft_type)
    cfg["peft_type"] = peft_type.upper()
    for key in _INTEGERS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _bad(where, key, "an integer ≥ 0", value)
    for key in _NUMBERS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise _bad(where, key, "a number ≥ 0", value)
    for key in _NAME_LISTS:
        value = cfg.get(key)
        ok = (
            value is None
            or isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        )
        if not ok:
            raise _bad(where, key, "a module name, a list of names or a regular expression", value)
    parameters = cfg.get("target_parameters")
    if parameters is not None and not (isinstance(parameters, list) and all(isinstance(v, str) for v in parameters)):
        # tuners/lora/config.py LoraConfig.__post_init__: "`target_parameters` must be a list of strings or None."
        raise _bad(where, "target_parameters", "a list of parameter names or null", parameters)
    for key in _FLAGS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise _bad(where, key, "true or false", value)
    task = cfg.get("task_type")
    if task is not None and task != "CAUSAL_LM":
        raise _bad(where, "task_type", "CAUSAL_LM or null (vramledger trains causal language models)", task)
    cfg["inference_mode"] = False
    return cfg


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return ("all",) if value.lower() in ("all-linear", "all", "all_linear") else (value,)
    return tuple(value)


def flag_changes(path: Path, base: TrainSpec, changes: Mapping[str, Any]) -> dict[str, Any]:
    """``--peft-config PATH`` on top of the setup (``base``, the file's or the preset's) and the other flags'
    ``changes``: the adapter config replaces the LoRA flags, so giving both is refused."""
    if "lora" in changes:
        raise VramledgerError(
            "--peft-config: the adapter config sets the adapter; drop --lora-rank/--lora-alpha/--lora-targets/"
            "--lora-dropout/--dora/--modules-to-save (or drop --peft-config)"
        )
    method = changes.get("method", base.method)
    if "method" in changes and method not in (Method.LORA, Method.QLORA):
        raise VramledgerError(f"--peft-config trains adapters: use --method lora or qlora (got {method.value})")
    return peft_changes(read_peft_config(path), method, base.lora)


def peft_changes(cfg: Mapping[str, Any], method: Method, lora: LoraSpec | None) -> dict[str, Any]:
    """The TrainSpec fields an adapter config sets: the config itself, adapters as the method (on the quantised
    base when ``method`` is QLoRA), and for LoRA the ``LoraSpec`` its fields give (so that the LoRA formulas and
    every LoRA-aware report apply); ``lora`` is the setup's, whose ``adapter_fp32`` carries over."""
    changes: dict[str, Any] = {"peft_config": json.dumps(dict(cfg), sort_keys=True)}
    changes["method"] = Method.QLORA if method is Method.QLORA else Method.LORA
    if cfg["peft_type"] == "LORA":
        get: dict[str, Any] = {k: (cfg.get(k) if cfg.get(k) is not None else d) for k, d in _LORA_DEFAULTS.items()}
        targets = cfg.get("target_modules")
        parameters = tuple(cfg.get("target_parameters") or ())
        if targets == []:  # PEFT: no modules, only the target parameters
            default: tuple[str, ...] = ()
        else:
            default = _LORA_DEFAULT_TARGETS
        changes["lora"] = dataclasses.replace(
            lora or LoraSpec(),
            rank=int(get["r"]),
            alpha=float(get["lora_alpha"]),
            parameters=parameters,
            targets=_names(targets) if targets else default,
            dropout=float(get["lora_dropout"]),
            dora=bool(cfg.get("use_dora") or False),
            modules_to_save=tuple(cfg.get("modules_to_save") or ()),
        )
    return changes


def resumed_adapter(r: Reader, key: str, path_text: str, method: Method) -> None:
    """A config key naming an adapter that training loads and continues (LLaMA-Factory ``adapter_name_or_path``,
    axolotl ``lora_model_dir``: both ``PeftModel.from_pretrained(..., is_trainable=True)``): when it is a local
    folder, its ``adapter_config.json`` is the method (the LoRA keys of the file do not apply to it); a hub id is
    said and skipped, since nothing is downloaded."""
    from vramledger.userfiles import user_path

    path = user_path(path_text)
    if not config_path(path, key).is_file():
        r.warn(
            f"{key} {path_text!r} is not a local adapter folder (nothing is downloaded): modelled as fresh LoRA "
            "adapters from the file's LoRA keys; pass --peft-config FOLDER to model it"
        )
        return
    changes = peft_changes(read_peft_config(path, key), method, r.fields.get("lora"))
    for field, value in changes.items():
        if field != "method":  # the framework's own keys already say lora or qlora
            r.set(field, value, r.file(key) + " (its adapter_config.json)")
    if "lora" not in changes:  # another method: the LoRA keys do not apply
        r.provenance.pop("lora", None)
