"""Several-GPU remedies: communication bytes derived by hand from the ring collectives, and the rendered section."""

import dataclasses

from vramledger.analytic import estimate
from vramledger.catalog import resolve_model
from vramledger.plan.multigpu import comm_bytes, multi_gpu_options
from vramledger.report.distributed_view import render_distributed
from vramledger.specs import Method, Precision, Sharding, TrainSpec

L8B = resolve_model("llama-3.1-8b")
P = 8_030_261_248


def test_fsdp_gathers_twice_and_reduce_scatters_once() -> None:
    # bf16-true full fine-tuning, 8 ranks: all-gather 2·P bytes in forward and again in backward, reduce-scatter the
    # 2·P bytes of gradients; a ring sends (N-1)/N of each.
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=8, fsdp=Sharding.FULL_SHARD)
    wire, host = comm_bytes(L8B, t)
    assert wire == int((2 * 2 * P + 2 * P) * 7 / 8) and host == 0


def test_ddp_all_reduces_the_gradients() -> None:
    t = TrainSpec(method=Method.FULL, precision=Precision.BF16, world_size=4)
    assert comm_bytes(L8B, t) == (int(2 * 2 * P * 3 / 4), 0)  # reduce-scatter + all-gather of 2·P bytes


def test_options_cover_the_engines_and_mark_this_run() -> None:
    t = TrainSpec(method=Method.FULL, world_size=8, zero_stage=3, grad_ckpt=True)
    opts = multi_gpu_options(L8B, t)
    assert [o.current for o in opts].count(True) == 1
    assert {o.label for o in opts} >= {"DDP", "ZeRO-3", "FSDP full_shard"}
    assert [o.device_bytes for o in opts] == sorted(o.device_bytes for o in opts)
    ddp = next(o for o in opts if o.label == "DDP")
    assert ddp.device_bytes == estimate(L8B, dataclasses.replace(t, zero_stage=0)).device_total


def test_section_fits_100_columns() -> None:
    t = TrainSpec(method=Method.LORA, world_size=8, fsdp=Sharding.FULL_SHARD)
    ledger = estimate(L8B, t)
    text = render_distributed(ledger.settings["distributed"], multi_gpu_options(L8B, t))  # type: ignore[arg-type]
    print(text)
    assert "rank 0 of 8" in text and "FSDP full_shard *" in text
    assert max(len(line) for line in text.splitlines()) <= 100
