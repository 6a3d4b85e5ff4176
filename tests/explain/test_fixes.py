"""Fixes in the user's keys: for the HF Trainer, keys that ``TrainingArguments`` accepts and that the HF adapter
reads back to the changed setup."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vramledger.explain.fixes import changed_keys, training_arguments_fields
from vramledger.specs import LoraSpec, Method, TrainSpec


def test_hf_keys_are_training_arguments_that_read_back(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from vramledger.adapters import hf
    from vramledger.adapters._base import Reader

    before = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=16), micro_batch=4, grad_accum=1, grad_ckpt=False)
    after = dataclasses.replace(before, micro_batch=2, grad_accum=2, grad_ckpt=True, lora=LoraSpec(rank=8))
    keys = changed_keys("meta-llama/Llama-3.2-1B", before, after, "hf", training_arguments_fields())
    print(keys)
    assert keys and set(keys) <= (training_arguments_fields() or set())  # the LoRA rank has no TrainingArguments key
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **keys)  # type: ignore[arg-type]
    r = Reader(args.to_dict(), framework="transformers", source="test")
    hf.read_trainer(r)
    assert (r.fields["micro_batch"], r.fields["grad_accum"], r.fields["grad_ckpt"]) == (2, 2, True)


def test_no_keys_for_a_format_without_a_writer() -> None:
    t = TrainSpec()
    assert changed_keys("m", t, dataclasses.replace(t, micro_batch=2), "lightning") == {}
