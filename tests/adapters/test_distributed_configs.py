"""Distributed settings read from each framework's config: FSDP strategy and version, offload, DeepSpeed buckets.
Expected values come from the file written in each test and the framework's documented defaults (cited)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.adapters import load_config
from vramledger.specs import Sharding

F = Path(__file__).parent / "fixtures"


def test_accelerate_fsdp_defaults_to_version_1(tmp_path: Path) -> None:
    # accelerate utils/dataclasses.py FullyShardedDataParallelPlugin: fsdp_version defaults to 1
    rc = load_config(F / "lf_accelerate_fsdp_config.yaml")
    assert (rc.train.fsdp, rc.train.fsdp_version, rc.train.zero_stage) == (Sharding.FULL_SHARD, 1, 0)


def test_fsdp2_reshard_after_forward_false_is_shard_grad_op(tmp_path: Path) -> None:
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(
        "distributed_type: FSDP\nnum_processes: 4\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
    )
    t = load_config(None, accelerate_config=cfg).train
    assert (t.fsdp, t.fsdp_version, t.world_size) == (Sharding.SHARD_GRAD_OP, 2, 4)


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("full_shard auto_wrap", Sharding.FULL_SHARD),
        ("shard_grad_op auto_wrap", Sharding.SHARD_GRAD_OP),
        ("hybrid_shard auto_wrap", Sharding.HYBRID_SHARD),
    ],
    ids=["full", "grad-op", "hybrid"],
)
def test_hf_trainer_fsdp_string(tmp_path: Path, words: str, expected: Sharding) -> None:
    # transformers TrainingArguments.fsdp: "full_shard auto_wrap" etc.
    cfg = tmp_path / "args.json"
    cfg.write_text(
        json.dumps(
            {
                "model_name_or_path": "meta-llama/Llama-3.1-8B",
                "fsdp": words,
                "bf16": True,
                "per_device_train_batch_size": 1,
            }
        )
    )
    t = load_config(cfg, overrides=["world_size=8"]).train
    assert t.fsdp is expected and t.zero_stage == 0


def test_torchtune_distributed_recipe_is_fsdp2(tmp_path: Path) -> None:
    # torchtune lora_finetune_distributed.py / training/_distributed.py shard_model: fully_shard per layer,
    # reshard_after_forward=True; fsdp_cpu_offload -> CPUOffloadPolicy (parameters, gradients, optimizer on host)
    text = (F / "torchtune_llama3_8B_lora_single_device.yaml").read_text() + "\nfsdp_cpu_offload: True\n"
    cfg = tmp_path / "8B_lora_distributed.yaml"
    cfg.write_text(text)
    t = load_config(cfg, overrides=["world_size=2"]).train
    assert (t.fsdp, t.fsdp_version, t.offload_params, t.offload_optimizer) == (Sharding.FULL_SHARD, 2, True, True)
    single = load_config(F / "torchtune_llama3_8B_lora_single_device.yaml").train
    assert single.fsdp is None


def test_deepspeed_overlap_comm_and_buckets(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 2,
                    "overlap_comm": True,
                    "reduce_bucket_size": 2e8,
                    "contiguous_gradients": True,
                }
            }
        )
    )
    rc = load_config(None, deepspeed=ds)
    zb = rc.train.zero_buffers
    assert zb is not None and zb.overlap(2) and zb.reduce_bucket_size == 200_000_000
    assert not any("overlap_comm" in w for w in rc.warnings)  # modelled now, not ignored


def test_deepspeed_bad_overlap_is_one_line(tmp_path: Path) -> None:
    from vramledger.errors import VramledgerError

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}))
    with pytest.raises(VramledgerError, match="overlap_comm must be true or false"):
        load_config(None, deepspeed=ds)
