"""Harness pieces that need no worker: spec serialisation, model configs, ledgers from readings, CLI."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from vramledger.catalog import resolve_model
from vramledger.catalog.config_of import config_from_spec
from vramledger.catalog.hfconfig import model_spec_from_config
from vramledger.cli import main
from vramledger.errors import VramledgerError
from vramledger.ledger import Category, Phase
from vramledger.measure.harness import TrialResult, cuda_available, ledger_from_result
from vramledger.measure.modelcfg import hf_config_for
from vramledger.measure.serial import train_from_dict, train_to_dict
from vramledger.specs import (
    Attention,
    CacheKind,
    LoadPath,
    LoraSpec,
    Method,
    Optimizer,
    Precision,
    QuantSpec,
    TrainSpec,
)

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "train",
    [
        TrainSpec(),
        TrainSpec(method=Method.FULL, precision=Precision.BF16, optimizer=Optimizer.ADAFACTOR, grad_ckpt=True),
        TrainSpec(method=Method.QLORA, quant=QuantSpec(bits=8), lora=LoraSpec(rank=8, targets=("q_proj", "v_proj"))),
        TrainSpec(
            attn=Attention.EAGER,
            eval_batch=4,
            eval_seq_len=512,
            predict_with_generate=True,
            generation_max_new_tokens=64,
            grad_accum=4,
        ),
        TrainSpec(
            method=Method.QLORA,
            lora=LoraSpec(rank=8, targets=("all", "lm_head"), modules_to_save=("embed_tokens",)),
            generation_cache=CacheKind.LEGACY,
            load_path=LoadPath.TORCHTUNE,
            optimizer_in_backward=True,
            offload_activations=True,
        ),
    ],
    ids=["default", "full-bf16-true", "qlora-int8", "eval-generate", "loop-features"],
)
def test_train_spec_survives_json(train: TrainSpec) -> None:
    import json

    assert train_from_dict(json.loads(json.dumps(train_to_dict(train)))) == train


def test_unknown_train_field_is_an_error() -> None:
    with pytest.raises(VramledgerError, match="unknown field"):
        train_from_dict({"micro_batch": 1, "batchsize": 2})


def test_config_rebuilt_from_a_spec_reads_back_to_the_same_spec() -> None:
    # catalog.hfconfig is the independent parser: what we write must parse back to the same architecture.
    spec = resolve_model("llama-3-8b")
    again = model_spec_from_config(config_from_spec(spec), name=spec.name, source=spec.source)
    assert replace(again, native_dtype=spec.native_dtype, max_position_embeddings=spec.max_position_embeddings) == spec


def test_catalog_models_use_their_verbatim_config() -> None:
    cfg = hf_config_for(resolve_model("llama-3-8b"))
    assert cfg["rope_theta"] == 500000.0 and "architectures" not in cfg  # verbatim, less checkpoint keys


def test_config_file_models_use_the_file(tiny_model) -> None:  # type: ignore[no-untyped-def]
    assert hf_config_for(tiny_model)["intermediate_size"] == 128


def _raw(context: int | None) -> dict:
    # Hand-made readings (GiB): weights 16, optimizer states 1, gradients 0.5.
    ph = {
        "load": {"allocated": 16 * GIB, "reserved": 17 * GIB, "device": None, "context": context},
        "forward": {"allocated": 30 * GIB, "reserved": 33 * GIB, "device": None, "context": context},
        "backward": {"allocated": 32 * GIB, "reserved": 34 * GIB, "device": None, "context": context},
        "optimizer": {"allocated": 18 * GIB, "reserved": 34 * GIB, "device": None, "context": context},
    }
    return {
        "status": "ok",
        "phases": ph,
        "steps": [{}, {}, {}],
        "weights_bytes": 16 * GIB,
        "optimizer_state_bytes": GIB,
        "gradients_bytes": GIB // 2,
        "params": 8 * 10**9,
        "trainable_params": 4 * 10**7,
        "counters": {"num_alloc_retries": 2, "num_ooms": 0},
        "environment": {"gpu": "NVIDIA H100 80GB HBM3"},
    }


def test_ledger_from_readings_by_hand() -> None:
    res = TrialResult(status="ok", raw=MappingProxyType(_raw(context=GIB // 2)))
    ledger = ledger_from_result(res, resolve_model("llama-3-8b"), TrainSpec())
    assert ledger.engine == "measure"
    assert ledger.allocated(Phase.BACKWARD) == 32 * GIB
    assert ledger.reserved(Phase.FORWARD) == 33 * GIB
    assert ledger.device(Phase.BACKWARD) == 34 * GIB + GIB // 2
    assert ledger.peak_allocated == 32 * GIB and ledger.peak_reserved == 34 * GIB
    # Forward: 30 = 16 weights + 1 optimizer state + 13 rest.
    assert ledger.bytes_of(Category.OPTIMIZER_STATE, Phase.FORWARD) == GIB
    assert ledger.bytes_of(Category.ACTIVATIONS, Phase.FORWARD) == 13 * GIB
    # Optimizer: 18 = 16 + 1 + 0.5 gradients + 0.5 temporaries.
    assert ledger.bytes_of(Category.GRADIENTS, Phase.OPTIMIZER) == GIB // 2
    assert ledger.bytes_of(Category.TEMPORARIES, Phase.OPTIMIZER) == GIB // 2
    assert any("retried 2 time" in w for w in ledger.warnings)


def test_ledger_without_nvml_has_no_context_line() -> None:
    ledger = ledger_from_result(TrialResult(status="ok", raw=_raw(context=None)), resolve_model("gpt2"), TrainSpec())
    assert Category.CUDA_CONTEXT not in ledger.categories()
    assert ledger.device_total == ledger.peak_reserved


def test_failed_trial_has_no_ledger() -> None:
    with pytest.raises(VramledgerError, match="trial did not run \\(oom\\)"):
        ledger_from_result(TrialResult(status="oom", error="boom"), resolve_model("gpt2"), TrainSpec())


@pytest.mark.skipif(cuda_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize(
    "argv",
    [["measure", "llama-3-8b"], ["find-max", "llama-3-8b", "--dim", "seq"]],
    ids=["measure", "find-max"],
)
def test_commands_without_a_gpu_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith(f"error: {argv[0]} needs a CUDA GPU")


def test_suite_covers_what_the_issue_asks() -> None:
    spec = importlib.util.spec_from_file_location("run_suite", ROOT / "bench" / "accuracy" / "run_suite.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["run_suite"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    suite = mod.load_suite()
    configs = suite["configs"]
    trains = [mod.train_spec(c) for c in configs]  # every config builds a valid TrainSpec
    assert len(configs) >= 30
    assert len({suite["models"][c["model"]]["family"] for c in configs}) >= 4
    assert {t.method for t in trains} >= {Method.FULL, Method.LORA, Method.QLORA}
    assert {t.grad_ckpt for t in trains} == {True, False}
    assert {t.attn for t in trains} >= {Attention.SDPA, Attention.EAGER}
    assert min(t.seq_len for t in trains) == 512 and max(t.seq_len for t in trains) >= 16384
    assert min(t.micro_batch for t in trains) == 1 and max(t.micro_batch for t in trains) == 16
    assert any(t.eval_batch for t in trains) and any(t.predict_with_generate for t in trains)
