"""The upstream example corpus: every config estimated the way a user would run it, offline.

``tests/upstream/<framework>/`` holds verbatim copies of the example configs of LLaMA-Factory, axolotl, TRL and
torchtune at the upstream paths (SOURCES.md: repository, commit, licence and git blob id of each). Each run below is
``vramledger estimate --config FILE [ARGS]`` from the framework's root folder, as its docs launch it (relative
DeepSpeed/accelerate paths resolve there), in process, with an empty Hugging Face cache: it must estimate without
error, or fail with the one-line error and the reason written in ``FAILS``. For every run the model the estimate
names must be the model the file names. For the files in ``EXPECT`` the estimate must also say what the file says
(method, precision, shapes, optimizer…), values read from the files by hand; for those in ``WARNS`` it must say
aloud what it leaves out. Every file must be byte for byte the upstream one (its git blob id, SOURCES.md).
docs/upstream.md explains the corpus and how to refresh it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.upstream.refresh import UPSTREAMS, blob_id, corpus_files

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Run:
    framework: str
    """The folder under tests/upstream: the upstream repository's root, where the command runs."""
    config: str
    """The config's upstream path (given to --config)."""
    args: tuple[str, ...] = ()
    """Further arguments, as the framework's own launch line gives them (``key=value``, --accelerate-config)."""

    @property
    def id(self) -> str:
        return " ".join((f"{self.framework}/{self.config}", *self.args))


def _runs(framework: str, *configs: str) -> list[Run]:
    return [Run(framework, c) for c in configs]


RUNS: list[Run] = [
    *_runs(
        "llamafactory",
        "examples/train_lora/qwen3_lora_sft.yaml",
        "examples/train_lora/qwen3_lora_sft_ds3.yaml",
        "examples/train_lora/qwen3_lora_dpo.yaml",
        "examples/train_lora/qwen3_lora_kto.yaml",
        "examples/train_lora/qwen3_lora_reward.yaml",
        "examples/train_lora/qwen3_lora_pretrain.yaml",
        "examples/train_lora/qwen3vl_lora_sft.yaml",
        "examples/train_lora/qwen3vl_lora_dpo.yaml",
        "examples/train_full/qwen3_full_sft.yaml",
        "examples/train_full/qwen3vl_full_sft.yaml",
        "examples/train_qlora/qwen3_lora_sft_otfq.yaml",
        "examples/train_qlora/llama3_lora_sft_gptq.yaml",
        "examples/train_qlora/llama3_lora_sft_awq.yaml",
        "examples/extras/fsdp_qlora/llama3_lora_sft.yaml",
        "examples/extras/galore/llama3_full_sft.yaml",
        "examples/extras/apollo/llama3_full_sft.yaml",
        "examples/extras/pissa/llama3_lora_sft.yaml",
        "examples/extras/loraplus/llama3_lora_sft.yaml",
        "examples/extras/oft/qwen2_5vl_oft_sft.yaml",
        "examples/extras/badam/llama3_full_sft.yaml",
        "examples/extras/fp8/llama3_fp8_deepspeed_sft.yaml",
        "examples/extras/adam_mini/qwen2_full_sft.yaml",
        "examples/extras/eaft/qwen25_05b_eaft_full.yaml",
        "examples/ascend/qwen3_full_sft_fsdp2.yaml",
    ),
    # the other DeepSpeed configs the full-SFT example offers ("choices: [ds_z0_config.json, ds_z2_config.json, …]"),
    # chosen with an override as llamafactory-cli takes them, on the 8 GPUs of examples/README.md
    Run(
        "llamafactory",
        "examples/train_full/qwen3_full_sft.yaml",
        ("deepspeed=examples/deepspeed/ds_z0_config.json", "world_size=8"),
    ),
    Run(
        "llamafactory",
        "examples/train_full/qwen3_full_sft.yaml",
        ("deepspeed=examples/deepspeed/ds_z2_config.json", "world_size=8"),
    ),
    # examples/extras/fsdp_qlora/train.sh: CUDA_VISIBLE_DEVICES=0,1 accelerate launch --config_file
    # examples/accelerate/fsdp_config.yaml src/train.py examples/extras/fsdp_qlora/llama3_lora_sft.yaml
    Run(
        "llamafactory",
        "examples/extras/fsdp_qlora/llama3_lora_sft.yaml",
        ("--accelerate-config", "examples/accelerate/fsdp_config.yaml", "world_size=2"),
    ),
    *_runs(
        "axolotl",
        "examples/llama-3/lora-1b.yml",
        "examples/llama-3/qlora-1b.yml",
        "examples/llama-3/fft-8b.yaml",
        "examples/llama-3/instruct-lora-8b.yml",
        "examples/llama-3/instruct-dpo-lora-8b.yml",
        "examples/llama-3/qlora-1b-kto.yaml",
        "examples/llama-3/lora-1b-ray.yml",
        "examples/llama-3/qlora-fsdp-70b.yaml",
        "examples/llama-3/qlora.yml",
        "examples/llama-2/qlora.yml",
        "examples/llama-2/lora.yml",
        "examples/mistral/qlora.yml",
        "examples/mistral/lora.yml",
        "examples/mistral/mixtral/mixtral-qlora-fsdp.yml",
        "examples/mistral/mixtral/mixtral.yml",
        "examples/gemma2/qlora.yml",
        "examples/gemma3/gemma-3-1b-qlora.yml",
        "examples/gemma3/gemma-3-4b-qlora.yml",
        "examples/qwen2/dpo.yaml",
        "examples/qwen2/reward-model.yaml",
        "examples/qwen3/32b-qlora.yaml",
        "examples/qwen3/qlora-fsdp.yaml",
        "examples/qwen3/8b-lora-fused-attn.yaml",
        "examples/expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml",
        "examples/qwen2_5-vl/lora-7b.yaml",
        "examples/gpt-oss/gpt-oss-20b-sft-lora-singlegpu.yaml",
        "examples/gpt-oss/gpt-oss-20b-fft-deepspeed-zero3.yaml",
        "examples/gpt-oss/gpt-oss-20b-fft-fsdp2.yaml",
        "examples/gpt-oss/gpt-oss-20b-fft-fsdp2-offload.yaml",
        "examples/deepseek-v2/fft-fsdp-16b.yaml",
        "examples/llama-4/scout-qlora-single-h100-flex.yaml",
        "examples/glm4/qlora-32b.yaml",
        "examples/olmo3/olmo3-7b-qlora.yaml",
        "examples/phi/phi3-ft.yml",
        "examples/alst/llama3-8b-deepspeed-alst.yaml",
    ),
    # TRL: `trl sft --config examples/cli_configs/example_config.yaml`, alone and under each accelerate config of
    # examples/accelerate_configs (`accelerate launch --config_file …`, as TRL's docs launch multi-GPU runs)
    Run("trl", "examples/cli_configs/example_config.yaml"),
    *(
        Run(
            "trl",
            "examples/cli_configs/example_config.yaml",
            ("--accelerate-config", f"examples/accelerate_configs/{name}.yaml"),
        )
        for name in ("multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp1", "fsdp2")
    ),
    *_runs(
        "torchtune",
        "recipes/configs/llama3_2/1B_lora_single_device.yaml",
        "recipes/configs/llama3_2/1B_full_single_device.yaml",
        "recipes/configs/llama3_2/3B_qlora_single_device.yaml",
        "recipes/configs/llama3_1/8B_lora_single_device.yaml",
        "recipes/configs/llama3_1/8B_qlora_single_device.yaml",
        "recipes/configs/llama3_1/8B_full.yaml",
        "recipes/configs/llama3_1/8B_full_single_device.yaml",
        "recipes/configs/llama3_1/8B_lora_dpo.yaml",
        "recipes/configs/llama3/8B_dora_single_device.yaml",
        "recipes/configs/llama3/8B_qdora_single_device.yaml",
        "recipes/configs/qwen2_5/7B_lora_single_device.yaml",
        "recipes/configs/qwen2_5/3B_full.yaml",
        "recipes/configs/qwen3/8B_lora_single_device.yaml",
        "recipes/configs/qwen3/14B_lora_single_device.yaml",
        "recipes/configs/qwen3/4B_full_single_device.yaml",
        "recipes/configs/qwen3/0.6B_lora.yaml",
        "recipes/configs/gemma2/2B_lora_single_device.yaml",
        "recipes/configs/gemma2/9B_qlora_single_device.yaml",
        "recipes/configs/llama2/7B_qlora_single_device.yaml",
        "recipes/configs/mistral/7B_qlora_single_device.yaml",
        "recipes/configs/mistral/7B_full_low_memory.yaml",
        "recipes/configs/phi3/mini_lora_single_device.yaml",
        "recipes/configs/phi4/14B_full.yaml",
        "recipes/configs/llama4/scout_17B_16E_full.yaml",
        "recipes/configs/llama3_2_vision/11B_lora_single_device.yaml",
    ),
]

SUPPORT = {
    # files the configs above name (deepspeed: …, --config_file …), or a launch script naming one
    "llamafactory": {
        "examples/deepspeed/ds_z0_config.json",
        "examples/deepspeed/ds_z2_config.json",
        "examples/deepspeed/ds_z3_config.json",
        "examples/deepspeed/ds_z3_fp8_config.json",
        "examples/accelerate/fsdp_config.yaml",
        "examples/extras/fsdp_qlora/train.sh",
    },
    "axolotl": {
        "deepspeed_configs/zero2.json",
        "deepspeed_configs/zero3.json",
        "deepspeed_configs/zero3_bf16.json",
        "deepspeed_configs/zero3_bf16_cpuoffload_all.json",
    },
    "trl": {
        f"examples/accelerate_configs/{n}.yaml"
        for n in ("multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp1", "fsdp2")
    },
    "torchtune": set(),
}

NOT_IN_CATALOG = "is not in the catalog, the local HF cache or on disk, and vramledger works offline"

FAILS: dict[str, tuple[str, str]] = {
    # run id → (the one-line error must contain this, why)
    "llamafactory/examples/extras/adam_mini/qwen2_full_sft.yaml": (
        f"model 'Qwen/Qwen2-1.5B-Instruct' (model_name_or_path) {NOT_IN_CATALOG}",
        "Qwen2 (not 2.5) 1.5B is not in the catalog, and no verified config.json was at hand to add it",
    ),
    "llamafactory/examples/extras/oft/qwen2_5vl_oft_sft.yaml": (
        "finetuning_type 'oft' is not modelled; use lora, freeze or full",
        "LLaMA-Factory's OFT path (finetuning_type: oft) is not mapped to a TrainSpec method",
    ),
    "axolotl/examples/qwen2_5-vl/lora-7b.yaml": (
        "lora_target_modules 'model.language_model.layers.[\\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)"
        "_proj' is a regular expression",
        "a regex target (PEFT matches it against whole module names, here: the language model only, not the vision "
        "tower) is not evaluated; naming the modules is not equivalent on a VLM, whose vision MLP has the same names",
    ),
    "axolotl/examples/glm4/qlora-32b.yaml": (
        f"model 'THUDM/GLM-4-32B-0414' (base_model) {NOT_IN_CATALOG}",
        "only GLM-4-9B is in the catalog",
    ),
    "axolotl/examples/olmo3/olmo3-7b-qlora.yaml": (
        f"model 'allenai/Olmo-3-7B-Instruct-SFT' (base_model) {NOT_IN_CATALOG}",
        "OLMo-3 is not in the catalog (OLMo-2 is)",
    ),
    "torchtune/recipes/configs/phi3/mini_lora_single_device.yaml": (
        "lora targets: q_proj, v_proj, gate_proj, up_proj not found in phi3 layers",
        "torchtune's Phi-3 has separate q/k/v and w1/w3 projections (it splits HF's fused qkv_proj and gate_up_proj "
        "when loading), so its LoRA shapes are not those of any module of the HF model vramledger sizes",
    ),
    "torchtune/recipes/configs/llama3_2_vision/11B_lora_single_device.yaml": (
        "the torchtune builder 'llama3_2_vision_11b' (model._component_) is not in vramledger's table",
        "Llama-3.2-Vision is not in the catalog",
    ),
}


@dataclass(frozen=True)
class Expect:
    """What the file says, read by hand: the estimate must have read the same."""

    method: str
    precision: str
    micro_batch: int
    seq_len: int
    grad_accum: int
    optimizer: str | None = None
    grad_ckpt: bool | None = None
    quant_bits: int | None = None
    lora_rank: int | None = None
    zero: int | None = None
    """DeepSpeed ZeRO stage of the config the file names (the distributed engine reads ``zero-N``)."""
    world_size: int | None = None
    dora: bool | None = None
    target_parameters: tuple[str, ...] | None = None
    """PEFT target_parameters (``lora_target_parameters``), () when the file names none."""


EXPECT: dict[str, Expect] = {
    # qwen3_lora_sft.yaml: finetuning_type lora, lora_rank 8, bf16: true, per_device_train_batch_size 1,
    # gradient_accumulation_steps 8, cutoff_len 2048
    "llamafactory/examples/train_lora/qwen3_lora_sft.yaml": Expect(
        method="lora", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=8, lora_rank=8
    ),
    # ds3: the same with deepspeed: examples/deepspeed/ds_z3_config.json (zero_optimization.stage 3), accumulation 2
    "llamafactory/examples/train_lora/qwen3_lora_sft_ds3.yaml": Expect(
        method="lora", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=2, lora_rank=8, zero=3
    ),
    # qwen3vl_lora_sft.yaml: Qwen3-VL-4B (vision tower included), finetuning_type lora, lora_rank 8, batch 1,
    # accumulation 8, cutoff_len 2048, bf16
    "llamafactory/examples/train_lora/qwen3vl_lora_sft.yaml": Expect(
        method="lora", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=8, lora_rank=8
    ),
    # train_full/qwen3_full_sft.yaml: finetuning_type full, ds_z3_config.json, batch 1, accumulation 2
    "llamafactory/examples/train_full/qwen3_full_sft.yaml": Expect(
        method="full", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=2, zero=3
    ),
    "llamafactory/examples/train_full/qwen3_full_sft.yaml deepspeed=examples/deepspeed/ds_z2_config.json "
    "world_size=8": Expect(
        method="full", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=2, zero=2, world_size=8
    ),
    # otfq: quantization_bit 4, quantization_method bnb, finetuning_type lora → QLoRA on a 4-bit base
    "llamafactory/examples/train_qlora/qwen3_lora_sft_otfq.yaml": Expect(
        method="qlora", precision="bf16-mixed", micro_batch=1, seq_len=2048, grad_accum=8, quant_bits=4, lora_rank=8
    ),
    # galore: finetuning_type full, pure_bf16: true, use_galore (not modelled), batch 1, accumulation 1
    "llamafactory/examples/extras/galore/llama3_full_sft.yaml": Expect(
        method="full", precision="bf16-true", micro_batch=1, seq_len=2048, grad_accum=1
    ),
    # fsdp_qlora under train.sh's launch: quantization_bit 4, 2 GPUs
    "llamafactory/examples/extras/fsdp_qlora/llama3_lora_sft.yaml --accelerate-config "
    "examples/accelerate/fsdp_config.yaml world_size=2": Expect(
        method="qlora",
        precision="bf16-mixed",
        micro_batch=1,
        seq_len=2048,
        grad_accum=8,
        quant_bits=4,
        lora_rank=8,
        world_size=2,
    ),
    # axolotl llama-3/lora-1b.yml: adapter lora, lora_r 16, micro_batch_size 2, gradient_accumulation_steps 2,
    # sequence_len 2048, sample_packing true, bf16: auto, optimizer adamw_8bit, gradient_checkpointing true
    "axolotl/examples/llama-3/lora-1b.yml": Expect(
        method="lora",
        precision="bf16-mixed",
        micro_batch=2,
        seq_len=2048,
        grad_accum=2,
        optimizer="adamw_8bit",
        grad_ckpt=True,
        lora_rank=16,
    ),
    # qlora-1b.yml: adapter qlora, lora_r 32, micro_batch_size 2, accumulation 4, sequence_len 2048, packing,
    # optimizer adamw_bnb_8bit (HF's alias of adamw_8bit)
    "axolotl/examples/llama-3/qlora-1b.yml": Expect(
        method="qlora",
        precision="bf16-mixed",
        micro_batch=2,
        seq_len=2048,
        grad_accum=4,
        optimizer="adamw_8bit",
        quant_bits=4,
        lora_rank=32,
    ),
    # fft-8b.yaml: no adapter (full), micro_batch_size 1, accumulation 8, sequence_len 8192, packing,
    # paged_adamw_8bit, gradient_checkpointing true; bf16: auto loads the model in bf16 (axolotl loaders/model.py:
    # torch_dtype) and the Trainer updates those bf16 weights: no fp32 master copy (vramledger's bf16-true)
    "axolotl/examples/llama-3/fft-8b.yaml": Expect(
        method="full",
        precision="bf16-true",
        micro_batch=1,
        seq_len=8192,
        grad_accum=8,
        optimizer="paged_adamw_8bit",
        grad_ckpt=True,
    ),
    # mistral/qlora.yml: load_in_4bit, adapter qlora, lora_r 32, micro_batch_size 2, accumulation 4, seq 8192,
    # packing, optimizer adamw_bnb_8bit
    "axolotl/examples/mistral/qlora.yml": Expect(
        method="qlora",
        precision="bf16-mixed",
        micro_batch=2,
        seq_len=8192,
        grad_accum=4,
        optimizer="adamw_8bit",
        quant_bits=4,
        lora_rank=32,
    ),
    # mistral/mixtral/mixtral-qlora-fsdp.yml: adapter qlora, load_in_4bit, lora_r 32, micro_batch_size 2,
    # accumulation 4, sequence_len 1024, optimizer adamw_torch_fused, FSDP FULL_SHARD with offloaded parameters
    "axolotl/examples/mistral/mixtral/mixtral-qlora-fsdp.yml": Expect(
        method="qlora",
        precision="bf16-mixed",
        micro_batch=2,
        seq_len=1024,
        grad_accum=4,
        optimizer="adamw_torch_fused",
        quant_bits=4,
        lora_rank=32,
    ),
    # qwen3/32b-qlora.yaml: load_in_4bit, adapter qlora, lora_r 16, micro_batch_size 1, accumulation 2, seq 2048,
    # optimizer adamw_torch_4bit (torchao: estimated as the 8-bit AdamW, with a warning)
    "axolotl/examples/qwen3/32b-qlora.yaml": Expect(
        method="qlora",
        precision="bf16-mixed",
        micro_batch=1,
        seq_len=2048,
        grad_accum=2,
        optimizer="adamw_8bit",
        quant_bits=4,
        lora_rank=16,
    ),
    # gpt-oss-20b-sft-lora-singlegpu.yaml: adapter lora, lora_r 8, micro_batch_size 1, accumulation 8, seq 4096,
    # packing, bf16: true, optimizer adamw_torch_8bit (torchao AdamW8bit); its lora_target_parameters block is
    # commented out ("TODO: not supported for now"): none (tests/upstream/test_target_parameters.py runs it uncommented)
    "axolotl/examples/gpt-oss/gpt-oss-20b-sft-lora-singlegpu.yaml": Expect(
        method="lora",
        precision="bf16-mixed",
        micro_batch=1,
        seq_len=4096,
        grad_accum=8,
        optimizer="adamw_8bit",
        lora_rank=8,
        target_parameters=(),
    ),
    # qwen3_30ba3b_ep_lora_4gpu.yaml: adapter lora, lora_r 32, q/k/v/o_proj, micro_batch_size 1, accumulation 1,
    # seq 2048, bf16: true, adamw_torch_8bit; lora_target_parameters commented out as well
    "axolotl/examples/expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml": Expect(
        method="lora",
        precision="bf16-mixed",
        micro_batch=1,
        seq_len=2048,
        grad_accum=1,
        optimizer="adamw_8bit",
        lora_rank=32,
        target_parameters=(),
    ),
    # gpt-oss-20b-fft-deepspeed-zero3.yaml: full, bf16 weights as above, accumulation 2,
    # deepspeed_configs/zero3_bf16.json (stage 3)
    "axolotl/examples/gpt-oss/gpt-oss-20b-fft-deepspeed-zero3.yaml": Expect(
        method="full",
        precision="bf16-true",
        micro_batch=1,
        seq_len=4096,
        grad_accum=2,
        optimizer="adamw_8bit",
        zero=3,
    ),
    # TRL example_config.yaml sets only the model and the learning rate: SFTConfig's defaults (batch 8, length 1024,
    # bf16, checkpointing on) and no PEFT (full)
    "trl/examples/cli_configs/example_config.yaml": Expect(
        method="full", precision="bf16-mixed", micro_batch=8, seq_len=1024, grad_accum=1, grad_ckpt=True
    ),
    "trl/examples/cli_configs/example_config.yaml --accelerate-config "
    "examples/accelerate_configs/deepspeed_zero3.yaml": Expect(
        method="full", precision="bf16-mixed", micro_batch=8, seq_len=1024, grad_accum=1, zero=3, world_size=8
    ),
    # torchtune llama3_2/1B_lora_single_device.yaml: lora_rank 64, batch_size 4, dtype bf16 (no autocast),
    # max_seq_len null (vramledger's default length, with a warning), enable_activation_checkpointing false,
    # gradient_accumulation_steps 8, fused AdamW
    "torchtune/recipes/configs/llama3_2/1B_lora_single_device.yaml": Expect(
        method="lora",
        precision="bf16-true",
        micro_batch=4,
        seq_len=2048,
        grad_accum=8,
        optimizer="adamw_torch_fused",
        grad_ckpt=False,
        lora_rank=64,
    ),
    # llama3_1/8B_qlora_single_device.yaml: qlora_llama3_1_8b, lora_rank 8, batch_size 2, accumulation 8,
    # activation checkpointing true
    "torchtune/recipes/configs/llama3_1/8B_qlora_single_device.yaml": Expect(
        method="qlora",
        precision="bf16-true",
        micro_batch=2,
        seq_len=2048,
        grad_accum=8,
        grad_ckpt=True,
        quant_bits=4,
        lora_rank=8,
    ),
    # llama3/8B_qdora_single_device.yaml: lora_llama3_8b with use_dora: True and quantize_base: True (QDoRA: the
    # qlora_* builders are this builder with quantize_base=True), lora_rank 8, batch 2, accumulation 8, bf16
    "torchtune/recipes/configs/llama3/8B_qdora_single_device.yaml": Expect(
        method="qlora",
        precision="bf16-true",
        micro_batch=2,
        seq_len=2048,
        grad_accum=8,
        grad_ckpt=True,
        quant_bits=4,
        lora_rank=8,
        dora=True,
    ),
    # llama3_1/8B_full_single_device.yaml: llama3_1_8b (full), batch 2, accumulation 1, dtype bf16, optimizer
    # bitsandbytes.optim.PagedAdamW8bit (optimizer_in_bwd: True), activation checkpointing true
    "torchtune/recipes/configs/llama3_1/8B_full_single_device.yaml": Expect(
        method="full",
        precision="bf16-true",
        micro_batch=2,
        seq_len=2048,
        grad_accum=1,
        optimizer="paged_adamw_8bit",
        grad_ckpt=True,
    ),
    # mistral/7B_full_low_memory.yaml: mistral_7b (full), batch 2, bf16, bitsandbytes.optim.PagedAdamW (32-bit states)
    "torchtune/recipes/configs/mistral/7B_full_low_memory.yaml": Expect(
        method="full",
        precision="bf16-true",
        micro_batch=2,
        seq_len=2048,
        grad_accum=1,
        optimizer="paged_adamw_32bit",
        grad_ckpt=True,
    ),
    # qwen3/4B_full_single_device.yaml: qwen3_4b_instruct (full), batch_size 2, accumulation 1, dtype bf16, fused
    # AdamW, activation checkpointing true, max_seq_len null (vramledger's default length, with a warning)
    "torchtune/recipes/configs/qwen3/4B_full_single_device.yaml": Expect(
        method="full",
        precision="bf16-true",
        micro_batch=2,
        seq_len=2048,
        grad_accum=1,
        optimizer="adamw_torch_fused",
        grad_ckpt=True,
    ),
}


WARNS: dict[str, str] = {
    # run id → a warning the estimate must give: what the file sets that the estimate does not model, said aloud
    "llamafactory/examples/train_lora/qwen3_lora_dpo.yaml": "stage dpo: reference/reward/value models and paired "
    "batches are not modelled",
    "llamafactory/examples/train_lora/qwen3_lora_kto.yaml": "stage kto: reference/reward/value models",
    "llamafactory/examples/train_lora/qwen3_lora_reward.yaml": "stage rm: reference/reward/value models",
    "llamafactory/examples/train_lora/qwen3vl_lora_dpo.yaml": "stage dpo: reference/reward/value models",
    "llamafactory/examples/train_full/qwen3_full_sft.yaml": "world_size: not given in the configs",
    "axolotl/examples/qwen3/32b-qlora.yaml": "optimizer: adamw_torch_4bit: torchao AdamW4bit",
    "axolotl/examples/llama-3/fft-8b.yaml": "model 'NousResearch/Meta-Llama-3.1-8B' is not in the catalog as such: "
    "sized with the config of meta-llama/Llama-3.1-8B",
    "torchtune/recipes/configs/llama3_2/1B_lora_single_device.yaml": "seq_len: tokenizer.max_seq_len is null",
}


# -- running ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def ledger(self) -> dict[str, Any]:
        return json.loads(self.stdout)


@cache
def _estimate(run: Run) -> Outcome:
    """``vramledger estimate --config FILE ARGS --json`` from the framework's root, with an empty HF cache."""
    from vramledger.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        empty = HERE / ".no-hf-cache"  # never created: no snapshot can be found
        mp.setenv("HF_HUB_CACHE", str(empty))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.chdir(HERE / run.framework)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["estimate", "--config", run.config, *run.args, "--json"])
    return Outcome(code, out.getvalue(), err.getvalue())


def _named_model(run: Run) -> str:
    """The model as the file names it: the framework's model key, or for torchtune the hub id of its
    ``tune download`` line (the checkpoint its builder loads)."""
    text = (HERE / run.framework / run.config).read_text()
    if run.framework == "torchtune":
        found = re.search(r"tune download (\S+)", text)
        assert found, f"{run.config}: no `tune download` line"
        return found.group(1)
    raw = yaml.safe_load(text)
    return str(raw["base_model" if run.framework == "axolotl" else "model_name_or_path"]).strip()


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_estimates_or_fails_as_documented(run: Run) -> None:
    outcome = _estimate(run)
    if run.id in FAILS:
        expected, why = FAILS[run.id]
        lines = outcome.stderr.strip().splitlines()
        print(f"expected failure ({why}); got: {lines}")
        assert outcome.code == 2, outcome.stderr
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert expected in lines[0]
        return
    assert outcome.code == 0, outcome.stderr
    ledger = outcome.ledger
    assert ledger["engine"] == "analytic"
    assert ledger["params"] > 0 and 0 < ledger["trainable_params"] <= ledger["params"]
    assert ledger["peak_allocated_bytes"] > 0


@pytest.mark.parametrize("run", [r for r in RUNS if r.id not in FAILS], ids=lambda r: r.id)
def test_estimate_names_the_files_model(run: Run) -> None:
    """Never a different model: the estimate keeps the name the file gives (a variant sized with its base's
    config says so in a warning)."""
    named = _named_model(run)
    got = _estimate(run).ledger["model"]
    print(f"{run.id}: file names {named!r}, estimate names {got!r}")
    assert got == named


@pytest.mark.parametrize("run_id", sorted(EXPECT))
def test_estimate_reads_what_the_file_says(run_id: str) -> None:
    run = next(r for r in RUNS if r.id == run_id)
    want = EXPECT[run_id]
    s = _estimate(run).ledger["settings"]
    got = Expect(
        method=s["method"],
        precision=s["precision"],
        micro_batch=s["micro_batch"],
        seq_len=s["seq_len"],
        grad_accum=s["grad_accum"],
        optimizer=s["optimizer"] if want.optimizer is not None else None,
        grad_ckpt=s["grad_ckpt"] if want.grad_ckpt is not None else None,
        quant_bits=s["quant"]["bits"] if "quant" in s else None,
        lora_rank=s["lora"]["rank"] if "lora" in s else None,
        zero=_zero_stage(s) if want.zero is not None else None,
        world_size=s["distributed"]["world_size"] if want.world_size is not None else None,
        dora=s["lora"]["dora"] if want.dora is not None else None,
        target_parameters=tuple(s["lora"].get("target_parameters", ())) if want.target_parameters is not None else None,
    )
    print(f"expected {want}\ngot      {got}")
    assert got == want


@pytest.mark.parametrize("run_id", sorted(WARNS))
def test_estimate_says_what_it_leaves_out(run_id: str) -> None:
    run = next(r for r in RUNS if r.id == run_id)
    warnings = _estimate(run).ledger["warnings"]
    print("\n".join(warnings))
    assert any(WARNS[run_id] in w for w in warnings)


def _zero_stage(settings: dict[str, Any]) -> int | None:
    engine = settings.get("distributed", {}).get("engine", "")
    return int(engine.removeprefix("zero-")) if engine.startswith("zero-") else None


def test_expected_failures_are_few_and_all_run() -> None:
    ids = {r.id for r in RUNS}
    assert set(FAILS) <= ids and set(EXPECT) <= ids and set(WARNS) <= ids
    assert not set(FAILS) & set(EXPECT)
    assert len(RUNS) >= 30 and len(FAILS) <= len(RUNS) // 6


# -- the corpus is verbatim and complete ------------------------------------------------------------------------


def _sources() -> dict[str, str]:
    """framework/path → blob id, from SOURCES.md."""
    out: dict[str, str] = {}
    framework = ""
    for line in (HERE / "SOURCES.md").read_text().splitlines():
        head = re.match(r"## (\w+): ", line)
        if head:
            framework = head.group(1)
        row = re.match(r"\| \[(.+?)\]\(https://github\.com/\S+/blob/[0-9a-f]{40}/\S+\) \| `([0-9a-f]{40})` \|", line)
        if row:
            out[f"{framework}/{row.group(1)}"] = row.group(2)
    return out


def test_every_file_is_verbatim_with_its_source() -> None:
    """Each file's git blob id equals the upstream one recorded in SOURCES.md (``git ls-tree COMMIT PATH`` upstream
    gives the same id), so no file was edited after copying; and the corpus holds exactly the listed files."""
    sources = _sources()
    here = {f"{fw}/{rel}" for fw in UPSTREAMS for rel in corpus_files(fw)}
    assert here == set(sources)
    for name, blob in sources.items():
        assert blob_id((HERE / name).read_bytes()) == blob, f"{name} differs from its upstream copy"


@pytest.mark.parametrize("framework", sorted(UPSTREAMS))
def test_the_licence_recorded_is_the_licence_copied(framework: str) -> None:
    first = (HERE / framework / "LICENSE").read_text().strip().splitlines()[0].strip()
    spdx = {"Apache License": "Apache-2.0", "BSD 3-Clause License": "BSD-3-Clause"}[first]
    assert UPSTREAMS[framework].licence == spdx


def test_every_file_is_run_or_used_by_a_run() -> None:
    """Each file is a config some run estimates, or a support file: named by a config or a run's arguments
    (DeepSpeed JSON, accelerate YAML), or a launch script that names a config of the corpus; and each repository's
    LICENSE, which both licences ask to pass on with copies (Apache-2.0 §4(a); BSD-3-Clause, clause 1)."""
    configs = {f"{r.framework}/{r.config}" for r in RUNS}
    support = {f"{fw}/{p}" for fw, paths in SUPPORT.items() for p in paths}
    here = {f"{fw}/{rel}" for fw in UPSTREAMS for rel in corpus_files(fw)}
    assert here == configs | support | {f"{fw}/LICENSE" for fw in UPSTREAMS}
    text = {name: (HERE / name).read_text() for name in here}
    for name in support:
        framework, rel = name.split("/", 1)
        named = [other for other in here - {name} if other.startswith(f"{framework}/") and rel in text[other]]
        named += [r.id for r in RUNS if r.framework == framework and any(rel in a for a in r.args)]
        launches = [c for c in configs if c.startswith(f"{framework}/") and c.split("/", 1)[1] in text[name]]
        assert named or launches, f"{name} is named by no config or run, and names no config"
