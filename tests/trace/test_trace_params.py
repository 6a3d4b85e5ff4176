"""Parameter counts and bytes from the trace against the independent enumeration in analytic/params.py."""

from __future__ import annotations

import pytest

from tests.trace._trace_tiny import TINY, spec
from vramledger.analytic.params import count_params, layer_linears
from vramledger.ledger import Category, Phase
from vramledger.specs import LoraSpec, Method, Precision, TrainSpec
from vramledger.trace import trace_step
from vramledger.trace.recorder import BLOCK


@pytest.mark.parametrize("name", sorted(TINY))
def test_full_bf16_weights_are_params_times_two(name: str) -> None:
    m = spec(name)
    ledger = trace_step(
        m,
        TrainSpec(method=Method.FULL, precision=Precision.BF16, micro_batch=1, seq_len=40),
        config=TINY[name],
    )
    expected = count_params(m)
    print(name, "expected params", expected, "got", ledger.params)
    assert ledger.params == expected
    assert ledger.trainable_params == expected
    weights = ledger.bytes_of(Category.WEIGHTS, Phase.LOAD)
    # Each tensor is rounded up to 512 B by the allocator; buffers (rotary inv_freq, GPT-2 has none) are
    # small.
    tensors = 2 + m.num_layers * 16
    assert 2 * expected <= weights <= 2 * expected + BLOCK * tensors + 4096


def test_tied_embeddings_stay_tied() -> None:
    m = spec("llama_tied")
    ledger = trace_step(m, TrainSpec(method=Method.FULL, micro_batch=1, seq_len=40), config=TINY["llama_tied"])
    assert ledger.params == count_params(m)  # one V x H matrix, not two (tracing.md: _apply unties them)


def test_lora_trainable_count() -> None:
    m = spec("llama")
    r = 8
    ledger = trace_step(
        m,
        TrainSpec(method=Method.LORA, micro_batch=1, seq_len=40, lora=LoraSpec(rank=r)),
        config=TINY["llama"],
    )
    # PEFT LoRA: A is r x in, B is out x r, on every linear of each layer (all-linear skips lm_head).
    per_layer = sum(r * (lin.in_features + lin.out_features) for lin in layer_linears(m))
    assert ledger.trainable_params == m.num_layers * per_layer
    assert ledger.params == count_params(m) + m.num_layers * per_layer
    # Adapters fp32 (PEFT autocast_adapter_dtype), base bf16: AdamW keeps two fp32 states per trainable param.
    assert ledger.bytes_of(Category.OPTIMIZER_STATE, Phase.OPTIMIZER) >= 2 * 4 * ledger.trainable_params


def test_freeze_trains_last_layers() -> None:
    m = spec("llama")
    ledger = trace_step(
        m,
        TrainSpec(method=Method.FREEZE, freeze_trainable_layers=1, micro_batch=1, seq_len=40),
        config=TINY["llama"],
    )
    from vramledger.analytic.params import layer_params

    assert ledger.trainable_params == layer_params(m)
