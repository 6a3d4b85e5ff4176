"""The trace names ops in the user's words (trace/opnames.py), the aten name kept in parentheses: the table, its
context rule checked against the tiny model's trace, and the wording where trace text and HTML name an op."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.trace._trace_tiny import TINY, spec
from vramledger.cli import main
from vramledger.specs import Method, TrainSpec
from vramledger.trace.api import trace_result, trace_step
from vramledger.trace.opnames import op_label

TRAIN = TrainSpec(method=Method.FULL, micro_batch=2, seq_len=40)

# Written from the upstream code named in trace/opnames.py's docstring, not from the table.
CASES = [
    ("_to_copy", "logits_loss", "forward", "base_model.model", "logits.float() in the loss (_to_copy)"),
    (
        "_to_copy",
        "logits_loss",
        "forward",
        "",
        "an fp32 copy of the logits: logits.float() in the loss or accelerate's convert_outputs_to_fp32 (_to_copy)",
    ),
    ("_to_copy", "logits_loss", "backward", "", "the backward of logits.float() in the loss (_to_copy)"),
    ("_to_copy", "logits_loss", "forward", "base_model.model.lm_head", "_to_copy"),  # autocast's input cast
    ("_to_copy", "weights", "forward", "model.layers.0.mlp", "_to_copy"),  # autocast's weight cast
    ("_to_copy", "", "", "", "_to_copy"),
    (
        "_log_softmax_backward_data",
        "logits_loss",
        "backward",
        "",
        "cross-entropy's log-softmax backward (_log_softmax_backward_data)",
    ),
    ("nll_loss_forward", "logits_loss", "forward", "", "cross-entropy's NLL loss (nll_loss_forward)"),
    ("mm", "activations", "forward", "model.layers.0.mlp.up_proj", "matmul (mm)"),
    ("addmm", "", "", "", "matmul (addmm)"),
    ("native_dropout", "activations", "forward", "", "dropout (native_dropout)"),
    (
        "_scaled_dot_product_flash_attention",
        "activations",
        "forward",
        "",
        "attention (SDPA) (_scaled_dot_product_flash_attention)",
    ),
    (
        "_scaled_dot_product_efficient_attention_backward",
        "temporaries",
        "backward",
        "",
        "attention backward (SDPA) (_scaled_dot_product_efficient_attention_backward)",
    ),
    ("empty_strided", "temporaries", "forward", "", "empty_strided"),
]


@pytest.mark.parametrize(
    ("op", "category", "phase", "module", "want"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3] or 'root'}" for c in CASES]
)
def test_table(op: str, category: str, phase: str, module: str, want: str) -> None:
    assert op_label(op, category, phase, module) == want


@given(
    st.from_regex(r"[a-z_][a-z0-9_]{0,40}", fullmatch=True),
    st.sampled_from(["", "logits_loss", "weights"]),
    st.sampled_from(["", "forward", "backward"]),
    st.sampled_from(["", "lm_head", "base_model.model"]),
)
def test_aten_name_never_lost(op: str, category: str, phase: str, module: str) -> None:
    label = op_label(op, category, phase, module)
    assert label == op or label.endswith(f" ({op})")


def _logit_copies(train: TrainSpec) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(phase, module, shape, dtype) of every ``_to_copy`` the trace classes as logits and loss, step 2."""
    result, events = trace_result(spec("llama"), train, config=TINY["llama"])
    return [
        (e.phase.value, e.module, result.storages[e.storage].shape, result.storages[e.storage].dtype)
        for e in events
        if e.kind == "alloc" and e.op == "_to_copy" and e.category == "logits_loss" and e.step == 2
    ]


def test_to_copy_context_rule_holds_on_the_trace() -> None:
    """The trace of the tiny model (batch 2 x length 40, vocabulary 1000, hidden 128) has exactly the three
    ``_to_copy`` the table tells apart: in lm_head the bf16 hidden states (autocast), two fp32 B x L x V copies
    of the logits in the forward, and one cast back in the backward. Under LoRA the loss's copy runs inside the
    causal-LM module (``base_model.model``) and accelerate's outside every module; in a full fine-tune both
    have the root's path ``""``, which is why the table names neither alone there."""
    logits = (2, 40, 1000)
    full = _logit_copies(TRAIN)
    assert sorted(full) == sorted(
        [
            ("forward", "lm_head", (2, 40, 128), "bfloat16"),
            ("forward", "", logits, "float32"),
            ("forward", "", logits, "float32"),
            ("backward", "", logits, "bfloat16"),
            ("backward", "lm_head", (2, 40, 128), "float32"),
        ]
    )
    lora = _logit_copies(TrainSpec(method=Method.LORA, micro_batch=2, seq_len=40))
    fp32_forward = sorted(m for p, m, shape, dtype in lora if p == "forward" and dtype == "float32" and shape == logits)
    assert fp32_forward == ["", "base_model.model"]
    assert op_label("_to_copy", "logits_loss", "forward", "base_model.model") == "logits.float() in the loss (_to_copy)"


def test_peak_moment_in_users_words() -> None:
    ledger = trace_step(spec("llama"), TRAIN, config=TINY["llama"])
    backward = next(v for p, v in ledger.moments.items() if p.value == "backward")
    # The backward peak of a full fine-tune with a 1000-word vocabulary: the fp32 gradient of the log-softmax
    # (B x L x V) allocated while the fp32 logits and log-probabilities are still live.
    assert backward.startswith("cross-entropy's log-softmax backward (_log_softmax_backward_data) in ")


def test_oom_point_in_users_words_in_text_json_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY["llama"]))
    # 400 MiB of context (a custom GPU) + 20 MiB: too little for this step (tests/trace/test_oom.py).
    common = [str(cfg), "--method", "full", "--batch", "2", "--seq", "40", "--gpu", "420MiB"]
    assert main(["trace", *common, "--json"]) == 3
    oom = json.loads(capsys.readouterr().out)["allocator"]["oom"]
    assert main(["trace", *common, "--html", str(tmp_path / "r.html")]) == 3
    text = capsys.readouterr().out
    label = op_label(oom["op"], oom["category"], oom["phase"], oom["module"])
    assert f"OOM at {label}" in text
    page = (tmp_path / "r.html").read_text()
    sentence = re.search(r'<div class="verdict oom">Runs out of memory at ([^<]*)</div>', page)
    assert sentence is not None, "the HTML names no OOM point"
    assert sentence.group(1).startswith(label.replace("'", "&#x27;") + f" in {oom['module'] or '(top level)'}")
    assert "<h2>Allocator replay</h2>" in page and "OOM at " in page
