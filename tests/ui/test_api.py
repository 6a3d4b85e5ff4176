"""The JSON API against the CLI: for the same setup, `POST /api/<command>` answers exactly the bytes that
`vramledger <command> … --json` prints (the CLI run in-process, its argv written out by hand here), and bad input
answers 400 with the line the CLI prints on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ui.conftest import EXAMPLE, run_cli

# (request body, the same setup as a command line, written by hand)
SETUPS = [
    pytest.param(
        {"model": "llama-3.1-8b", "method": "lora", "batch": 2, "seq": 2048, "gpu": "rtx-4090", "grad_ckpt": True},
        ["llama-3.1-8b", "--method", "lora", "--batch", "2", "--seq", "2048", "--gpu", "rtx-4090", "--grad-ckpt"],
        id="issue-example-lora",
    ),
    pytest.param(
        {"model": "qwen2.5-7b", "method": "qlora", "batch": 2, "seq": 4096, "grad_ckpt": True, "gpu": "24GiB"},
        ["qwen2.5-7b", "--method", "qlora", "--batch", "2", "--seq", "4096", "--grad-ckpt", "--gpu", "24GiB"],
        id="readme-qlora-custom-gpu",
    ),
    pytest.param(
        {
            "model": "llama-3.2-1b",
            "--method": "full",
            "lora-rank": None,
            "precision": "bf16-true",
            "optimizer": "adamw_8bit",
            "attn": "eager",
            "loss": "chunked",
            "packing": True,
            "eval_batch": 4,
            "eval_logits": "argmax",
            "headroom": 0.1,
            "gpu": "a100-80gb",
            "grad_ckpt": False,
        },
        [
            "llama-3.2-1b",
            "--method",
            "full",
            "--precision",
            "bf16-true",
            "--optimizer",
            "adamw_8bit",
            "--attn",
            "eager",
            "--loss",
            "chunked",
            "--packing",
            "--eval-batch",
            "4",
            "--eval-logits",
            "argmax",
            "--headroom",
            "0.1",
            "--gpu",
            "a100-80gb",
            "--no-grad-ckpt",
        ],
        id="every-control-and-a-flag-the-page-lacks",
    ),
    pytest.param({"model": "gpt2", "batch": 8, "seq": 1024}, ["gpt2", "--batch", "8", "--seq", "1024"], id="no-gpu"),
]


@pytest.mark.parametrize(("body", "argv"), SETUPS)
def test_estimate_is_byte_identical_to_the_cli(client, capsys, body, argv):
    code, out, _ = run_cli(capsys, ["estimate", *argv, "--json"])
    assert code in (0, 3)
    status, raw = client.post("estimate", body)
    print("cli", len(out), "api", len(raw), "equal", raw.decode() == out)
    assert status == 200
    assert raw.decode() == out


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_fit_and_plan_are_byte_identical_to_the_cli(client, capsys, command):
    body, argv = SETUPS[0].values
    code, out, _ = run_cli(capsys, [command, *argv, "--json"])
    assert code in (0, 3)
    status, raw = client.post(command, body)
    assert status == 200
    assert raw.decode() == out


def test_the_servers_config_gives_the_cli_answer_for_that_config(client, capsys):
    """`vramledger ui --config FILE`: the page's setup is the file's, overrides and flags on top, as on the CLI."""
    _, out, _ = run_cli(
        capsys, ["estimate", "--config", str(EXAMPLE), "cutoff_len=4096", "--gpu", "rtx-4090", "--batch", "2", "--json"]
    )
    status, raw = client.post(
        "estimate", {"startup_config": True, "overrides": ["cutoff_len=4096"], "gpu": "rtx-4090", "batch": 2}
    )
    assert status == 200
    assert raw.decode() == out


def test_a_dropped_config_gives_the_cli_answer_for_that_file(client, capsys, tmp_path):
    """The same file sent as content (as the page sends a dropped file) resolves to the same ledger."""
    _, out, _ = run_cli(capsys, ["estimate", "--config", str(EXAMPLE), "--gpu", "rtx-4090", "--json"])
    body = {"config_text": EXAMPLE.read_text(), "config_name": EXAMPLE.name, "gpu": "rtx-4090"}
    status, raw = client.post("estimate", body)
    assert status == 200
    assert json.loads(raw) == json.loads(out)
    status, raw = client.post("setup", body)
    setup = json.loads(raw)
    # the provenance the CLI prints under "settings:", and the model as the file names it
    assert setup["provenance"]["micro_batch"] == "file: per_device_train_batch_size"
    assert setup["provenance"]["seq_len"] == "file: cutoff_len"
    assert setup["model_named"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert setup["flags"]["accum"] == 8 and setup["flags"]["lora_rank"] == 8
    assert "vramledger-ui-" not in raw.decode()  # the private temporary folder never shows


def test_a_dropped_model_config_json(client, capsys, tmp_path):
    """A config.json sent as content is the model; the CLI reads the same file from disk."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "_name_or_path": "tiny-llama",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    _, out, _ = run_cli(capsys, ["estimate", str(path), "--batch", "4", "--gpu", "rtx-4090", "--json"])
    status, raw = client.post("estimate", {"model_config": cfg, "batch": 4, "gpu": "rtx-4090"})
    assert status == 200
    api, cli = json.loads(raw), json.loads(out)
    # the one difference: where the model came from (a path on disk, or content the page sent)
    assert (api["settings"].pop("model_source"), cli["settings"].pop("model_source")) == (
        "dropped config.json",
        str(path),
    )
    assert api == cli


@pytest.mark.parametrize(
    ("body", "argv", "field"),
    [
        pytest.param({"model": "gpt2", "batch": "two"}, ["gpt2", "--batch", "two"], "--batch", id="not-an-int"),
        pytest.param(
            {"model": "gpt2", "precision": "fp8"}, ["gpt2", "--precision", "fp8"], "--precision", id="unknown-choice"
        ),
        pytest.param({"model": "gpt2", "gpu": "rtx-9999"}, ["gpt2", "--gpu", "rtx-9999"], "gpu", id="unknown-gpu"),
        pytest.param({"model": "lama-3.1-8b"}, ["lama-3.1-8b"], "model", id="unknown-model"),
        pytest.param(
            {"model": "gpt2", "warp_drive": 3}, ["gpt2", "--warp-drive", "3"], "--warp-drive", id="unknown-flag"
        ),
        pytest.param(
            {"model": "gpt2", "headroom": 1.5}, ["gpt2", "--headroom", "1.5"], "--headroom", id="bad-headroom"
        ),
    ],
)
def test_bad_input_is_400_with_the_clis_line(client, capsys, body, argv, field):
    code, _, err = run_cli(capsys, ["estimate", *argv, "--json"])
    assert code == 2
    status, raw = client.post("estimate", body)
    answer = json.loads(raw)
    print(answer)
    assert status == 400
    assert answer["error"] == err.strip()
    assert field in answer["error"]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"model": "gpt2", "batch": True}, "--batch"),
        ({"model": "gpt2", "grad_ckpt": "yes"}, "--grad-ckpt"),
        ({"model": 7}, "model"),
        ({"model": "gpt2", "overrides": "cutoff_len=1"}, "overrides"),
    ],
)
def test_wrongly_typed_values_name_the_field(client, body, names):
    status, raw = client.post("estimate", body)
    assert status == 400
    assert names in json.loads(raw)["error"]


def test_fit_without_a_gpu_says_so_as_the_cli_does(client, capsys):
    _, _, err = run_cli(capsys, ["fit", "gpt2"])
    status, raw = client.post("fit", {"model": "gpt2"})
    assert status == 400 and json.loads(raw)["error"] == err.strip()


def test_grid_cells_are_the_estimates_of_those_cells(client, capsys):
    """Two heatmap cells checked against the CLI's estimate for that batch and length."""
    status, raw = client.post("grid", {"model": "llama-3.2-1b", "batch": 3, "seq": 1000, "gpu": "rtx-4090"})
    grid = json.loads(raw)
    assert status == 200
    for b, L in ((1, 256), (8, 4096)):
        _, out, _ = run_cli(
            capsys, ["estimate", "llama-3.2-1b", "--batch", str(b), "--seq", str(L), "--gpu", "rtx-4090", "--json"]
        )
        cell = grid["device_bytes"][grid["lengths"].index(L)][grid["batches"].index(b)]
        assert cell == json.loads(out)["device_total_bytes"]
    assert grid["usable_bytes"] == json.loads(out)["verdict"]["usable_bytes"]


def test_meta_lists_the_catalogs(client, capsys):
    status, _, raw = client.get("/api/meta")
    meta = json.loads(raw)
    _, out, _ = run_cli(capsys, ["gpus"])
    assert status == 200
    assert len(meta["models"]) == 45  # the README: "the bundled catalogs (45 models, 26 GPUs)"
    assert len(meta["gpus"]) == 26  # 25 until a100-40gb-pcie became a card of its own (docs/catalog.md)
    assert meta["startup_config"] == {"name": EXAMPLE.name}
    assert {c["value"] for c in meta["categories"]} >= {"weights", "logits_loss", "cuda_context"}


def test_a_dropped_config_with_its_deepspeed_json(client, capsys):
    """LLaMA-Factory's full-SFT ZeRO-3 example names its DeepSpeed JSON; the page sends both files as content."""
    fixtures = Path(__file__).resolve().parents[1] / "adapters" / "fixtures"
    config, ds = fixtures / "lf_llama3_full_sft_ds3.yaml", fixtures / "lf_ds_z3_config.json"
    # the CLI follows the file's `deepspeed: lf_ds_z3_config.json` to the JSON beside it
    _, out, _ = run_cli(capsys, ["estimate", "--config", str(config), "world_size=8", "--gpu", "a100-80gb", "--json"])
    body = {
        "config_text": config.read_text(),
        "config_name": config.name,
        "deepspeed_text": ds.read_text(),
        "overrides": ["world_size=8"],
        "gpu": "a100-80gb",
    }
    status, raw = client.post("estimate", body)
    assert status == 200, raw
    assert json.loads(raw) == json.loads(out)
    setup = json.loads(client.post("setup", body)[1])
    assert any("zero" in k for k in setup["provenance"]), setup["provenance"]


def test_a_flag_the_cli_gains_reaches_the_parser_and_the_page(monkeypatch):
    """When the CLI gains a flag (here `--world-size`, as the distributed work adds it), a request passes it to the
    same parser, and the page is told to show it; nothing in ui/ names it but the list of fields to show."""
    from vramledger.cli import build_parser
    from vramledger.ui import api, request

    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if hasattr(a, "choices")).choices["estimate"]
    if "--world-size" not in sub._option_string_actions:
        sub.add_argument("--world-size", type=int, help="GPUs in the data-parallel group")
    monkeypatch.setattr(request, "cli_parser", lambda: parser)
    assert request.to_argv("estimate", {"model": "gpt2", "world_size": 8}) == ["gpt2", "--world-size=8"]
    assert request.cli_parser().parse_args(["estimate", "gpt2", "--world-size=8"]).world_size == 8
    shown = {f["flag"]: f for f in api.extra_flags()}
    assert shown["--world-size"]["integer"] is True and shown["--world-size"]["switch"] is False
