"""Image tokens per image against the processors' own code, and hand derivations where a processor cannot be built
here (Llama 4's needs torchvision). The memory of the tower is checked against a trace in tests/trace."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trace._tiny_vl import TINY_QWEN2_VL, TINY_QWEN3_VL, TINY_QWEN25_VL, tiny_vl
from vramledger.analytic import estimate
from vramledger.analytic.image_tokens import image_grid, smart_resize
from vramledger.analytic.params import count_params
from vramledger.analytic.vision import image_tokens, lm_view, vision_bytes
from vramledger.analytic.vision_params import siglip_params
from vramledger.catalog import resolve_model
from vramledger.errors import VramledgerError
from vramledger.specs import TrainSpec

pytest.importorskip("transformers")


def _qwen_processor():  # type: ignore[no-untyped-def]
    # The PIL backend of Qwen2VLImageProcessor (the torchvision one needs torchvision): the same smart_resize and
    # patch arithmetic, class defaults (min_pixels 56², max_pixels 28²·1280, patch 14, merge 2).
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()


@pytest.mark.parametrize(
    ("width", "height"),
    [(1024, 768), (100, 50), (4000, 3000), (28, 28), (1001, 1001), (640, 480), (3840, 2160), (300, 7000)],
)
def test_qwen_tokens_equal_the_processor(width: int, height: int) -> None:
    proc = _qwen_processor()
    v = resolve_model("qwen2.5-vl-7b").vision
    assert v is not None
    grid = image_grid(v, TrainSpec(images=1, image_size=(width, height)))
    patches = proc.get_number_of_image_patches(height, width, {})
    print(f"{width}x{height}: expected {patches} patches / {patches // 4} tokens, got {grid.patches} / {grid.tokens}")
    assert grid.patches == patches
    assert grid.tokens == patches // proc.merge_size**2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_smart_resize_is_transformers_own(width: int, height: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as upstream

    if max(width, height) / min(width, height) > 200:
        with pytest.raises(VramledgerError, match="aspect ratio"):
            smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)
        return
    assert smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280) == upstream(
        height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    )


def test_one_real_image_through_the_processor() -> None:
    """The processor's own output for one 1024×768 image: pixel_values rows and image_grid_thw."""
    from PIL import Image

    out = _qwen_processor()(images=[Image.new("RGB", (1024, 768))], return_tensors="pt")
    v = resolve_model("qwen2.5-vl-7b").vision
    assert v is not None
    grid = image_grid(v, TrainSpec(images=1, image_size=(1024, 768)))
    assert tuple(out["image_grid_thw"][0].tolist()) == grid.grid == (1, 54, 74)
    assert out["pixel_values"].shape == (grid.patches, 3 * v.temporal_patch_size * v.patch_size**2)
    assert grid.tokens == 999


def test_llamafactory_max_pixels_then_the_processor_by_hand() -> None:
    """LLaMA-Factory mm_plugin _preprocess_image: 1024·768 > 768² → factor √(589824/786432) = 0.8660, 886×665
    (int), then smart_resize: round(665/28)·28 = 672, round(886/28)·28 = 896 → 48×64 patches, 768 tokens."""
    v = resolve_model("qwen2.5-vl-7b").vision
    assert v is not None
    grid = image_grid(v, TrainSpec(images=1, image_size=(1024, 768), image_max_pixels=768 * 768))
    assert (grid.width, grid.height, grid.patches, grid.tokens) == (896, 672, 48 * 64, 768)


def test_gemma3_fixed_tokens_match_its_projector() -> None:
    """Gemma 3: 256 tokens whatever the size (pan-and-scan off); the tower sees (896/14)² patches, which
    Gemma3MultiModalProjector pools to mm_tokens_per_image."""
    import inspect

    import torch
    from transformers import Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    from vramledger.catalog import catalog_entry

    entry = catalog_entry("gemma-3-4b")
    assert entry is not None
    with torch.device("meta"):
        proj = Gemma3MultiModalProjector(
            Gemma3Config(**{k: v for k, v in entry.config.items() if k != "architectures"})
        )
    v = resolve_model("gemma-3-4b").vision
    assert v is not None
    for size in ((1024, 768), (224, 224), (4000, 100)):
        grid = image_grid(v, TrainSpec(images=1, image_size=size))
        assert grid.patches == proj.patches_per_image**2
        assert grid.tokens == proj.tokens_per_side**2
        assert grid.tokens == inspect.signature(Gemma3Processor.__init__).parameters["image_seq_length"].default


def test_llama4_tiles_by_hand() -> None:
    """image_processing_llama4.py get_best_fit for 1024×768 (h 768, w 1024) and tiles of 336, ≤ 16 tiles: upscaling
    needs 3 rows (1008 ≥ 768) and 4 columns (1344 ≥ 1024); (3,4), (3,5) and (4,4) all scale by 1.3125, the smallest
    upscale; the smallest canvas (3,4) wins: 12 tiles + the global one, 144 <|patch|> tokens each
    ((336/14)² / 4, processing_llama4.py)."""
    v = resolve_model("llama-4-scout").vision
    assert v is not None
    grid = image_grid(v, TrainSpec(images=1, image_size=(1024, 768)))
    assert grid.grid == (13, 3, 4)
    assert grid.tokens == 13 * 144
    one = image_grid(v, TrainSpec(images=1, image_size=(300, 200)))  # fits one tile: no global tile
    assert (one.grid[0], one.tokens) == (1, 144)


def test_the_language_model_sees_text_plus_image_tokens() -> None:
    m = resolve_model("qwen2.5-vl-7b")
    t = TrainSpec(seq_len=512, images=2, image_size=(1024, 768))
    assert image_tokens(m, t) == 2 * 999
    assert lm_view(m, t).seq_len == 512 + 1998
    assert lm_view(m, lm_view(m, t)) == lm_view(m, t)  # idempotent
    counted = TrainSpec(seq_len=2048, images=2, image_size=(1024, 768), seq_includes_images=True)
    assert lm_view(m, counted).seq_len == 2048
    short = TrainSpec(seq_len=1000, images=2, image_size=(1024, 768), seq_includes_images=True)
    assert lm_view(m, short).seq_len == 1999  # the images and one token: the real run would fail, and it is said
    assert any("leaves no room" in w for w in estimate(m, replace(short, method="full")).warnings)


def test_images_on_a_text_model_are_refused() -> None:
    with pytest.raises(VramledgerError, match="no vision tower"):
        estimate(resolve_model("llama-3.2-1b"), TrainSpec(images=1))


def test_a_frozen_tower_off_the_gradient_path_saves_nothing() -> None:
    """LLaMA-Factory's default (frozen tower, no adapters in it) without checkpointing: nothing in the tower needs a
    gradient, so only the pixels and the longer sequence cost memory; adapters in it (PEFT's all-linear) make it
    save."""
    m = tiny_vl()
    t = TrainSpec(seq_len=256, images=1, image_size=(1024, 768), freeze_vision_tower=True)
    vb = vision_bytes(m, t)
    assert vb is not None
    assert vb.saved == 0 and vb.lm_extra == 0
    assert vb.pixels == 4 * 3996 * 1176  # fp32 pixel_values rows of 3·2·14² values
    adapted = vision_bytes(m, replace(t, freeze_vision_tower=False))
    assert adapted is not None and adapted.saved > 0 and adapted.lm_extra > 0


def test_images_grow_every_sequence_term() -> None:
    """Monotone: more images never cost less, and one image costs at least its tokens' logits (fp32, V wide)."""
    m = tiny_vl()
    peaks = [
        estimate(m, TrainSpec(seq_len=256, images=n, image_size=(448, 448), grad_ckpt=True)).peak_allocated
        for n in (0, 1, 2)
    ]
    tokens = image_tokens(m, TrainSpec(images=1, image_size=(448, 448)))
    assert peaks[0] < peaks[1] < peaks[2]
    assert peaks[1] - peaks[0] >= 4 * tokens * m.vocab_size
    assert math.isclose(peaks[2] - peaks[1], peaks[1] - peaks[0], rel_tol=0.2)


@pytest.mark.parametrize("key", ["gemma-3-4b", "gemma-3-12b", "gemma-3-27b"])
def test_gemma3_tower_completes_the_published_count(key: str) -> None:
    """Gemma 3's formula counts the language model; with the SigLIP tower and projector the total is the published
    figure of the whole checkpoint (catalog ``published_params``, from the model pages)."""
    from vramledger.catalog import catalog_entry

    m, entry = resolve_model(key), catalog_entry(key)
    assert m.vision is not None and entry is not None
    total = count_params(m) + siglip_params(m.vision)
    print(f"{key}: expected {entry.published_params:,}, got {total:,}")
    assert total == entry.published_params
    ledger = estimate(m, TrainSpec(seq_len=600, images=1))
    assert ledger.params - ledger.trainable_params == entry.published_params


def gemma3_processor():  # type: ignore[no-untyped-def]
    """``Gemma3Processor`` as transformers ships it, built without a download: its PIL image processor at the
    checkpoints' 896² (preprocessor_config.json ``size``) and a word-level tokenizer holding Gemma's three image
    tokens under the names the processor reads (``boi_token``, ``eoi_token``, ``image_token``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    vocab = {"<pad>": 0, "<unk>": 1, "hello": 2, "<start_of_image>": 3, "<end_of_image>": 4, "<image_soft_token>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", extra_special_tokens=special
    )
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}),
                           tokenizer=tokenizer)  # fmt: skip


@pytest.mark.parametrize("size", [(1024, 768), (300, 2000), (896, 896)])
def test_gemma3_tokens_equal_the_processor(size: tuple[int, int]) -> None:
    """``Gemma3Processor`` expands the prompt's boi into ``full_image_sequence`` (processing_gemma3.py ``__init__``:
    boi, image_seq_length image tokens, eoi, between blank lines): 256 image tokens for any size, and the image
    processor's fp32 pixel_values of 896² (the batch trace/vision_inputs.py feeds)."""
    from PIL import Image

    out = gemma3_processor()(text=["hello <start_of_image>"], images=[[Image.new("RGB", size)]], return_tensors="pt")
    v = resolve_model("gemma-3-4b").vision
    assert v is not None
    grid = image_grid(v, TrainSpec(images=1, image_size=size))
    ids = out["input_ids"][0].tolist()
    print(f"{size}: processor {ids.count(5)} image tokens, estimate {grid.tokens}")
    assert ids.count(5) == grid.tokens == int(out["token_type_ids"].sum()) == 256
    assert out["pixel_values"].shape == (1, 3, grid.height, grid.width) == (1, 3, 896, 896)
    assert str(out["pixel_values"].dtype) == "torch.float32"


@pytest.mark.parametrize("config", [None, TINY_QWEN2_VL, TINY_QWEN3_VL], ids=["qwen2.5-vl", "qwen2-vl", "qwen3-vl"])
def test_full_fine_tuning_freezes_the_tower(config: dict | None) -> None:
    """LLaMA-Factory ``_setup_full_tuning`` with ``freeze_vision_tower`` (its default): the tower and merger keep no
    gradient and no optimizer state. The tower's size is counted on the real model built on the meta device (every
    parameter under ``model.visual``), and the difference by hand: AdamW under AMP keeps 4 (fp32 gradient) + 8 (two
    fp32 moments) bytes per trained parameter, and the fp32 master copy of 4 bytes becomes the bf16 weight's 2."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vramledger.analytic.vision_params import tower_params
    from vramledger.ledger import Category, Phase

    m = tiny_vl(config)
    cfg = dict(config or TINY_QWEN25_VL)
    cfg.pop("architectures")
    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    tower = sum(p.numel() for p in hf.model.visual.parameters())
    print(f"tower: meta model {tower:,}, vramledger {tower_params(m):,}")
    assert tower_params(m) == tower
    t = TrainSpec(seq_len=64, method="full")
    trains, frozen = estimate(m, t), estimate(m, replace(t, freeze_vision_tower=True))
    assert trains.params == frozen.params
    assert trains.trainable_params - frozen.trainable_params == tower

    def at_step(ledger, category: Category) -> int:  # type: ignore[no-untyped-def]
        return sum(i.bytes for i in ledger.items if i.phase is Phase.OPTIMIZER and i.category is category)

    assert at_step(trains, Category.GRADIENTS) - at_step(frozen, Category.GRADIENTS) == 4 * tower
    assert at_step(trains, Category.OPTIMIZER_STATE) - at_step(frozen, Category.OPTIMIZER_STATE) == 8 * tower
    assert at_step(trains, Category.WEIGHTS) - at_step(frozen, Category.WEIGHTS) == (4 - 2) * tower
