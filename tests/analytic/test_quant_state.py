"""QLoRA under FSDP and ZeRO-3 (analytic/quant_state.py, analytic/distributed/core.py): bitsandbytes' QuantState stays
whole on every rank and on the GPU under CPU offload, and FSDP all-gathers the packed 4-bit codes. Each figure is
derived here by hand for Llama-2-70B (80 layers; H 8192, 8 K/V heads of 128, MLP 28672) in NF4 with double
quantisation: one uint8 absmax per 64 weights and one fp32 absmax per 256 of those (bitsandbytes
``functional.quantize_4bit`` with ``compress_statistics=True``)."""

from vramledger.analytic import estimate
from vramledger.analytic.quant_state import quant_state_bytes
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import LoraSpec, Method, Precision, QuantSpec, Sharding, TrainSpec

L70B = resolve_model("llama-2-70b")
H, KV, I, LAYERS = 8192, 1024, 28672, 80
WEIGHTS = (H * H, H * KV, H * KV, H * H, H * I, H * I, I * H)  # q, k, v, o, gate, up, down


def _state(n: int) -> int:
    blocks = -(-n // 64)
    return blocks + 4 * -(-blocks // 256)


QSTATE = LAYERS * sum(_state(n) for n in WEIGHTS)


def _qlora(**kw) -> TrainSpec:  # type: ignore[no-untyped-def]
    return TrainSpec(
        method=Method.QLORA,
        precision=Precision.BF16_MIXED,
        quant=QuantSpec(bits=4, double_quant=True),
        lora=LoraSpec(rank=8, alpha=16, targets=("all",), dropout=0.1),
        micro_batch=2,
        seq_len=2048,
        grad_ckpt=True,
        world_size=2,
        fsdp=Sharding.FULL_SHARD,
        fsdp_version=1,
        **kw,
    )


def _line(ledger, phase: Phase, label_start: str) -> int:  # type: ignore[no-untyped-def]
    return sum(i.bytes for i in ledger.items if i.phase is phase and i.label.startswith(label_start))


def test_quant_state_of_a_70b_nf4_base() -> None:
    assert quant_state_bytes(L70B, _qlora()) == QSTATE
    assert 1.08e9 < QSTATE < 1.09e9
    assert quant_state_bytes(L70B, TrainSpec(method=Method.LORA)) == 0


def test_fsdp_shards_the_packed_codes_and_keeps_the_quant_state_whole() -> None:
    packed = LAYERS * sum(n // 2 for n in WEIGHTS)
    other = 2 * (2 * 32000 * H + H + LAYERS * 2 * H)  # embeddings, output layer, norms in bf16
    frozen = _line(estimate(L70B, _qlora()), Phase.FORWARD, "frozen base")
    assert frozen == -(-(packed + other) // 2) + QSTATE


def test_cpu_offload_leaves_the_quant_state_on_the_gpu() -> None:
    ledger = estimate(L70B, _qlora(offload_params=True, offload_optimizer=True))
    assert _line(ledger, Phase.FORWARD, "frozen base") == QSTATE


def test_fsdp_gathers_one_layer_of_packed_codes() -> None:
    # quant_storage bf16: the n/2 bytes of a layer's codes are n/4 bf16 elements; its two RMSNorms and its LoRA
    # adapters (r·(in + out) per linear) are gathered in bf16 too.
    adapters = 8 * sum(a + b for a, b in ((H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)))
    expected = sum(n // 2 for n in WEIGHTS) + 2 * (2 * H + adapters)
    assert _line(estimate(L70B, _qlora()), Phase.BACKWARD, "one decoder layer unsharded") == expected
