"""Each fixture mirrors a framework's shipped example; the expected values are read off that file and the
framework's documented defaults (cited per assertion), not off our implementation."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.specs import Attention, DType, LoraSpec, Loss, Method, Optimizer, Precision, QuantSpec, Sharding

F = Path(__file__).parent / "fixtures"


def test_llamafactory_lora_sft() -> None:
    rc = load_config(F / "lf_llama3_lora_sft.yaml")
    t = rc.train
    assert rc.format == "llamafactory"
    assert rc.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert t.method is Method.LORA  # finetuning_type: lora
    # lora_rank: 8, lora_target: all; alpha unset → finetuning_args.py: lora_rank * 2; dropout default 0
    assert t.lora == LoraSpec(rank=8, alpha=16.0, targets=("all",), dropout=0.0, dora=False, adapter_fp32=True)
    assert t.quant is None
    assert t.precision is Precision.BF16_MIXED  # bf16: true, no pure_bf16 → trainable params upcast to fp32
    assert t.micro_batch == 1 and t.grad_accum == 8 and t.seq_len == 2048
    assert t.grad_ckpt is True  # on unless disable_gradient_checkpointing
    assert rc.provenance["grad_ckpt"].startswith("default: llamafactory")
    assert t.packing is False  # stage sft
    assert t.optimizer is Optimizer.ADAMW_FUSED  # transformers 5 TrainingArguments default with torch >= 2.8
    assert t.attn is Attention.SDPA  # flash_attn auto → transformers' sdpa
    assert t.loss is Loss.STANDARD
    assert t.eval_batch is None  # the example's eval block is commented out
    assert (t.world_size, t.zero_stage, t.offload_optimizer, t.offload_params) == (1, 0, False, False)
    assert rc.provenance["seq_len"] == "file: cutoff_len"
    assert rc.warnings == ()


def test_llamafactory_qlora() -> None:
    t = load_config(F / "lf_llama3_qlora_otfq.yaml").train
    assert t.method is Method.QLORA  # quantization_bit: 4, quantization_method: bnb
    # model_args.py: quantization_type='nf4', double_quantization=True
    assert t.quant == QuantSpec(bits=4, quant_type="nf4", double_quant=True)
    assert t.lora is not None and t.lora.rank == 8


def test_llamafactory_pretrain_packs() -> None:
    rc = load_config(F / "lf_llama3_lora_pretrain.yaml")
    assert rc.train.packing is True  # parser.py: packing = stage == "pt" when unset
    assert "stage == 'pt'" in rc.provenance["packing"]


def test_llamafactory_full_with_ds3() -> None:
    rc = load_config(F / "lf_llama3_full_sft_ds3.yaml")
    t = rc.train
    assert t.method is Method.FULL and t.lora is None
    assert t.zero_stage == 3  # ds_z3_config.json zero_optimization.stage
    assert t.grad_accum == 2 and t.micro_batch == 1  # "auto" in the DS file takes the trainer's values
    assert rc.deepspeed is not None
    # "auto" buckets from transformers' trainer_config_finalize with Llama-3-8B's hidden size 4096:
    assert rc.deepspeed.buckets["reduce_bucket_size"] == 4096 * 4096
    assert rc.deepspeed.buckets["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert rc.deepspeed.buckets["stage3_param_persistence_threshold"] == 40960
    assert any("world_size" in w for w in rc.warnings)  # the launcher decides; we say so
    # the buckets are modelled now (analytic/distributed/core.py): they reach the spec instead of a warning
    assert t.zero_buffers is not None and t.zero_buffers.reduce_bucket_size == 4096 * 4096
    assert t.zero_buffers.max_live_parameters == int(1e9)  # ds_z3_config.json stage3_max_live_parameters: 1e9
    assert not any("stage3_max_live_parameters" in w for w in rc.warnings)


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        (["disable_gradient_checkpointing=true"], "grad_ckpt", False),
        (["pure_bf16=true"], "precision", Precision.BF16),
        (["fp16=true", "bf16=false"], "precision", Precision.FP16_MIXED),
        (["enable_liger_kernel=true"], "loss", Loss.FUSED),
        (["flash_attn=fa2"], "attn", Attention.FLASH2),
        (["flash_attn=disabled"], "attn", Attention.EAGER),
        (["optim=paged_adamw_8bit"], "optimizer", Optimizer.PAGED_ADAMW_8BIT),
        (["cutoff_len=4096"], "seq_len", 4096),
        (["packing=true"], "packing", True),
        (["neat_packing=true"], "packing", True),
    ],
    ids=lambda x: str(x),
)
def test_llamafactory_overrides(overrides: list[str], field: str, value: object) -> None:
    rc = load_config(F / "lf_llama3_lora_sft.yaml", overrides=overrides)
    assert getattr(rc.train, field) == value
    assert rc.provenance[field].startswith("override: ")


def test_llamafactory_pure_bf16_keeps_adapters_bf16() -> None:
    # model/adapter.py: autocast_adapter_dtype=cast_trainable_params_to_fp32, which is False under pure_bf16
    t = load_config(F / "lf_llama3_lora_sft.yaml", overrides=["pure_bf16=true"]).train
    assert t.lora is not None and t.lora.adapter_fp32 is False


def test_llamafactory_eval_defaults() -> None:
    rc = load_config(F / "lf_llama3_lora_sft.yaml", overrides=["val_size=0.1", "eval_strategy=steps"])
    assert rc.train.eval_batch == 8  # TrainingArguments per_device_eval_batch_size=8
    assert rc.train.eval_accumulation_steps is None  # unset: logits stay on the GPU
    assert "stay on the GPU" in rc.provenance["eval_accumulation_steps"]
    rc = load_config(
        F / "lf_llama3_lora_sft.yaml", overrides=["do_eval=true", "val_size=0.1", "predict_with_generate=true"]
    )
    assert rc.train.predict_with_generate is True
    assert rc.train.generation_max_new_tokens == 1024  # generating_args.py max_new_tokens=1024


def test_llamafactory_freeze() -> None:
    t = load_config(F / "lf_llama3_lora_sft.yaml", overrides=["finetuning_type=freeze"]).train
    assert t.method is Method.FREEZE and t.lora is None
    assert t.freeze_trainable_layers == 2  # finetuning_args.py freeze_trainable_layers=2


def test_llamafactory_unmodelled_keys_warn() -> None:
    rc = load_config(
        F / "lf_llama3_lora_sft.yaml", overrides=["use_galore=true", "upcast_lmhead_output=true", "some_new_key=3"]
    )
    text = "\n".join(rc.warnings)
    assert "ignored: use_galore" in text and "ignored: upcast_lmhead_output" in text
    assert "ignored: some_new_key" in text


def test_trl_lora() -> None:
    rc = load_config(F / "trl_sft_lora.yaml")
    t = rc.train
    assert rc.format == "trl" and rc.model == "Qwen/Qwen2-0.5B"
    assert t.method is Method.LORA  # use_peft
    # lora_r 32, lora_alpha 16 from the command; model_config.py lora_dropout=0.05; PEFT's qwen2 targets q/v
    assert t.lora == LoraSpec(rank=32, alpha=16.0, targets=("q_proj", "v_proj"), dropout=0.05)
    assert t.precision is Precision.BF16_MIXED  # base_config.py: bf16 = not fp16
    assert t.grad_ckpt is True  # base_config.py gradient_checkpointing=True
    # No loss_type: sft_config.py __post_init__ sets chunked_nll (without use_liger_kernel), 256-token chunks, each
    # checkpointed (sft_trainer.py _chunked_cross_entropy_loss): its own kind, not torchtune's chunked loss.
    assert t.loss is Loss.CHUNKED_NLL and t.loss_chunk_tokens == 256
    assert t.seq_len == 1024  # sft_config.py max_length=1024
    assert t.packing is True and t.micro_batch == 2 and t.grad_accum == 8
    assert t.eval_batch == 8  # eval_strategy steps + TrainingArguments per_device_eval_batch_size=8
    # ModelConfig dtype defaults to float32: the frozen base stays fp32 under bf16 autocast
    assert t.base_dtype is DType.FP32


def test_trl_full_and_liger() -> None:
    t = load_config(F / "trl_sft_full.yaml").train
    assert t.method is Method.FULL and t.lora is None
    assert t.precision is Precision.BF16_MIXED  # fp32 weights (ModelConfig dtype) under bf16 autocast
    t = load_config(F / "trl_sft_full.yaml", overrides=["use_liger_kernel=true"]).train
    assert t.loss is Loss.FUSED  # sft_config.py: loss_type 'nll' with Liger's fused linear cross-entropy
    t = load_config(F / "trl_sft_full.yaml", overrides=["dtype=bfloat16"]).train
    assert t.precision is Precision.BF16  # weights loaded in bf16 stay bf16


def test_trl_qlora() -> None:
    t = load_config(F / "trl_sft_lora.yaml", overrides=["load_in_4bit=true"]).train
    assert t.method is Method.QLORA
    assert t.quant == QuantSpec(bits=4, quant_type="nf4", double_quant=False)  # use_bnb_nested_quant=False


def test_hf_training_args_json() -> None:
    rc = load_config(F / "hf_run_clm_args.json")
    t = rc.train
    assert rc.format == "hf" and rc.model == "openai-community/gpt2"
    assert t.method is Method.FULL
    assert t.micro_batch == 8 and t.eval_batch == 8 and t.grad_ckpt is True
    assert t.precision is Precision.BF16_MIXED and t.loss is Loss.STANDARD
    assert t.eval_accumulation_steps is None
    assert any("method" in w for w in rc.warnings)  # TrainingArguments cannot say whether PEFT is used


def test_axolotl_lora_8bit() -> None:
    rc = load_config(F / "axolotl_llama3_lora_8b.yml")
    t = rc.train
    assert rc.format == "axolotl" and rc.model == "NousResearch/Meta-Llama-3-8B"
    assert t.method is Method.QLORA and t.quant is not None and t.quant.bits == 8  # adapter lora + load_in_8bit
    # lora_target_linear; lora_modules_to_save: [embed_tokens, lm_head] (PEFT modules_to_save)
    assert t.lora == LoraSpec(
        rank=32, alpha=16.0, targets=("all",), dropout=0.05, modules_to_save=("embed_tokens", "lm_head")
    )
    assert t.precision is Precision.BF16_MIXED  # bf16: auto on a bf16 GPU; adapters stay fp32
    assert (t.micro_batch, t.grad_accum, t.seq_len, t.packing) == (2, 4, 4096, True)
    assert t.optimizer is Optimizer.ADAMW_8BIT and t.attn is Attention.FLASH2 and t.grad_ckpt is True
    assert t.eval_batch == 2  # val_set_size 0.05; eval_batch_size defaults to micro_batch_size
    assert not any("lora_modules_to_save" in w for w in rc.warnings)


def test_axolotl_qlora_and_full() -> None:
    t = load_config(F / "axolotl_llama3_qlora.yml").train
    assert t.method is Method.QLORA
    assert t.quant == QuantSpec(bits=4, quant_type="nf4", double_quant=True)  # loaders/model.py bnb config
    assert t.optimizer is Optimizer.PAGED_ADAMW_32BIT and t.eval_batch is None  # val_set_size: 0
    t = load_config(F / "axolotl_llama3_fft_8b.yaml").train
    assert t.method is Method.FULL
    assert t.precision is Precision.BF16  # weights loaded in cfg.torch_dtype=bf16, no fp32 master copy
    assert (t.seq_len, t.micro_batch, t.grad_accum) == (8192, 1, 8)


def test_axolotl_fsdp_offload() -> None:
    rc = load_config(F / "axolotl_llama3_qlora_fsdp_70b.yaml", overrides=["base_model=NousResearch/Meta-Llama-3-8B"])
    t = rc.train
    assert t.fsdp is Sharding.FULL_SHARD and t.zero_stage == 0  # fsdp_sharding_strategy: FULL_SHARD
    assert t.offload_params is True and t.offload_optimizer is True  # fsdp_offload_params
    assert t.optimizer is Optimizer.ADAMW_FUSED


def test_axolotl_deepspeed_offload_all() -> None:
    ds = F / "axolotl_zero3_bf16_cpuoffload_all.json"
    rc = load_config(F / "axolotl_llama3_fft_8b.yaml", deepspeed=ds, overrides=["world_size=8"])
    t = rc.train
    assert (t.zero_stage, t.offload_optimizer, t.offload_params, t.world_size) == (3, True, True, 8)
    assert any("pin_memory" in w for w in rc.warnings)
    assert rc.provenance["world_size"] == "override: world_size"


def test_torchtune_lora() -> None:
    rc = load_config(F / "torchtune_llama3_8B_lora_single_device.yaml")
    t = rc.train
    # the checkpoint the recipe trains: `tune download meta-llama/Meta-Llama-3-8B-Instruct` into its checkpoint_dir
    # /tmp/Meta-Llama-3-8B-Instruct/ (the llama3_8b builder is the architecture)
    assert rc.format == "torchtune" and rc.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert t.method is Method.LORA
    # lora_attn_modules q/v/output_proj + apply_lora_to_mlp (w1/w2/w3 = gate/down/up); rank 8, alpha 16
    assert t.lora == LoraSpec(
        rank=8,
        alpha=16.0,
        targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        dropout=0.0,
        adapter_fp32=False,
    )
    assert t.precision is Precision.BF16  # dtype: bf16, no autocast
    assert t.optimizer is Optimizer.ADAMW_FUSED  # fused: True
    assert t.loss is Loss.CHUNKED  # LinearCrossEntropyLoss, 8 chunks of the micro-batch's tokens
    assert t.loss_chunk_tokens == 2 * 2048 // 8
    assert (t.micro_batch, t.grad_accum, t.grad_ckpt, t.packing) == (2, 8, True, False)
    assert any("max_seq_len" in w for w in rc.warnings)  # null: length depends on the data


def test_torchtune_qlora() -> None:
    t = load_config(F / "torchtune_llama3_8B_qlora_single_device.yaml", overrides=["tokenizer.max_seq_len=1024"]).train
    assert t.method is Method.QLORA and t.quant == QuantSpec(bits=4, quant_type="nf4", double_quant=True)
    assert t.seq_len == 1024


def test_accelerate_fsdp_alone_and_with_config() -> None:
    rc = load_config(F / "lf_accelerate_fsdp_config.yaml")
    assert rc.format == "fsdp" and rc.model == ""
    assert (rc.train.fsdp, rc.train.world_size) == (Sharding.FULL_SHARD, 2)  # FULL_SHARD, num_processes: 2
    assert rc.train.precision is Precision.BF16_MIXED  # mixed_precision: bf16
    rc = load_config(F / "lf_llama3_lora_sft.yaml", accelerate_config=F / "trl_accelerate_fsdp2.yaml")
    # fsdp_version 2, reshard_after_forward: true
    assert (rc.train.fsdp, rc.train.fsdp_version, rc.train.world_size) == (Sharding.FULL_SHARD, 2, 8)
    assert rc.train.method is Method.LORA


def test_deepspeed_alone() -> None:
    rc = load_config(None, deepspeed=F / "lf_ds_z2_offload_config.json")
    assert rc.model == "" and rc.train.zero_stage == 2 and rc.train.offload_optimizer is True


def test_format_flag_wins() -> None:
    rc = load_config(F / "trl_sft_full.yaml", fmt="hf")
    assert rc.format == "hf" and rc.train.loss is Loss.STANDARD  # as plain TrainingArguments: no chunked loss
