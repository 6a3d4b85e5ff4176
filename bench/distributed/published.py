"""The multi-GPU rows of the published measurements (../shared/data/published_memory.csv) against the estimate.

Only the rows with several GPUs (LitGPT's FSDP tables, PEFT's FSDP and DeepSpeed docs); the general benchmark of
every published row is elsewhere. Each row is restated here as specs, with the settings its source names; rows
whose architecture has no bundled config (Phi-1.5, StableLM-Alpha, Gemma 1, Phi-2, GPT-NeoX) are listed as skipped.

Run:  python bench/distributed/published.py            # the markdown table of docs/distributed.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from vramledger.analytic import estimate  # noqa: E402
from vramledger.catalog import resolve_gpu, resolve_model  # noqa: E402
from vramledger.catalog.hfconfig import model_spec_from_config  # noqa: E402
from vramledger.specs import (  # noqa: E402
    Attention,
    LoraSpec,
    Loss,
    Method,
    ModelSpec,
    Optimizer,
    Precision,
    Sharding,
    TrainSpec,
)

# TinyLlama-1.1B's published architecture (LitGPT config tiny-llama-1.1b; Llama class).
TINYLLAMA = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 22,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}

# LitGPT finetune/lora.py (lit-gpt 8641822): LoRA on query and value, r=8, bf16-true, FSDP with activation
# checkpointing per Block, AdamW; the loss is chunked_cross_entropy over the lm_head output chunks.
LITGPT_LORA = {
    "method": Method.LORA,
    "precision": Precision.BF16,
    "optimizer": Optimizer.ADAMW,
    "lora": LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), adapter_fp32=False),
    "grad_ckpt": True,
    "fsdp": Sharding.FULL_SHARD,
    "fsdp_version": 1,
    "loss": Loss.CHUNKED,
    "loss_chunk_tokens": 128,
}
# PEFT examples/sft (TRL SFTTrainer): LoRA r=8 all-linear, dropout 0.1, bf16 mixed, checkpointing, flash-attn 2,
# packing to 2048.
PEFT_SFT = {
    "lora": LoraSpec(rank=8, alpha=16, targets=("all",), dropout=0.1),
    "precision": Precision.BF16_MIXED,
    "grad_ckpt": True,
    "attn": Attention.FLASH2,
    "packing": True,
    "seq_len": 2048,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    source: str
    model: str
    setup: str
    gpus: int
    metric: str
    """``allocated`` (torch.cuda.max_memory_allocated) or ``device`` (a monitor's per-GPU figure)."""
    published_gb: float | None
    """None: the source reports OOM."""
    gpu: str
    train: dict[str, Any]
    note: str = ""


LITGPT = "LitGPT resource-tables.md (FSDP, 2023-10)"
HUB = "LitGPT config_hub/finetune README (FSDP)"
PEFT_FSDP = "PEFT docs accelerate/fsdp.md"
PEFT_DS = "PEFT docs accelerate/deepspeed.md"

ROWS = [
    Row(
        source=LITGPT,
        model="llama-2-7b",
        setup="LoRA q,v r8, bf16-true, b1 L1304",
        gpus=2,
        metric="allocated",
        published_gb=22.18,
        gpu="a100-40gb",
        train={**LITGPT_LORA, "micro_batch": 1, "seq_len": 1304},
    ),
    Row(
        source=LITGPT,
        model="llama-2-7b",
        setup="same, b2",
        gpus=2,
        metric="allocated",
        published_gb=22.47,
        gpu="a100-40gb",
        train={**LITGPT_LORA, "micro_batch": 2, "seq_len": 1304},
    ),
    Row(
        source=LITGPT,
        model="llama-2-7b",
        setup="same, b4",
        gpus=2,
        metric="allocated",
        published_gb=23.39,
        gpu="a100-40gb",
        train={**LITGPT_LORA, "micro_batch": 4, "seq_len": 1304},
    ),
    Row(
        source=LITGPT,
        model="llama-2-13b",
        setup="LoRA q,v r8, bf16-true, b1 L1304",
        gpus=2,
        metric="allocated",
        published_gb=None,
        gpu="a100-40gb",
        train={**LITGPT_LORA, "micro_batch": 1, "seq_len": 1304},
    ),
    Row(
        source=LITGPT,
        model="llama-2-13b",
        setup="same, 4 GPUs",
        gpus=4,
        metric="allocated",
        published_gb=35.57,
        gpu="a100-40gb",
        train={**LITGPT_LORA, "micro_batch": 1, "seq_len": 1304},
    ),
    Row(
        source=HUB,
        model="llama-2-7b",
        setup="full, bf16-true, b4 L512, ckpt",
        gpus=4,
        metric="allocated",
        published_gb=None,
        gpu="a10g",
        train={
            "method": Method.FULL,
            "precision": Precision.BF16,
            "micro_batch": 4,
            "seq_len": 512,
            "grad_ckpt": True,
            "fsdp": Sharding.FULL_SHARD,
            "fsdp_version": 1,
        },
    ),
    Row(
        source=HUB,
        model="llama-3-8b",
        setup="full, bf16-true, b4 L512, ckpt",
        gpus=4,
        metric="allocated",
        published_gb=None,
        gpu="a10g",
        train={
            "method": Method.FULL,
            "precision": Precision.BF16,
            "micro_batch": 4,
            "seq_len": 512,
            "grad_ckpt": True,
            "fsdp": Sharding.FULL_SHARD,
            "fsdp_version": 1,
        },
    ),
    Row(
        source="LitGPT thunder README (pretraining, FSDP)",
        model="tinyllama",
        setup="full, bf16-true, b4 L2048",
        gpus=8,
        metric="allocated",
        published_gb=22.13,
        gpu="a100-40gb",
        train={
            "method": Method.FULL,
            "precision": Precision.BF16,
            "micro_batch": 4,
            "seq_len": 2048,
            "packing": True,
            "fsdp": Sharding.FULL_SHARD,
            "fsdp_version": 1,
        },
        note="pretraining: every sequence full length",
    ),
    Row(
        source=PEFT_FSDP,
        model="llama-2-70b",
        setup="LoRA all-linear r8, b8 L2048 packed",
        gpus=8,
        metric="device",
        published_gb=80.0,
        gpu="h100-sxm",
        train={**PEFT_SFT, "method": Method.LORA, "micro_batch": 8, "fsdp": Sharding.FULL_SHARD, "fsdp_version": 1},
        note="72-80 GB read off a monitor; the top includes the FULL_STATE_DICT save spike",
    ),
    Row(
        source=PEFT_FSDP,
        model="llama-2-70b",
        setup="QLoRA nf4 r8, b2 L2048, no offload",
        gpus=2,
        metric="device",
        published_gb=35.6,
        gpu="a100-40gb",
        train={**PEFT_SFT, "method": Method.QLORA, "micro_batch": 2, "fsdp": Sharding.FULL_SHARD, "fsdp_version": 1},
    ),
    Row(
        source=PEFT_FSDP,
        model="llama-2-70b",
        setup="QLoRA nf4 r8, b2 L2048, CPU offload",
        gpus=2,
        metric="device",
        published_gb=19.6,
        gpu="rtx-4090",
        train={
            **PEFT_SFT,
            "method": Method.QLORA,
            "micro_batch": 2,
            "fsdp": Sharding.FULL_SHARD,
            "fsdp_version": 1,
            "offload_params": True,
            "offload_optimizer": True,
        },
    ),
    Row(
        source=PEFT_DS,
        model="llama-2-70b",
        setup="LoRA all-linear r8, b8 L2048, ZeRO-3",
        gpus=8,
        metric="device",
        published_gb=64.0,
        gpu="h100-sxm",
        train={**PEFT_SFT, "method": Method.LORA, "micro_batch": 8, "zero_stage": 3},
        note="read off a monitor ('64 GB (80%)')",
    ),
    Row(
        source=PEFT_DS,
        model="llama-2-70b",
        setup="QLoRA nf4 r8, b2 L2048, ZeRO-3",
        gpus=2,
        metric="device",
        published_gb=36.6,
        gpu="a100-40gb",
        train={**PEFT_SFT, "method": Method.QLORA, "micro_batch": 2, "zero_stage": 3},
    ),
]
SKIPPED = (
    "LitGPT phi-1.5 and StableLM-Alpha-3B FSDP LoRA rows (6), config_hub gemma-2b, phi-2 and "
    "StableLM-3B full rows (3): no bundled config for those architectures"
)


def _model(name: str) -> ModelSpec:
    if name == "tinyllama":
        return model_spec_from_config(TINYLLAMA, name="TinyLlama-1.1B", source="bench/distributed/published.py")
    return resolve_model(name)


def evaluate(row: Row) -> tuple[float, str]:
    """(our figure in GB, the verdict or the error)."""
    m = _model(row.model)
    train = TrainSpec(world_size=row.gpus, **row.train)
    gpu = resolve_gpu(row.gpu)
    ledger = estimate(m, train, gpu=gpu)
    ours = (ledger.peak_allocated if row.metric == "allocated" else ledger.device_total) / 1e9
    if row.published_gb is None:
        fits = ledger.verdict is not None and ledger.verdict.fits
        return ours, "OOM predicted" if not fits else f"predicted to fit ({ledger.verdict.usable_bytes / 1e9:.1f} GB)"  # type: ignore[union-attr]
    return ours, f"{100 * (ours - row.published_gb) / row.published_gb:+.0f}%"


def table() -> str:
    lines = [
        "| source | model | setup | GPUs | metric | published | ours | error |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for row in ROWS:
        ours, err = evaluate(row)
        pub = "OOM" if row.published_gb is None else f"{row.published_gb:.2f} GB"
        lines.append(
            f"| {row.source} | {row.model} | {row.setup} | {row.gpus} | {row.metric} | {pub} | {ours:.2f} GB | {err} |"
        )
    return "\n".join(lines) + f"\n\nSkipped: {SKIPPED}."


if __name__ == "__main__":
    print(table())
