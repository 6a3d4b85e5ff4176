"""Malformed configs get one clear VramledgerError line; random mappings never raise anything else."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramledger.adapters import load_config
from vramledger.cli import main
from vramledger.errors import VramledgerError

F = Path(__file__).parent / "fixtures"


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("model_name_or_path: [unclosed\n", r"not valid YAML \(line \d\)"),
        ("- a\n- b\n", "must hold a mapping"),
        ("", "is empty"),
        (
            "model_name_or_path: gpt2\nstage: sft\nper_device_train_batch_size: eight\n",
            "per_device_train_batch_size must be an integer",
        ),
        ("model_name_or_path: gpt2\nstage: sft\nbf16: maybe\n", "bf16 must be true or false"),
        (
            "model_name_or_path: gpt2\nstage: sft\noptim: adamw_magic\n",
            r"optimizer 'adamw_magic' is not modelled; use "
            r"one of .*adamw_torch",
        ),
        ("stage: sft\nfinetuning_type: lora\n", r"names no model \(model_name_or_path\)"),
        ("model_name_or_path: someone/not-downloaded-7b\nstage: sft\n", "download its config.json and pass its path"),
        ("model_name_or_path: gpt2\nstage: sft\nquantization_bit: 3\n", "quantization_bit must be 4 or 8"),
        ("model_name_or_path: gpt2\nstage: sft\nfinetuning_type: oft\n", "finetuning_type 'oft' is not modelled"),
        ("model_name_or_path: gpt2\nstage: sft\nbf16: true\nfp16: true\n", "bf16 and fp16 are both true"),
        ("model_name_or_path: gpt2\nstage: sft\nlora_rank: 0\n", "lora rank must be a positive integer"),
        ("model_name_or_path: gpt2\nstage: sft\ndeepspeed: missing_ds.json\n", "pass the file with --deepspeed"),
        ("hello: world\n", "cannot tell which framework"),
        ("base_model: gpt2\nadapter: qlora\nlora_r: 8\nlora_target_linear: true\n", "qlora needs load_in_4bit"),
        (
            "model:\n  _component_: torchtune.models.llama3.lora_llama3_8b\n  lora_attn_modules: [q_proj]\n"
            "optimizer:\n  _component_: "
            "torch.optim.Muon\n",
            "optimizer torch.optim.Muon is not modelled",
        ),
    ],
    ids=lambda x: x[:30] if isinstance(x, str) else str(x),
)
def test_malformed(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(VramledgerError, match=match) as exc:
        load_config(_write(tmp_path, text))
    assert "\n" not in str(exc.value)


def test_missing_file_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(VramledgerError, match="no file at"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(VramledgerError, match=r"not valid JSON \(line 1"):
        load_config(_write(tmp_path, "{bad json", "c.json"))
    with pytest.raises(VramledgerError, match="unknown format 'foo'"):
        load_config(F / "lf_llama3_lora_sft.yaml", fmt="foo")
    with pytest.raises(VramledgerError, match="expected KEY=VALUE"):
        load_config(F / "lf_llama3_lora_sft.yaml", overrides=["cutoff_len"])


def test_deepspeed_mismatch(tmp_path: Path) -> None:
    # transformers' HfTrainerDeepSpeedConfig.fill_match refuses explicit values that disagree with the trainer's
    ds = _write(tmp_path, '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}', "ds.json")
    with pytest.raises(VramledgerError, match="train_micro_batch_size_per_gpu=4 but the training config has"):
        load_config(F / "lf_llama3_lora_sft.yaml", deepspeed=ds)
    ds = _write(tmp_path, '{"zero_optimization": {"stage": 5}}', "ds.json")
    with pytest.raises(VramledgerError, match="stage must be 0, 1, 2 or 3"):
        load_config(F / "lf_llama3_lora_sft.yaml", deepspeed=ds)


def test_cli_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path, "model_name_or_path: gpt2\nstage: sft\noptim: nadam_x\n")
    assert main(["convert", "--config", str(bad), "--to", "trl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


# -- fuzz: random YAML mappings over the keys the adapters read -------------------------------------------------

_KEYS = [
    "model_name_or_path",
    "stage",
    "finetuning_type",
    "lora_rank",
    "lora_alpha",
    "lora_target",
    "lora_dropout",
    "quantization_bit",
    "quantization_type",
    "pure_bf16",
    "bf16",
    "fp16",
    "optim",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "cutoff_len",
    "packing",
    "flash_attn",
    "enable_liger_kernel",
    "disable_gradient_checkpointing",
    "do_eval",
    "eval_strategy",
    "eval_accumulation_steps",
    "predict_with_generate",
    "max_new_tokens",
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "use_peft",
    "lora_r",
    "load_in_4bit",
    "load_in_8bit",
    "max_length",
    "loss_type",
    "use_liger_kernel",
    "dtype",
    "base_model",
    "adapter",
    "micro_batch_size",
    "sequence_len",
    "sample_packing",
    "optimizer",
    "gradient_checkpointing",
    "val_set_size",
    "lora_target_linear",
    "attn_implementation",
    "model",
    "tokenizer",
    "batch_size",
    "zero_optimization",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "distributed_type",
    "num_processes",
    "world_size",
    "freeze_trainable_layers",
    "use_dora",
    "dataset",
    "checkpointer",
    "loss",
    "activation_checkpointing",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "gpt2",
            "llama-3-8b",
            "auto",
            "lora",
            "qlora",
            "full",
            "pt",
            "sft",
            "steps",
            "no",
            "bf16",
            "adamw_torch",
            "fa2",
            "FULL_SHARD",
            "cpu",
            "true",
            "nf4",
            "all",
            "torch.optim.AdamW",
        ]
    ),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "_component_",
                    "stage",
                    "device",
                    "enabled",
                    "offload_optimizer",
                    "max_seq_len",
                    "lora_attn_modules",
                    "fsdp_sharding_strategy",
                    "x",
                ]
            ),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=6,
)
_mappings = st.dictionaries(st.sampled_from(_KEYS), _values, min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=_mappings, fmt=st.sampled_from([None, "llamafactory", "hf", "trl", "axolotl", "torchtune", "deepspeed", "fsdp"])
)
def test_fuzz_only_vramledger_errors(tmp_path: Path, raw: dict, fmt: str | None) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(raw))
    try:
        rc = load_config(path, fmt=fmt)
    except VramledgerError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert rc.train.micro_batch >= 1
