"""The JSON API behind the page: each endpoint resolves a request as the CLI would and answers with the CLI's JSON.

``POST /api/estimate``, ``/api/fit`` and ``/api/plan`` answer exactly what ``vramledger estimate|fit|plan --json``
prints for the same flags (the same functions build the result: ``cli.estimate.train_ledger``,
``cli.fit.fit_report``, ``cli.plan.plan_result``; the same renderers print it: ``report.json_out``,
``report.plan_view.to_json``). The page's own endpoints add what the CLI shows as text: ``/api/setup`` (the
resolved settings and where each came from), ``/api/grid`` (device totals over a batch × length grid, from
``report.figures.cliff_figure``), ``/api/export`` (the setup as a config, JSON or the HTML report, as text for
the browser to save: the server writes nothing) and ``GET /api/meta`` (catalogs and colours).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramledger.errors import VramledgerError
from vramledger.ui.request import Setup, flags_of, resolve, to_argv

GRID_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
GRID_LENGTHS = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
"""The heatmap's cells: about √2 apart on both axes, so the cliff's bend shows on a grid of 156 estimates."""


EXTRA_FLAGS = ("world_size", "zero", "zero_stage", "fsdp")
"""Flags of the CLI the page shows as plain fields when the CLI has them (the distributed setup)."""


def extra_flags() -> list[dict[str, Any]]:
    """The CLI's flags named in ``EXTRA_FLAGS``, as the page draws them (a switch, a number, a choice)."""
    from vramledger.ui.request import command_parser

    out = []
    for action in command_parser("estimate")._actions:
        if action.dest in EXTRA_FLAGS and action.option_strings:
            out.append(
                {
                    "flag": action.option_strings[0],
                    "dest": action.dest,
                    "help": action.help or "",
                    "switch": action.nargs == 0,
                    "integer": action.type is int,
                    "choices": list(action.choices) if action.choices else None,
                }
            )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """One response: a status, a media type and the body's bytes."""

    status: int
    body: bytes
    media_type: str = "application/json; charset=utf-8"


def _json(data: Any, status: int = 200) -> Answer:
    return Answer(status=status, body=(json.dumps(data, indent=2, default=str) + "\n").encode())


def _text(text: str) -> Answer:
    """What the CLI prints: ``print(text)`` adds the newline."""
    return Answer(status=200, body=(text + "\n").encode())


def error_answer(exc: VramledgerError) -> Answer:
    """Bad input: 400 with the line the CLI prints on stderr."""
    return _json({"error": f"error: {exc}", "exit_code": exc.exit_code}, status=400)


class Api:
    """The endpoints, bound to the server's one trusted input: the ``--config`` its command line named."""

    def __init__(self, startup_config: Path | None = None) -> None:
        self.startup_config = startup_config
        self.routes: dict[str, Callable[[Mapping[str, Any]], Answer]] = {
            "estimate": self.estimate,
            "fit": self.fit,
            "plan": self.plan,
            "setup": self.setup,
            "grid": self.grid,
            "export": self.export,
        }

    def handle(self, name: str, body: Any) -> Answer:
        """Answer ``POST /api/<name>``; bad input answers 400 with the CLI's message."""
        route = self.routes.get(name)
        if route is None:
            return _json({"error": f"error: no endpoint /api/{name}; see docs/ui.md"}, status=404)
        try:
            if not isinstance(body, Mapping):
                raise VramledgerError('request: expected a JSON object naming the setup, e.g. {"model": "gpt2"}')
            return route(body)
        except VramledgerError as exc:
            return error_answer(exc)

    def _resolve(self, command: str, body: Mapping[str, Any]) -> Setup:
        return resolve(command, body, startup_config=self.startup_config)

    # -- the CLI's three answers ------------------------------------------------------------------------------
    def estimate(self, body: Mapping[str, Any]) -> Answer:
        from vramledger.cli.estimate import train_ledger
        from vramledger.report.json_out import dumps

        return _text(dumps(train_ledger(self._resolve("estimate", body).inputs)))

    def fit(self, body: Mapping[str, Any]) -> Answer:
        from vramledger.cli.fit import fit_report
        from vramledger.report.plan_view import to_json

        s = self._resolve("fit", body)
        return _text(to_json(fit_report(s.args, s.inputs)))

    def plan(self, body: Mapping[str, Any]) -> Answer:
        from vramledger.cli.plan import plan_result
        from vramledger.report.plan_view import to_json

        s = self._resolve("plan", body)
        return _text(to_json(plan_result(s.args, s.inputs)))

    # -- what the page needs besides ---------------------------------------------------------------------------
    def setup(self, body: Mapping[str, Any]) -> Answer:
        """The resolved setup: the controls' values, each setting's source (as the CLI lists it), the warnings,
        and the equivalent command line."""
        from vramledger.report.terminal import render_provenance

        s = self._resolve("estimate", body)
        i = s.inputs
        # shown as a person types it: "--batch 2", not the "--batch=2" token the parser is given
        shown = [part for a in to_argv("estimate", body) for part in (a.split("=", 1) if a.startswith("--") else [a])]
        argv = ["vramledger", "estimate", *shown]
        if body.get("startup_config") and self.startup_config is not None:
            argv += ["--config", str(self.startup_config)]
        return _json(
            {
                "model": i.model.name,
                "model_named": s.model_named,
                "flags": flags_of(i),
                "provenance": i.provenance,
                "provenance_text": render_provenance(i.provenance),
                "warnings": list(i.warnings),
                "config_format": s.config_format,
                "command": argv,
            }
        )

    def grid(self, body: Mapping[str, Any]) -> Answer:
        """Device totals over the heatmap's batch × length grid: the estimate of each cell, through the planner's
        cache (``plan.memo``), so that moving the batch or length slider, which changes no cell, costs nothing."""
        import dataclasses

        from vramledger.plan import memo

        s = self._resolve("fit", body)
        i = s.inputs
        if i.gpu is None:
            raise VramledgerError("the heatmap needs a GPU: pass --gpu NAME or a size like --gpu 24GiB")
        top = max(i.model.max_position_embeddings or GRID_LENGTHS[-1], GRID_LENGTHS[0])
        lengths = [n for n in GRID_LENGTHS if n <= top]
        device = [
            [
                memo.device_total(i.model, dataclasses.replace(i.train, micro_batch=b, seq_len=L), i.gpu, i.headroom)
                for b in GRID_BATCHES
            ]
            for L in lengths
        ]
        return _json(
            {
                "batches": GRID_BATCHES,
                "lengths": lengths,
                "device_bytes": device,
                "usable_bytes": memo.usable_bytes(i.gpu, i.headroom),
                "capacity_bytes": i.gpu.memory_bytes,
            }
        )

    def export(self, body: Mapping[str, Any]) -> Answer:
        """``{"as": "config" | "llamafactory" | "trl" | "axolotl" | "json" | "html", …setup}`` → the file's text
        and a name to save it under (the browser saves it; the server writes nothing)."""
        kind = body.get("as", "config")
        setup_body = {k: v for k, v in body.items() if k != "as"}
        s = self._resolve("estimate", setup_body)
        stem = "vramledger-" + "".join(ch if ch.isalnum() or ch in "-." else "-" for ch in s.model_named)[-60:]
        if kind == "json":
            from vramledger.cli.estimate import train_ledger
            from vramledger.report.json_out import dumps

            text, name, media = dumps(train_ledger(s.inputs)) + "\n", f"{stem}.json", "application/json"
        elif kind == "html":
            text, name, media = self._html(s), f"{stem}.html", "text/html"
        else:
            text, fmt = self._config(s, str(kind))
            name, media = f"{stem}-{fmt}.yaml", "application/yaml"
        return _json({"filename": name, "media_type": media, "content": text})

    @staticmethod
    def _config(s: Setup, kind: str) -> tuple[str, str]:
        from vramledger.adapters import writers

        fmt = s.config_format if kind == "config" else kind
        if fmt not in writers.TARGETS:
            if kind != "config":
                raise VramledgerError(
                    f"as: unknown export {kind!r}; choose config, json, html or one of {', '.join(writers.TARGETS)}"
                )
            fmt = "llamafactory"
        header = [
            f"written by `vramledger ui`: the setup on the page, keys that decide memory only ({fmt});",
            "add your dataset, template, learning rate and output_dir.",
        ]
        mapping, notes = writers.write_config(s.model_named, s.inputs.train, fmt)
        return writers.dump(mapping, header + [f"note: {n}" for n in notes]), fmt

    @staticmethod
    def _html(s: Setup) -> str:
        from vramledger.cli.estimate import train_ledger
        from vramledger.report.figures import all_figures
        from vramledger.report.html import render_html

        i = s.inputs
        ledger = train_ledger(i)
        figs = all_figures(ledger, model=i.model, train=i.train, gpu=i.gpu, headroom=i.headroom)
        return render_html(ledger, figs)

    def meta(self) -> Answer:
        """The catalogs, the choices each control offers, the colours of the categories, the startup config."""
        from vramledger.catalog import gpu_entries, model_entries
        from vramledger.cli.common import DEFAULT_HEADROOM, OPTIMIZER_ALIASES, PRECISION_ALIASES
        from vramledger.ledger import Category
        from vramledger.report.plots import COLORS
        from vramledger.specs import Attention, Loss, Method

        startup = None
        if self.startup_config is not None:
            startup = {"name": self.startup_config.name}
        return _json(
            {
                "models": [
                    {"key": k, "hub_id": e.hub_id, "params": e.published_params} for k, e in model_entries().items()
                ],
                "gpus": [{"key": k, "name": g.name, "memory_bytes": g.memory_bytes} for k, g in gpu_entries().items()],
                "categories": [
                    {"value": c.value, "display": c.display, "color": COLORS[c], "allocated": c.allocated}
                    for c in Category
                ],
                "choices": {
                    "method": [m.value for m in Method],
                    "precision": sorted({p.value for p in PRECISION_ALIASES.values()}),
                    "optimizer": sorted({o.value for o in OPTIMIZER_ALIASES.values()}),
                    "attn": [a.value for a in Attention],
                    "loss": [x.value for x in Loss],
                },
                "default_headroom": DEFAULT_HEADROOM,
                "extra_flags": extra_flags(),
                "startup_config": startup,
            }
        )
