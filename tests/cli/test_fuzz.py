"""A fuzz harness over the command line and config files, in process through ``vramledger.cli.main``.

Whatever the arguments and whatever the file, the contract holds (docs/cli.md): the exit code is 0 (yes), 3 (no) or
2 (bad input, one ``error:`` line naming what to fix), never 1 (a bug) and never a traceback; and the user's input
file is never modified. Bounded examples, derandomised (the same cases on every run), well under 30 s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramledger.cli import main

SCALE = int(os.environ.get("VRAMLEDGER_FUZZ_SCALE", "1"))
"""Run longer by hand: ``VRAMLEDGER_FUZZ_SCALE=50`` (and random, not derandomised, cases)."""
FUZZ = settings(max_examples=60 * SCALE, deadline=None, derandomize=SCALE == 1, suppress_health_check=list(HealthCheck))

MODELS = ["llama-3.2-1b", "qwen2.5-0.5b", "gpt2", "Qwen/Qwen2.5-7B-Instruct", "gemma-3-4b", "mixtral-8x7b"]


def check(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert code in (0, 2, 3), (argv, code, text)
    if code == 2:
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and text.endswith("\n") and text.splitlines()[-1] == errors[0], (argv, text)
    return code, out.getvalue(), text


# -- arguments -------------------------------------------------------------------------------------------------------
numbers = st.one_of(
    st.integers(-3, 70_000),
    st.sampled_from(["0", "-1", "1e9", "10**9", "1180591620717411303424", "2048", "1_000", " 7 "]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
words = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "lora",
            "qlora",
            "full",
            "freeze",
            "bf16",
            "fp16-true",
            "fp32",
            "sdpa",
            "eager",
            "flash_attention_2",
            "fused",
            "chunked",
            "nf4",
            "int8",
            "fp4",
            "adafactor",
            "sgd",
            "paged_adamw_8bit",
            "h100-sxm",
            "rtx-4090",
            "24GiB",
            "0GB",
            "1e3GiB",
            "full",
            "argmax",
        ]
    ),
    st.text(max_size=12),
)
FLAGS = {
    "--method": words,
    "--precision": words,
    "--optimizer": words,
    "--attn": words,
    "--loss": words,
    "--quant": words,
    "--gpu": words,
    "--eval-logits": words,
    "--lora-targets": words,
    "--batch": numbers,
    "--seq": numbers,
    "--accum": numbers,
    "--lora-rank": numbers,
    "--lora-alpha": numbers,
    "--lora-dropout": numbers,
    "--freeze-layers": numbers,
    "--sgd-momentum": numbers,
    "--eval-batch": numbers,
    "--eval-seq": numbers,
    "--eval-accum": numbers,
    "--eval-steps": numbers,
    "--max-new-tokens": numbers,
    "--headroom": numbers,
}
SWITCHES = [
    "--grad-ckpt",
    "--no-grad-ckpt",
    "--packing",
    "--dora",
    "--no-double-quant",
    "--predict-with-generate",
    "--json",
]
flag_args = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(sorted(FLAGS)), st.none()).flatmap(
            lambda kv: FLAGS[kv[0]].map(lambda v, k=kv[0]: [k, str(v)])
        ),
        st.sampled_from(SWITCHES).map(lambda s: [s]),
    ),
    max_size=6,
).map(lambda groups: [a for g in groups for a in g])


@FUZZ
@given(model=st.one_of(st.sampled_from(MODELS), st.text(max_size=300)), flags=flag_args)
def test_estimate_arguments(model: str, flags: list[str]) -> None:
    check(["estimate", model, *flags])


COMMAND_FLAGS = {
    "fit": {"--granularity": numbers, "--max-batch": numbers, "--max-len": numbers},
    "plan": {"--granularity": numbers, "--top": numbers, "--global-batch": numbers},
    "accum": {
        "--global-batch": numbers,
        "--dataset-size": numbers,
        "--epochs": numbers,
        "--warmup-ratio": numbers,
        "--lr-scheduler": words,
    },
}


@settings(FUZZ, max_examples=15 * SCALE)
@given(
    command=st.sampled_from(sorted(COMMAND_FLAGS)),
    data=st.data(),
    flags=flag_args,
)
def test_search_commands_arguments(command: str, data: st.DataObject, flags: list[str]) -> None:
    own = COMMAND_FLAGS[command]
    picked = data.draw(st.lists(st.sampled_from(sorted(own)), max_size=2, unique=True))
    extra = [x for k in picked for x in (k, str(data.draw(own[k])))]
    gpu = [] if "--gpu" in flags else ["--gpu", data.draw(st.sampled_from(["24GiB", "h100-sxm", "1GiB"]))]
    check([command, data.draw(st.sampled_from(MODELS[:3])), *gpu, *flags, *extra])


# -- config files ----------------------------------------------------------------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "all", "true", "nf4", "bf16", "adamw_torch", "sdpa", "lora"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
KEYS = {
    "llamafactory": [
        "stage",
        "finetuning_type",
        "cutoff_len",
        "per_device_train_batch_size",
        "lora_rank",
        "lora_target",
        "quantization_bit",
        "pure_bf16",
        "bf16",
        "fp16",
        "flash_attn",
        "optim",
        "disable_gradient_checkpointing",
        "packing",
        "per_device_eval_batch_size",
        "val_size",
        "freeze_trainable_layers",
        "enable_liger_kernel",
        "deepspeed",
        "gradient_accumulation_steps",
    ],
    "axolotl": [
        "adapter",
        "micro_batch_size",
        "sequence_len",
        "lora_r",
        "lora_target_linear",
        "load_in_4bit",
        "load_in_8bit",
        "sample_packing",
        "gradient_checkpointing",
        "optimizer",
        "bf16",
        "val_set_size",
        "lora_modules_to_save",
        "flash_attention",
    ],
    "trl": [
        "use_peft",
        "lora_r",
        "max_length",
        "packing",
        "load_in_4bit",
        "gradient_checkpointing",
        "optim",
        "per_device_train_batch_size",
        "attn_implementation",
        "loss_type",
        "dtype",
    ],
}
MODEL_KEY = {"llamafactory": "model_name_or_path", "axolotl": "base_model", "trl": "model_name_or_path"}


@settings(FUZZ, max_examples=60 * SCALE)
@given(fmt=st.sampled_from(sorted(KEYS)), data=st.data())
def test_config_files(fmt: str, data: st.DataObject) -> None:
    keys = data.draw(st.lists(st.sampled_from(KEYS[fmt]), max_size=6, unique=True))
    raw: dict[str, object] = {k: data.draw(values) for k in keys}
    raw[MODEL_KEY[fmt]] = data.draw(st.sampled_from(MODELS))
    overrides = data.draw(
        st.lists(
            st.sampled_from(KEYS[fmt]).flatmap(
                lambda k: st.one_of(
                    st.integers(-2, 9999).map(str), st.sampled_from(["", "nan", "[1,", "x y", "true"])
                ).map(lambda v, k=k: f"{k}={v}")
            ),
            max_size=2,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / ("c.json" if data.draw(st.booleans()) else "c.yaml")
        text = yaml.safe_dump(raw) if cfg.suffix == ".yaml" else json.dumps(raw, default=str)
        cfg.write_text(text)
        out = Path(tmp) / "out.yaml"
        command = data.draw(st.sampled_from(["estimate", "convert"]))
        argv = [command, "--config", str(cfg), *overrides]
        if command == "convert":
            target = data.draw(st.sampled_from([cfg, out]))
            argv += ["--to", data.draw(st.sampled_from(["llamafactory", "trl", "axolotl"])), "--out", str(target)]
            argv += ["--force"] if data.draw(st.booleans()) else []
        check(argv)
        assert cfg.read_text() == text  # the input is never modified


@settings(FUZZ, max_examples=30 * SCALE)
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
        st.sampled_from(
            [
                "a: &a [1]\nb: [*a, *a]\n",
                "[[[[[[",
                "{}",
                "- 1\n- 2\n",
                "!!python/object:os.system {}",
                "model_name_or_path: gpt2\nstage: sft\n<<: {x: 1}\n",
            ]
        ),
    )
)
def test_arbitrary_text_as_a_config(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.yaml"
        cfg.write_bytes(text.encode("utf-8", errors="replace"))
        before = cfg.read_bytes()
        check(["estimate", "--config", str(cfg)])
        assert cfg.read_bytes() == before
