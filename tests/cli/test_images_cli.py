"""``--images``/``--image-size``/``--freeze-vision-tower`` on the command line, and the same read from a LLaMA-Factory
config (``image_max_pixels``, ``freeze_vision_tower``, ``cutoff_len`` counting image tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.cli import main

# LLaMA-Factory examples/train_lora/qwen2_5vl_lora_sft.yaml (hiyouga/LLaMA-Factory), its memory keys as published.
LF_QWEN25_VL = """\
model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct
image_max_pixels: 262144
video_max_pixels: 16384
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: mllm_demo,identity,alpaca_en_demo
template: qwen2_vl
cutoff_len: 2048
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
bf16: true
"""


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--images", "1", "--image-size", "1024"], "WIDTHxHEIGHT"),
        (["--images", "1", "--image-size", "0x768"], "WIDTHxHEIGHT"),
        (["--images", "-1"], "--images"),
    ],
    ids=["no-height", "zero-width", "negative-count"],
)
def test_bad_image_flags_say_which_and_how(capsys, argv: list[str], says: str) -> None:
    code, _, err = run(capsys, "estimate", "qwen2.5-vl-7b", *argv)
    assert code == 2 and err.startswith("error: ") and says in err, err


def test_images_on_a_text_model_say_so(capsys) -> None:
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--images", "1")
    assert code == 2 and "no vision tower" in err and err.count("\n") == 1, err


def test_the_flags_reach_the_ledger(capsys) -> None:
    code, out, _ = run(capsys, "estimate", "qwen2.5-vl-7b", "--seq", "512", "--images", "2", "--image-size",
                       "640x480", "--preset", "hf", "--freeze-vision-tower", "--json")  # fmt: skip
    assert code == 0
    images = json.loads(out)["settings"]["images"]
    # smart_resize(480, 640): round(480/28)·28 = 476, round(640/28)·28 = 644 → 34×46 patches, 391 tokens each.
    assert images == {"per_sample": 2, "size": [640, 480], "processed": [644, 476], "patches": 34 * 46,
                      "tokens": 391, "text_seq_len": 512}  # fmt: skip


def test_llamafactory_config_images(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "qwen2_5vl_lora_sft.yaml"
    cfg.write_text(LF_QWEN25_VL)
    code, out, err = run(capsys, "estimate", "--config", cfg, "--json")
    assert code == 0, err
    ledger = json.loads(out)
    images = ledger["settings"]["images"]
    # The dataset's images per sample are not in the config: one assumed, said so. An image at least
    # image_max_pixels (512²) → 512×512 → smart_resize 504×504 → 36×36 patches, 324 tokens, inside cutoff_len.
    assert images["per_sample"] == 1 and images["processed"] == [504, 504] and images["tokens"] == 324
    assert images["text_seq_len"] == 2048 - 324
    warnings = " ".join(ledger["warnings"])
    assert "how many a sample holds is the dataset's" in warnings
    # freeze_vision_tower (default true): PEFT's adapters stay out of the tower: rank 8 on the 7 projections of
    # the 28 decoder layers only: r·(in + out) for q and o (3584 → 3584), k and v (3584 → 512), gate, up and down
    # (3584 ↔ 18944).
    assert ledger["trainable_params"] == 8 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944)) * 28
    code, out, _ = run(capsys, "estimate", "--config", cfg, "--images", "0", "--json")
    assert code == 0 and "images" not in json.loads(out)["settings"]
