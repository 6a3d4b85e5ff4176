"""Step 2's forward spilling past step 1's forward segments into the logits chain (LoRA without checkpointing, SDPA;
analytic/reserve/forward_cache.py ``second_forward_spill``, ``spilled_chain_blocks``).

Truths used: bench/reserve/replay_causes.jsonl (``python bench/reserve/run_grid.py --causes ID``): the segments step
2 makes in the caching-allocator replay of the traced step (two training steps of the real transformers/PEFT code on
fake tensors, replayed through ``allocator/model.py``). The estimate's count of fp32 logits blocks made again comes
from the layer sequence replayed twice (forward_cache.py), never from these records.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.analytic.test_reserve import _run_grid, _specs
from vramledger.analytic import estimate
from vramledger.analytic.reserve.forward_cache import spilled_chain_blocks
from vramledger.analytic.reserve.runs import on_at
from vramledger.analytic.step import step_parts
from vramledger.catalog import resolve_model
from vramledger.ledger import Phase
from vramledger.specs import Method, ModelSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[2]
CAUSES = ROOT / "bench" / "reserve" / "replay_causes.jsonl"
# Configs whose replay makes a block the estimate does not count, with why.
UNCOUNTED = {
    "phi-3-mini-4k/lora/b4/L1024/nockpt/sdpa": (
        "Phi-3's fused qkv_proj and gate_up_proj: the sequence leaves out how long their views keep the fused outputs "
        "(forward_cache.py), and replays a spill of 153 MiB where the trace keeps 400 MiB of step 2's activations in "
        "the chain (208 in the 251 MiB logits block, 192 in an fp32 one); the estimate is −1.6% of the replay"
    ),
}


def _lora_sdpa_records() -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in CAUSES.read_text().splitlines()]
    rows = {_run_grid().config_id(r): r for r in _run_grid().GRID}
    return [
        r for r in recs if (row := rows.get(r["id"])) and row.method == "lora" and not row.ckpt and row.attn == "sdpa"
    ]


def _fp32_blocks_made_in_step_2(rec: dict[str, Any], m: ModelSpec, train: TrainSpec) -> int:
    F = 4 * m.vocab_size * train.tokens
    made = rec["made_in_step_2"]
    return sum(1 for x in made if "(logits_loss)" in x["made_by"] and abs(x["bytes"] - F) < 2**21)


@pytest.mark.parametrize("rec", _lora_sdpa_records(), ids=lambda r: r["id"])
def test_fp32_blocks_made_again_as_the_trace_makes_them(rec: dict[str, Any]) -> None:
    """Every LoRA config without checkpointing, with SDPA, whose replay is recorded: the fp32 logits blocks step 2
    makes are the one the backward workspace costs where it takes one (workspace.py, ``on_at``) and those step 2's
    forward spills into (Llama-3-8B 2 × 2048: one; Mistral-7B 4 × 1024: two; none for the smaller models)."""
    m, train = _specs(rec["id"])
    train = dataclasses.replace(train, packing=True)  # the traced batch has no mask
    p = step_parts(m, train)
    F = 4 * m.vocab_size * train.tokens
    lost = on_at(m, train, p).workspace
    counted = int(lost) + spilled_chain_blocks(m, train, p, workspace_lost=lost) // F
    traced = _fp32_blocks_made_in_step_2(rec, m, train)
    print(f"{rec['id']}: the replay makes {traced} fp32 blocks again, the estimate counts {counted}")
    if rec["id"] in UNCOUNTED:
        assert counted != traced, "now counted: take it out of UNCOUNTED"
        pytest.xfail(UNCOUNTED[rec["id"]])
    assert counted == traced


def _reserved(m: ModelSpec, train: TrainSpec) -> int:
    led = estimate(m, train)
    return max(led.reserved(p) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))


@settings(max_examples=40, deadline=None)
@example(model="llama-3-8b", b=1, ell=2048, db=1, dl=0)  # b = 1 has no mask: the spill counted whole there
@example(model="mistral-7b-v0.3", b=1, ell=1024, db=3, dl=0)
@given(
    model=st.sampled_from(["llama-3-8b", "mistral-7b-v0.3", "qwen2.5-7b"]),
    b=st.integers(1, 8),
    ell=st.integers(1, 4096),
    db=st.integers(0, 3),
    dl=st.integers(0, 600),
)
def test_padded_reserved_never_falls_and_holds_the_packed_one(model: str, b: int, ell: int, db: int, dl: int) -> None:
    """The spill's blocks grow with T (a per-token figure × T); a padded batch counts them less its mask's bytes, the
    larger of the masked step's reserve and that of the batch of full rows, which drops the mask: the padded run's
    estimate never falls as the micro-batch or the length grows, and is never under the packed run's."""
    m = resolve_model(model)
    train = TrainSpec(method=Method.LORA, micro_batch=b, seq_len=ell, grad_ckpt=False)
    more = dataclasses.replace(train, micro_batch=b + db, seq_len=ell + dl)
    assert _reserved(m, more) >= _reserved(m, train)
    assert _reserved(m, dataclasses.replace(train, packing=True)) <= _reserved(m, train)
