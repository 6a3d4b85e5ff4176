"""Tell a config's kind from its keys (``--format`` wins)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramledger.errors import VramledgerError

FORMATS = ("llamafactory", "hf", "trl", "axolotl", "torchtune", "deepspeed", "fsdp")
ALIASES = {
    "llamafactory": "llamafactory",
    "llama-factory": "llamafactory",
    "llama_factory": "llamafactory",
    "lf": "llamafactory",
    "hf": "hf",
    "transformers": "hf",
    "training_args": "hf",
    "trainingarguments": "hf",
    "trl": "trl",
    "sft": "trl",
    "sftconfig": "trl",
    "axolotl": "axolotl",
    "torchtune": "torchtune",
    "tune": "torchtune",
    "deepspeed": "deepspeed",
    "ds": "deepspeed",
    "fsdp": "fsdp",
    "accelerate": "fsdp",
}

# Keys only one framework uses (its argument classes / schema); the first framework with a hit wins.
_SIGNATURES: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "deepspeed",
        frozenset(
            {
                "zero_optimization",
                "train_micro_batch_size_per_gpu",
                "zero_allow_untested_optimizer",
                "train_batch_size",
            }
        ),
    ),
    (
        "fsdp",
        frozenset({"distributed_type", "compute_environment", "num_processes", "main_training_function"}),
    ),
    (
        "axolotl",
        frozenset(
            {
                "base_model",
                "micro_batch_size",
                "sequence_len",
                "lora_target_linear",
                "sample_packing",
                "val_set_size",
                "adapter",
                "lora_model_dir",
            }
        ),
    ),
    (
        "llamafactory",
        frozenset(
            {
                "finetuning_type",
                "stage",
                "cutoff_len",
                "template",
                "lora_target",
                "quantization_bit",
                "pure_bf16",
                "disable_gradient_checkpointing",
                "flash_attn",
                "lora_rank",
                "val_size",
            }
        ),
    ),
    # transformers' example scripts (run_clm.py DataTrainingArguments) before TRL, which shares dataset_name
    (
        "hf",
        frozenset(
            {
                "dataset_config_name",
                "block_size",
                "max_train_samples",
                "max_eval_samples",
                "validation_split_percentage",
            }
        ),
    ),
    (
        "trl",
        frozenset(
            {
                "use_peft",
                "lora_r",
                "lora_target_modules",
                "dataset_name",
                "max_length",
                "max_seq_length",
                "packing",
                "completion_only_loss",
                "assistant_only_loss",
                "loss_type",
                "padding_free",
                "dataset_text_field",
                "use_bnb_nested_quant",
            }
        ),
    ),
    (
        "hf",
        frozenset(
            {
                "per_device_train_batch_size",
                "output_dir",
                "gradient_accumulation_steps",
                "optim",
                "learning_rate",
                "num_train_epochs",
                "eval_strategy",
                "gradient_checkpointing",
            }
        ),
    ),
)


def normalise_format(fmt: str, *, option: str = "--format", choices: tuple[str, ...] = FORMATS) -> str:
    key = fmt.strip().lower()
    if key not in ALIASES:
        raise VramledgerError(f"{option}: unknown format {fmt!r}; choose one of {', '.join(choices)}")
    return ALIASES[key]


def detect(raw: Mapping[str, Any], source: str) -> str:
    """The format whose signature keys the mapping holds (torchtune: a ``model`` with a ``_component_``)."""
    model = raw.get("model")
    if isinstance(model, dict) and "_component_" in model:
        return "torchtune"
    for fmt, keys in _SIGNATURES:
        if any(k in raw for k in keys):
            return fmt
    raise VramledgerError(
        f"{source}: cannot tell which framework this config is for; pass --format {'|'.join(FORMATS)}"
    )
