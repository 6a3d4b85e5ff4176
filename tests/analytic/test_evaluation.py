"""The eval and generate phases: KV-cache bytes per attention variant (hand derivations), the Trainer's
accumulation of eval predictions (as written in transformers 5.23 trainer.py), and the advice when evaluation
is the peak."""

from __future__ import annotations

from dataclasses import replace

from vramledger.analytic import estimate
from vramledger.analytic.evaluation import kv_cache_bytes
from vramledger.catalog import resolve_gpu, resolve_model
from vramledger.ledger import Category, Phase
from vramledger.specs import EvalLogits, Method, Precision, TrainSpec

GiB = 2**30


# -- KV cache: hand derivations, one per attention variant --------------------------------------------------------
def test_kv_mha_llama2_7b_outweighs_the_model() -> None:
    # Llama-2-7B: 32 layers, 32 KV heads (MHA) × 128; bf16. K and V: 2 × 32 × 32 × 128 × 2 B = 524,288 B per token.
    # Batch 8 × 4096 tokens (the prompt fills the cache; N = 1 adds nothing: S = P + N − 1).
    want = 2 * 32 * 32 * 128 * 2 * 8 * 4096
    assert want == 16 * GiB
    got = kv_cache_bytes(resolve_model("llama-2-7b"), batch=8, prompt=4096, new_tokens=1, dtype_bytes=2).at_end
    print(f"MHA: expected {want}, got {got}")
    assert got == want
    assert got > 6_738_415_616 * 2  # more than the bf16 weights (published 6.74 B parameters)


def test_kv_gqa_llama3_8b() -> None:
    # 8 KV heads instead of 32: a quarter of MHA. Batch 4, prompt 1000, 25 new tokens: S = 1024 cached tokens.
    want = 2 * 32 * 8 * 128 * 2 * 4 * 1024
    got = kv_cache_bytes(resolve_model("llama-3-8b"), batch=4, prompt=1000, new_tokens=25, dtype_bytes=2)
    print(f"GQA: expected {want}, got {got.at_end}")
    assert got.at_end == want == 512 * 2**20
    # Right after the prefill, the cache holds the prompt only.
    assert got.after_prefill == 2 * 32 * 8 * 128 * 2 * 4 * 1000


def test_kv_mqa_with_sliding_layers_gemma3_1b() -> None:
    # Gemma-3-1B: 26 layers, 1 KV head (MQA) × 256; every 6th layer global (26 // 6 = 4), 22 sliding, W = 512.
    # Batch 4, prompt 2048, 257 new tokens: S = 2304. Full layers hold 2304 tokens, sliding ones
    # min(2304, 512) = 512 (cache_utils DynamicSlidingWindowLayer: view of a W-token concatenation).
    per_token_layer = 2 * 1 * 256 * 2 * 4  # K+V, one head, 256 dims, bf16, batch 4 = 4096 B
    want = (4 * 2304 + 22 * 512) * per_token_layer
    got = kv_cache_bytes(resolve_model("gemma-3-1b"), batch=4, prompt=2048, new_tokens=257, dtype_bytes=2).at_end
    print(f"MQA + sliding: expected {want}, got {got}")
    assert got == want == 80 * 2**20


def test_kv_sliding_window_mistral_v01_prefill_dominates() -> None:
    # Mistral-7B-v0.1: 32 layers, all sliding with W = 4096, 8 KV heads × 128. Prompt 8192 > W: after the prefill
    # every layer still holds the 8192-token concatenation (its last W−1 tokens are a view of it); after the
    # first decode step only W tokens' storage remains.
    per_token = 2 * 8 * 128 * 2 * 8  # batch 8: 32,768 B per token per layer
    c = kv_cache_bytes(resolve_model("mistral-7b-v0.1"), batch=8, prompt=8192, new_tokens=512, dtype_bytes=2)
    assert c.after_prefill == 32 * 8192 * per_token == 8 * GiB
    assert c.at_end == 32 * 4096 * per_token == 4 * GiB
    assert c.peak == 8 * GiB


def test_static_cache_preallocates_max_length() -> None:
    # StaticLayer: max_cache_len = max_length − 1 = P + N − 1 from the start (generation/utils.py l. 2961).
    m = resolve_model("llama-3-8b")
    c = kv_cache_bytes(m, batch=2, prompt=100, new_tokens=925, dtype_bytes=2, static=True)
    assert c.after_prefill == c.at_end == 2 * 32 * 8 * 128 * 2 * 2 * 1024


# -- the Trainer's accumulation of eval predictions ---------------------------------------------------------------
M = resolve_model("qwen2.5-0.5b")  # V = 151,936: predictions dominate quickly
BASE = TrainSpec(
    method=Method.LORA,
    precision=Precision.BF16_MIXED,
    micro_batch=1,
    seq_len=512,
    grad_ckpt=True,
    eval_batch=4,
    eval_seq_len=512,
)
# Per eval batch, evaluation_loop (trainer.py l. 3010-3019) keeps the logits, which accelerate's
# convert_outputs_to_fp32 made fp32 under AMP (accelerator.py l. 1824-1835): 4·B·L·V bytes, plus int64 labels.
PER_BATCH = 4 * 4 * 512 * 151_936 + 8 * 4 * 512


def _kept(train: TrainSpec) -> int:
    return estimate(M, train).bytes_of(Category.LOGITS_LOSS, Phase.EVAL)


def test_predictions_stay_on_gpu_without_eval_accumulation_steps() -> None:
    # Without eval_accumulation_steps nothing moves to the CPU until get_arrays() after the loop (l. 3050-3053).
    # At the k-th batch, EvalLoopContainer.add → torch_pad_and_concatenate (trainer_pt_utils.py l. 80-95) holds
    # the k−1 kept batches, the new one and their concatenation: (k−1 + 1 + k)·per = 2k·per.
    for k in (10, 11, 40):
        t = replace(BASE, eval_logits=EvalLogits.FULL, eval_steps_total=k)
        assert _kept(t) == 2 * k * PER_BATCH, k
    grow = _kept(replace(BASE, eval_logits=EvalLogits.FULL, eval_steps_total=41)) - _kept(
        replace(BASE, eval_logits=EvalLogits.FULL, eval_steps_total=40)
    )
    assert grow == 2 * PER_BATCH  # linear growth with the number of eval batches


def test_eval_accumulation_steps_caps_the_growth() -> None:
    # With eval_accumulation_steps = n, (step + 1) % n == 0 moves everything to the CPU (l. 3038-3045): at most
    # n batches are on the GPU, however long the eval set.
    t = replace(BASE, eval_logits=EvalLogits.FULL, eval_steps_total=40, eval_accumulation_steps=3)
    assert _kept(t) == 2 * 3 * PER_BATCH
    # n = 1: the first add() stores the batch without concatenating (EvalLoopContainer.add, l. 373-374), so only
    # the loss moment remains: nothing kept from earlier batches.
    one = estimate(M, replace(t, eval_accumulation_steps=1))
    assert not any("kept" in i.label for i in one.items if i.phase is Phase.EVAL)


def test_prediction_loss_only_keeps_nothing() -> None:
    # evaluate() passes prediction_loss_only=True without compute_metrics (l. 2867-2868); prediction_step then
    # returns (loss, None, None) (l. 3285-3286): the number of eval batches does not matter.
    a = estimate(M, replace(BASE, eval_steps_total=10))
    b = estimate(M, replace(BASE, eval_steps_total=1000))
    assert a.allocated(Phase.EVAL) == b.allocated(Phase.EVAL)


def test_argmax_preprocessing_keeps_token_ids() -> None:
    # preprocess_logits_for_metrics (l. 3011-3012) runs before add(): LLaMA-Factory's eval_logit_processor returns
    # torch.argmax(logits, -1), int64 B·L, kept with the int64 labels: 16·B·L bytes per batch.
    t = replace(BASE, eval_logits=EvalLogits.ARGMAX, eval_steps_total=100)
    kept = [i for i in estimate(M, t).items if i.phase is Phase.EVAL and "kept from" in i.label]
    assert kept and kept[0].bytes == 99 * 16 * 4 * 512


# -- the verdict covers the run ---------------------------------------------------------------------------------
def test_llamafactory_default_eval_batch_8_is_flagged() -> None:
    # LLaMA-Factory with an eval set and no per_device_eval_batch_size: HF TrainingArguments' default 8;
    # gradient checkpointing on (its default), LoRA on Llama-3.1-8B, batch 1 × 2048. Training fits a 24 GB card,
    # the eval forward at batch 8 materialises 8 × 2048 × 128,256 logits (bf16, fp32 copy, log-softmax ≈ 19.6 GiB).
    m = resolve_model("llama-3.1-8b")
    t = TrainSpec(method=Method.LORA, micro_batch=1, seq_len=2048, grad_ckpt=True, eval_batch=8)
    gpu = resolve_gpu("rtx-4090")
    ledger = estimate(m, t, gpu=gpu)
    assert ledger.peak_phase is Phase.EVAL
    train_peak = max(ledger.device(p) for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
    assert train_peak <= ledger.verdict.usable_bytes < ledger.device_total  # training fits, evaluation does not
    assert ledger.bytes_of(Category.LOGITS_LOSS, Phase.EVAL) == (2 + 4 + 4) * 128_256 * 8 * 2048
    print(ledger.advice)
    assert ledger.advice.startswith("Evaluation is the peak")
    assert "per_device_eval_batch_size" in ledger.advice
    fixed = estimate(m, replace(t, eval_batch=1), gpu=gpu)
    assert fixed.verdict.fits


def test_no_eval_no_eval_phase() -> None:
    ledger = estimate(resolve_model("llama-3.1-8b"), TrainSpec(method=Method.LORA))
    assert Phase.EVAL not in ledger.phases and Phase.GENERATE not in ledger.phases
    assert not ledger.advice.startswith("Evaluation")


def test_predict_with_generate_adds_the_cache() -> None:
    m = resolve_model("llama-3.1-8b")
    t = TrainSpec(
        method=Method.LORA,
        grad_ckpt=True,
        eval_batch=8,
        eval_seq_len=1024,
        predict_with_generate=True,
        generation_max_new_tokens=1025,
    )
    ledger = estimate(m, t)
    # At the end of generation: 8 × (1024 + 1025 − 1) = 8 × 2048 tokens, GQA 8 × 128, bf16 K and V, 32 layers.
    assert ledger.bytes_of(Category.KV_CACHE, Phase.GENERATE) == 2 * 32 * 8 * 128 * 2 * 8 * 2048
    unknown = estimate(m, replace(t, generation_max_new_tokens=0))
    assert any("--max-new-tokens" in w for w in unknown.warnings)
