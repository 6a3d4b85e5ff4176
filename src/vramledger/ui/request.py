"""A JSON request body → the specs, through the CLI's own parser and ``resolve_inputs``.

The body names the setup with the CLI's flag names (``{"model": "llama-3.1-8b", "batch": 2, "seq": 2048}``;
``lora_rank`` and ``lora-rank`` both name ``--lora-rank``). Each key becomes the flag it names and the whole list
goes through ``argparse`` for the command, so a value is checked, and a bad one reported, exactly as on the command
line, and a flag added to the CLI later (``--world-size``) works here unchanged.

What a request may not do: name a path. Flags typed ``Path`` (``--config``, ``--html``, ``--deepspeed`` …) and
slow or printing switches are refused; a model that looks like a path is refused; a dropped file arrives as
content (``config_text``, ``model_config``) and every string inside a dropped config that names a file is
refused, because the adapters would open it. The one file the server reads is the ``--config`` its own command
line named (``startup_config: true``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from vramledger.cli.common import Inputs
from vramledger.errors import VramledgerError

COMMANDS = ("estimate", "fit", "plan")

REFUSED = frozenset(
    {
        "help",
        "version",
        "json",
        "bars",
        "sources",
        "exact",
        "mode",
        "prompt",
        "new_tokens",
        "static_cache",
        "max_concurrency",
        "write_format",
        "top",
    }
)
"""Flags a request may not give (besides every flag typed ``Path``): output switches, the slow tracer
(``--exact``), and inference mode, whose JSON is another shape."""

PAGE_KEYS = frozenset(
    {
        "model",
        "overrides",
        "model_config",
        "model_config_name",
        "config_text",
        "config_name",
        "deepspeed_text",
        "startup_config",
    }
)
"""Body keys that are not flags: the positional arguments and the dropped files."""

_PATHLIKE = re.compile(r"^(/|~|\.\.?/|[A-Za-z]:\\)|\\|\.(json|ya?ml|toml)$", re.I)


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """A request resolved: the specs as the CLI would build them, and the parsed flags."""

    inputs: Inputs
    args: argparse.Namespace
    config_format: str = ""
    """The dropped or startup config's format ("" without one): the format an export writes back."""
    model_named: str = ""
    """The model as the user named it (catalog name, the config's model, or the dropped config.json's name)."""


@cache
def cli_parser() -> argparse.ArgumentParser:
    """The CLI's own parser (built once): a request is parsed as ``vramledger COMMAND FLAGS…`` is."""
    from vramledger.cli import build_parser

    return build_parser()


def command_parser(command: str) -> argparse.ArgumentParser:
    """The CLI's subparser for ``command`` (to look its flags up)."""
    for action in cli_parser()._subparsers._group_actions:  # type: ignore[union-attr]
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("vramledger's parser has no subcommands")


def _refused(action: argparse.Action) -> bool:
    from vramledger.cli.args import PATH_TYPES

    return action.dest in REFUSED or action.type in PATH_TYPES


def to_argv(command: str, body: Mapping[str, Any]) -> list[str]:
    """The command line that ``body`` names (without the command), flags in the body's order.

    >>> to_argv("estimate", {"model": "gpt2", "batch": 2, "grad_ckpt": True, "packing": False})
    ['gpt2', '--batch=2', '--grad-ckpt']
    """
    parser = command_parser(command)
    argv: list[str] = []
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or model.startswith("-"):
            raise VramledgerError(f"model: expected a name like llama-3.1-8b (got {model!r})")
        argv.append(model)
    for key, value in body.items():
        if key in PAGE_KEYS or value is None:
            continue
        flag = "--" + key.lstrip("-").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is not None and _refused(action):
            raise VramledgerError(
                f"{flag}: not accepted over HTTP (the page never reads or writes paths and "
                "does not trace); drop it from the request"
            )
        if action is not None and action.nargs == 0:  # a switch: true gives it; false gives --no-X or nothing
            if not isinstance(value, bool):
                raise VramledgerError(f"{flag}: a switch; send true or false (got {value!r})")
            negation = parser._option_string_actions.get("--no-" + flag[2:])
            if value:
                argv.append(flag)
            elif negation is not None and negation.dest == action.dest:
                argv.append(negation.option_strings[0])
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise VramledgerError(f"{flag}: expected a number or a string (got {value!r})")
        if action is None and not str(value).startswith("-"):
            argv += [flag, str(value)]  # unknown: argparse names it as the CLI does ("unrecognized arguments")
        else:
            argv.append(f"{flag}={value}")  # one token: a value can never pass for a flag
    overrides = body.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and not o.startswith("-") for o in overrides):
        raise VramledgerError('overrides: expected a list of KEY=VALUE strings (e.g. ["cutoff_len=4096"])')
    return argv + list(overrides)


def _check_model_name(name: str) -> None:
    if _PATHLIKE.search(name) or Path(name).expanduser().exists():
        raise VramledgerError(
            f"model: {name!r} looks like a path, and the page reads no paths; give a catalog "
            "name or hub id, or drop the config.json on the page (sent as model_config)"
        )


_OPENED = frozenset(
    {"deepspeed", "deepspeed_config_file", "fsdp_config", "model_name_or_path", "base_model", "_component_"}
)
"""Keys whose value the adapters may open as a file (a DeepSpeed or FSDP config, a local model folder)."""


def _check_dropped(node: Any, where: str = "") -> None:
    """Refuse a dropped config that names a file the adapters would open (a DeepSpeed JSON, a model folder)."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            _check_dropped(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_dropped(v, f"{where}[{i}]")
    elif isinstance(node, str) and node.strip():
        key = re.split(r"[.\[]", where)[-1]
        opened = key in _OPENED and (_PATHLIKE.search(node) or Path(node).expanduser().exists())
        if opened or re.search(r"\.(json|ya?ml)$", node, re.I):
            raise VramledgerError(
                f"config: {where} names a file ({node}), which the page cannot read; drop "
                "that file too (a DeepSpeed JSON as deepspeed_text), or start "
                "`vramledger ui --config FILE`"
            )


@contextlib.contextmanager
def _dropped_files(body: Mapping[str, Any]) -> Iterator[tuple[Path | None, Path | None, str]]:
    """The dropped config (and DeepSpeed JSON) as files the adapters can open: a private temporary folder,
    removed on exit. Yields (config path, deepspeed path, the folder's prefix to strip from messages)."""
    text, ds_text = body.get("config_text"), body.get("deepspeed_text")
    if text is None and ds_text is None:
        yield None, None, ""
        return
    for key, value in (("config_text", text), ("deepspeed_text", ds_text)):
        if value is not None and not isinstance(value, str):
            raise VramledgerError(f"{key}: expected the file's text")
    import yaml

    from vramledger.adapters._base import read_mapping

    name = Path(str(body.get("config_name") or "config.yaml")).name
    if not re.fullmatch(r"[\w.\- ]{1,100}", name):
        name = "config.yaml"
    with tempfile.TemporaryDirectory(prefix="vramledger-ui-") as tmp:
        folder = Path(tmp)
        config = folder / name if text is not None else None
        deepspeed = folder / "deepspeed.json" if ds_text is not None else None
        for path, content in ((config, text), (deepspeed, ds_text)):
            if path is not None:
                path.write_text(content or "", encoding="utf-8")
        mapping: dict[str, Any] = {}
        if config is not None:
            with contextlib.suppress(VramledgerError, yaml.YAMLError):
                mapping = read_mapping(config)  # a file that does not parse: the adapters report it, with its line
        if deepspeed is not None:
            mapping.pop("deepspeed", None)  # the dropped DeepSpeed JSON replaces the file the config names
        _check_dropped(mapping)
        yield config, deepspeed, f"{folder}/"


def resolve(command: str, body: Mapping[str, Any], *, startup_config: Path | None = None) -> Setup:
    """Parse ``body`` as ``vramledger COMMAND`` would parse its flags, and resolve the specs."""
    from vramledger.cli import parse
    from vramledger.cli.common import resolve_inputs

    if command not in COMMANDS:
        raise VramledgerError(f"command: {command!r} is not one of {', '.join(COMMANDS)}")
    if not isinstance(body, Mapping):
        raise VramledgerError('request: expected a JSON object naming the setup, e.g. {"model": "llama-3.1-8b"}')
    model = body.get("model")
    if isinstance(model, str):
        _check_model_name(model)
    dropped_model = _dropped_model(body)
    argv = to_argv(command, body)
    if dropped_model is not None and model is None:
        argv.insert(0, "gpt2")  # stands in for the dropped config.json while the flags resolve
    with _dropped_files(body) as (config, deepspeed, prefix):
        if body.get("startup_config"):
            if startup_config is None:
                raise VramledgerError("startup_config: the server was started without --config FILE")
            config = startup_config
        try:
            try:
                args = parse(cli_parser(), [command, *argv])
            except SystemExit:  # argparse's --help/--version; refused above, so this is a safety net
                raise VramledgerError("request: asked argparse to exit; send flags with values only") from None
            args.config, args.deepspeed = config, deepspeed
            inputs = resolve_inputs(args)
            fmt, named_in_file = _format_and_model(args) if args.config is not None else ("", "")
        except VramledgerError as exc:
            if prefix:
                exc.message = exc.message.replace(prefix, "")
            raise
    provenance = {k: v.replace(prefix, "") if prefix else v for k, v in inputs.provenance.items()}
    warnings = tuple(w.replace(prefix, "") if prefix else w for w in inputs.warnings)
    named = inputs.model.name
    if dropped_model is not None:
        inputs = dataclasses.replace(inputs, model=dropped_model)
        named = dropped_model.name
    elif isinstance(model, str):
        named = model
    elif named_in_file:
        named = named_in_file
    inputs = dataclasses.replace(inputs, provenance=provenance, warnings=warnings)
    return Setup(inputs=inputs, args=args, config_format=fmt, model_named=named)


def _dropped_model(body: Mapping[str, Any]) -> Any:
    raw = body.get("model_config")
    if raw is None:
        return None
    from vramledger.catalog.hfconfig import model_spec_from_config

    if not isinstance(raw, Mapping):
        raise VramledgerError("model_config: expected the config.json's JSON object")
    name = raw.get("_name_or_path") or body.get("model_config_name") or "config.json"
    return model_spec_from_config(raw, name=str(name), source="dropped config.json")


def _format_and_model(args: argparse.Namespace) -> tuple[str, str]:
    """The config's format (to write the setup back in it) and the model exactly as the file names it (an export
    keeps that name, not the catalog's)."""
    from vramledger.adapters import load_config

    overrides = list(args.overrides or [])
    if args.model and "=" in args.model:  # no model given: argparse took the first override for it
        overrides.insert(0, args.model)
    rc = load_config(args.config, fmt=args.format, overrides=overrides, deepspeed=args.deepspeed, require_model=False)
    return rc.format, rc.model


def flags_of(inputs: Inputs) -> dict[str, Any]:
    """The resolved setup as the page's controls hold it, keyed by flag name (to set the sliders from a file)."""
    t = inputs.train
    return {
        "method": t.method.value,
        "batch": t.micro_batch,
        "seq": t.seq_len,
        "accum": t.grad_accum,
        "lora_rank": t.lora.rank if t.lora is not None else None,
        "eval_batch": t.eval_batch,
        "grad_ckpt": t.grad_ckpt,
        "precision": t.precision.value,
        "optimizer": t.optimizer.value,
        "attn": t.attn.value,
        "loss": t.loss.value,
        "packing": t.packing,
        "gpu": inputs.gpu.name if inputs.gpu is not None else None,
        "headroom": inputs.headroom,
    }
