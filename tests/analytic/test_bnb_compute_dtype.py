"""``bnb_4bit_compute_dtype`` apart from the load dtype: the dequantised weight and its cast, both alive.

bitsandbytes ``Linear4bit.forward`` runs ``x = x.to(self.compute_dtype)`` and ``MatMul4Bit.forward``
``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)``: ``dequantize_4bit`` returns the
quantisation state's dtype (the dtype the weight was loaded in), and ``.to`` makes the compute dtype's copy beside
it. ``BitsAndBytesConfig`` defaults the compute dtype to float32 (transformers ``utils/quantization_config.py``).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from vramledger.analytic.inference import InferSpec, infer_ledger
from vramledger.analytic.litgpt_qlora import dequant_transient_bytes
from vramledger.catalog import resolve_model
from vramledger.cli import main
from vramledger.integrations.predict import _quant
from vramledger.ledger import Category, Phase
from vramledger.specs import Attention, CacheKind, DType, ModelCode, QuantSpec

# StarCoder's MLP c_fc, the largest quantised weight of a layer: n_embd 6144 → n_inner 24576.
C_FC = 6144 * 24576


def test_fp32_compute_over_an_fp16_load_keeps_both_copies() -> None:
    assert dequant_transient_bytes(C_FC, DType.FP16, ModelCode.TRANSFORMERS, DType.FP32) == C_FC * (2 + 4)
    # The load dtype itself (what LLaMA-Factory, axolotl and TRL pass): the cast is a no-op.
    assert dequant_transient_bytes(C_FC, DType.FP16, ModelCode.TRANSFORMERS, DType.FP16) == C_FC * 2
    assert dequant_transient_bytes(C_FC, DType.BF16, ModelCode.TRANSFORMERS) == C_FC * 2


def test_generate_prefill_of_a_4bit_model_computing_in_fp32() -> None:
    """transformers' LLM tutorial (llm_tutorial_optimization.md): OctoCoder loaded with load_in_4bit and no other
    setting, 20-token prompt: peak allocated 9.54 GiB (published_memory.csv row 171). The prefill's largest
    dequantisation is c_fc's, an fp16 copy and its fp32 cast."""
    m = resolve_model("octocoder")
    quant = QuantSpec(bits=4, quant_type="fp4", double_quant=False)
    base = InferSpec(
        batch=1, prompt=20, new_tokens=60, dtype=DType.FP16, quant=quant, attn=Attention.EAGER, cache=CacheKind.LEGACY
    )
    fp32 = replace(base, quant=replace(quant, compute_dtype=DType.FP32))
    temps = [infer_ledger(m, s).bytes_of(Category.TEMPORARIES, Phase.GENERATE) for s in (base, fp32)]
    assert temps[1] - temps[0] == C_FC * 4
    peak = infer_ledger(m, fp32).allocated(Phase.GENERATE)
    assert peak == pytest.approx(9.5436 * 2**30, rel=0.03)


def test_a_live_model_says_its_compute_dtype() -> None:
    cfg = SimpleNamespace(
        model_type="llama",
        quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "float32"},
    )
    q = _quant(SimpleNamespace(config=cfg))
    assert q is not None and q.compute_dtype is DType.FP32 and not q.double_quant


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--method", "lora", "--bnb-compute-dtype", "fp32"], "only for a 4-bit base"),
        (["--quant", "int8", "--bnb-compute-dtype", "fp32"], "int8 has no compute dtype"),
        (["--method", "qlora", "--bnb-compute-dtype", "fp8"], "choose fp32, bf16 or fp16"),
    ],
)
def test_bad_compute_dtypes(capsys, argv: list[str], says: str) -> None:
    assert main(["estimate", "qwen2.5-0.5b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --bnb-compute-dtype") and err.count("\n") == 1 and says in err, err


def test_torch_names_are_taken(capsys) -> None:
    assert (
        main(["estimate", "qwen2.5-0.5b", "--method", "qlora", "--bnb-compute-dtype", "torch.float32", "--json"]) == 0
    )
    assert '"compute_dtype": "fp32"' in capsys.readouterr().out
