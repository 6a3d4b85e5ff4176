"""TRL's ``chunked_nll`` in evaluation (analytic/evaluation.py, module docstring): what the HF Trainer's
``prediction_step`` holds and keeps when SFTTrainer's patched forward computes the loss.

``_patch_chunked_ce_lm_head`` and ``_ChunkedCELMHeadOutput`` are copied below, verbatim, from trl f2cd577
``trl/trainer/sft_trainer.py`` (l. 89-97 and 237-378); ``_chunked_cross_entropy_loss`` and ``_chunk`` come from
tests/analytic/test_trl_chunked_nll.py (verbatim there). The patched forward runs on a tiny transformers Llama under
``torch.no_grad()``, as ``prediction_step`` calls it (with labels), and the Trainer's own ``EvalLoopContainer``
keeps what ``prediction_step`` returns; the loss alone runs through vramledger's trace recorder, and both are
compared with the eval model."""

# ruff: noqa: E501, SIM108 (TRL's lines, verbatim)

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed.tensor
import transformers
from packaging.version import Version
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from tests.analytic.test_trl_chunked_nll import CASES, WIDE, M, _chunked_cross_entropy_loss, _peak_live_bytes
from vramledger.analytic import estimate
from vramledger.analytic.evaluation import eval_shape
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.ledger import Category, Phase
from vramledger.specs import EvalLogits, Loss, ModelSpec, TrainSpec


# fmt: off
# trl f2cd577 trl/trainer/sft_trainer.py l. 89-97, verbatim.
@dataclass
class _ChunkedCELMHeadOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` with extra fields populated by the chunked-CE path."""

    num_correct_tokens: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    num_valid_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None



# trl f2cd577 trl/trainer/sft_trainer.py l. 237-378, verbatim.
def _patch_chunked_ce_lm_head(model: torch.nn.Module, chunk_size: int, is_vlm: bool = False) -> None:
    """
    Patch `model.forward` to compute the LM loss via [`_chunked_cross_entropy_loss`].

    When `labels` (or pre-shifted `shift_labels`, for CP/SP) are provided, the patched forward runs the decoder up to
    `last_hidden_state` (skipping the `lm_head` matmul), drops `labels == -100` positions, and computes the
    cross-entropy in chunks of `chunk_size` valid tokens. Returns a [`_ChunkedCELMHeadOutput`] with `loss` set,
    `logits=None`, and `num_correct_tokens` / `entropy_sum` / `num_valid_tokens` over non-ignored tokens. For MoE
    models (`output_router_logits=True`), the load-balancing aux loss is added with the same coefficient and formula as
    the model's reference forward.

    Without labels, the original forward runs unchanged — generation and labels-free eval preserve any per-model logits
    post-processing (`logit_scale`, `final_logit_softcapping`, `logits_to_keep` slicing).

    Args:
        model (`torch.nn.Module`):
            Model to patch. For PEFT, pass `peft_model.get_base_model()` rather than the `PeftModel` wrapper, so
            prompt-learning variants (PromptTuning, PrefixTuning, PTuning) keep their virtual-token injection in
            `PeftModel.forward` before delegating into the patched forward.
        chunk_size (`int`):
            Number of valid tokens processed per CE chunk.
        is_vlm (`bool`):
            Set to `True` for VLMs. Only used to read `logit_scale` / `final_logit_softcapping` /
            `output_router_logits` from `model.config.text_config` instead of the top-level config.
    """
    # VLM scaling configs (`logit_scale`, `final_logit_softcapping`, MoE `output_router_logits`) live on `text_config`;
    # text-only models keep them on the top-level config.
    text_config = model.config.text_config if is_vlm else model.config
    final_logit_softcapping = getattr(text_config, "final_logit_softcapping", None)
    logit_scale = getattr(text_config, "logit_scale", 1.0)
    original_forward = model.forward
    lm_head = model.get_output_embeddings()

    def _chunked_ce_forward(
        self: torch.nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        shift_labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        # Without labels, fall back to the original forward so generation and labels-free evaluation
        # preserve any per-model logits post-processing (e.g. Cohere `logit_scale`, Gemma
        # `final_logit_softcapping`, `logits_to_keep` slicing).
        if labels is None and shift_labels is None:
            # MoE models: request router logits so the model returns `outputs.aux_loss`. VLM wrappers honor this only
            # as a forward kwarg (not from the model config), so it must be passed here.
            if output_router_logits is not None:
                kwargs["output_router_logits"] = output_router_logits
            return original_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

        if output_router_logits is None:
            output_router_logits = getattr(text_config, "output_router_logits", False)

        kwargs.pop("use_cache", None)
        decoder_kwargs = {}
        # MoE models: request router logits so the model returns `outputs.aux_loss`. VLM wrappers honor this only
        # as a forward kwarg (not from the model config), so it must be passed here.
        if output_router_logits:
            decoder_kwargs["output_router_logits"] = True
        # `base_model` gives the backbone model (skipping `lm_head`) — text decoder for LMs, multimodal wrapper
        # for VLMs (so vision-token injection runs before the text decoder). `get_decoder()` won't do: on VLMs it
        # returns just the text stack and feeds image-placeholder IDs through it.
        # Pre-5.0 transformers VLMs set `base_model_prefix = ""` so `self.base_model is self` (re-runs `lm_head`).
        # Fall back to `self.model` there.
        if is_vlm and Version(transformers.__version__) < Version("5.0.0"):
            backbone = self.model
        else:
            backbone = self.base_model
        outputs: BaseModelOutputWithPast = backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **decoder_kwargs, **kwargs
        )
        hidden_states = outputs.last_hidden_state

        lm_head_weight = lm_head.weight
        lm_head_bias = lm_head.bias
        # Under FSDP2, lm_head.weight is a DTensor (Shard(0) or Replicate). Passing it directly
        # into the gradient-checkpointed chunk loop causes FSDP2 to re-gather it once per chunk
        # during backward recomputation. full_tensor() converts it to a plain tensor once; all
        # chunks reference that tensor, so only one all-gather occurs (in full_tensor()'s backward).
        if isinstance(lm_head_weight, torch.distributed.tensor.DTensor):
            lm_head_weight = lm_head_weight.full_tensor()
            if lm_head_bias is not None:
                lm_head_bias = lm_head_bias.full_tensor()
        loss, num_correct_tokens, entropy_sum, num_valid_tokens = _chunked_cross_entropy_loss(
            hidden_states,
            lm_head_weight,
            chunk_size,
            labels=labels,
            shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch,
            logit_scale=logit_scale,
            final_logit_softcapping=final_logit_softcapping,
            lm_head_bias=lm_head_bias,
        )

        aux_loss = None
        if output_router_logits:
            # Mirror the per-family MoE forward: add `router_aux_loss_coef * load_balancing_loss_func(...)` to
            # the main loss. Mixtral is the source of truth — every MoE family (Qwen3Moe, GptOss, OLMoE,
            # Qwen2Moe, DBRX, JetMoE, PhiMoE, …) pulls this function from mixtral via the modular system, so a
            # single import keeps us in lockstep with upstream for every family we test.
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            if Version(transformers.__version__) < Version("5.0.0") and not is_vlm:
                num_experts = self.num_experts
                num_experts_per_tok = self.num_experts_per_tok
                router_aux_loss_coef = self.router_aux_loss_coef
            else:
                # Upstream bug AttributeError: 'GptOssConfig' object has no attribute 'num_experts'; see #5754
                if text_config.model_type == "gpt_oss" and Version("5.0.0") <= Version(
                    transformers.__version__
                ) < Version("5.6.0"):
                    num_experts = self.num_experts
                else:
                    num_experts = text_config.num_experts
                num_experts_per_tok = text_config.num_experts_per_tok
                router_aux_loss_coef = text_config.router_aux_loss_coef
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, num_experts, num_experts_per_tok, attention_mask
            )
            loss = loss + router_aux_loss_coef * aux_loss.to(loss.device)

        return _ChunkedCELMHeadOutput(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            num_correct_tokens=num_correct_tokens,
            entropy_sum=entropy_sum,
            num_valid_tokens=num_valid_tokens,
            aux_loss=aux_loss,
        )

    # Keep the original forward signature so `generate`'s `_validate_model_kwargs` still sees the
    # model's real inputs (e.g. VLM `pixel_values`, `spatial_shapes`) and doesn't reject them. The
    # unbound `__func__` signature makes `MethodType`'s `self`-stripping land correctly.
    _chunked_ce_forward.__signature__ = inspect.signature(original_forward.__func__)
    model.forward = types.MethodType(_chunked_ce_forward, model)

# fmt: on


# -- the loss under no_grad: one chunk at a time, as in training's forward ----------------------------------------
def _eval_loss_line(m: ModelSpec, train: TrainSpec) -> int:
    """The eval phase's loss line of ``estimate`` (eval batch = the training batch, same length)."""
    ledger = estimate(m, replace(train, eval_batch=train.micro_batch))
    lines = [i for i in ledger.items if i.phase is Phase.EVAL and i.label.startswith("eval loss: one chunk")]
    assert len(lines) == 1, "the eval peak should be the loss moment for this wide-vocabulary model"
    return lines[0].bytes


# At hidden size 1024 the head's copies decide the loss moment (bf16 heads); with an fp32 head, or two sequences, the
# top decoder layer's working set is the eval peak there, and the ledger holds no loss line to compare.
EVAL_CASES = {
    f"{k}-H{m.hidden_size}": (CASES[k], m)
    for k in ("lora-bf16-true", "lora-bf16-mixed-fp32-base", "lora-fp32", "lora-bf16-mixed-B2")
    for m in ((M, WIDE) if k in ("lora-bf16-true", "lora-bf16-mixed-fp32-base") else (M,))
}


@pytest.mark.parametrize(("train", "m"), EVAL_CASES.values(), ids=EVAL_CASES.keys())
def test_eval_loss_line_matches_the_no_grad_trace(train: TrainSpec, m: ModelSpec) -> None:
    """``torch.utils.checkpoint`` under ``no_grad`` just runs ``_chunk``: the trace of the verbatim loss holds the
    sorted hidden states and one chunk's matmul or loss tensors, never the B·L·V logits of the standard loss."""
    traced = _peak_live_bytes(train, m, evaluating=True)
    modelled = _eval_loss_line(m, train)
    err = modelled / traced - 1
    print(f"expected (traced) {traced:,} got {modelled:,} ({err:+.1%})")
    assert abs(err) < 0.03
    # Hand derivation, bf16-true, bf16 head: the sorted hidden states (2·H·T), then w.float() (4·V·H) beside the
    # chunk's fp32 logits (4·k·V), or the chunk's logits, log-softmax, exp and product (16·k·V).
    if train is CASES["lora-bf16-true"]:
        H, V, k, T = m.hidden_size, m.vocab_size, 256, train.tokens
        assert modelled == 2 * H * T + max(4 * V * H + 4 * H * k + 4 * k * V, 16 * k * V)


# -- what prediction_step returns and the Trainer keeps --------------------------------------------------------------
VOCAB, B, L, STEPS = 512, 2, 32, 3


def _tiny_llama() -> tuple[torch.nn.Module, ModelSpec]:
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    _patch_chunked_ce_lm_head(model, chunk_size=256)
    return model, model_spec_from_config(cfg, name="tiny-llama", source="test")


def test_prediction_step_keeps_labels_and_three_scalars_not_logits() -> None:
    """Run the patched forward as ``prediction_step`` does (trainer.py l. 3239-3268: labels given, ``no_grad``,
    ``logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"])``), then keep each batch in
    the Trainer's ``EvalLoopContainer`` (evaluation_loop l. 3010-3019). The model's per-batch bytes must match."""
    from transformers.trainer_pt_utils import EvalLoopContainer

    model, spec = _tiny_llama()
    ignore_keys = getattr(model.config, "keys_to_ignore_at_inference", ["past_key_values"])
    all_preds, all_labels = EvalLoopContainer(True, -100), EvalLoopContainer(True, -100)
    for _ in range(STEPS):
        inputs = {"input_ids": torch.randint(0, VOCAB, (B, L)), "use_cache": True}
        inputs["labels"] = inputs["input_ids"].clone()
        with torch.no_grad():
            outputs = model(**inputs)
        assert outputs.logits is None
        assert outputs.past_key_values is None  # use_cache=False whatever the caller asked: no KV cache
        logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"])
        all_preds.add(logits)
        all_labels.add(inputs["labels"])
    kept = sum(t.numel() * t.element_size() for t in (*all_preds.tensors, all_labels.tensors))

    train = TrainSpec(loss=Loss.CHUNKED_NLL, eval_batch=B, eval_seq_len=L, eval_logits=EvalLogits.FULL)
    sh = eval_shape(spec, train)
    print(f"expected (kept by the Trainer) {kept:,} got {STEPS * sh.kept_per_step:,}")
    assert STEPS * sh.kept_per_step == kept
    assert not sh.use_cache
    # The standard loss keeps the fp32 B·L·V logits instead: what the TRL model must no longer count.
    standard = eval_shape(spec, replace(train, loss=Loss.STANDARD))
    assert standard.kept_per_step - sh.kept_per_step == 4 * B * L * VOCAB - 16


def test_no_kv_cache_line_without_gradient_checkpointing() -> None:
    """Without gradient checkpointing the standard loss' eval forward builds a cache (config.use_cache); TRL's
    chunked forward passes use_cache=False (l. 309), as the test above checks on the real forward."""
    from vramledger.catalog import resolve_model

    m = resolve_model("llama-3.2-1b")
    train = TrainSpec(loss=Loss.CHUNKED_NLL, eval_batch=8, seq_len=1024, grad_ckpt=False)
    trl = estimate(m, train).bytes_of(Category.KV_CACHE, Phase.EVAL)
    std = estimate(m, replace(train, loss=Loss.STANDARD)).bytes_of(Category.KV_CACHE, Phase.EVAL)
    print(f"KV cache: chunked_nll {trl:,}, standard {std:,}")
    assert trl == 0 < std
