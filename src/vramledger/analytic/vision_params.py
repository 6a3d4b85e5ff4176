"""Parameter counts of a vision-language model's tower and projector, and which of them train: what the weight
budget (analytic/weights.py) needs from the tower, apart from its activations (analytic/vision.py), so that the
two import nothing of each other."""

from __future__ import annotations

from vramledger.specs import Method, ModelSpec, TrainSpec
from vramledger.specs.vision import ImageRule, VisionSpec


def tower_trains(train: TrainSpec) -> bool:
    """The tower's own weights train: full fine-tuning without ``--freeze-vision-tower``."""
    return train.method is Method.FULL and not train.freeze_vision_tower


def siglip_params(v: VisionSpec) -> int:
    """Parameters of Gemma 3's SigLIP tower and projector (modeling_siglip.py ``SiglipVisionTransformer`` without
    its head: patch Conv2d with bias, a learned position per patch, per layer LayerNorm ×2 and q/k/v/out and
    fc1/fc2 with biases, the post LayerNorm; modeling_gemma3.py ``Gemma3MultiModalProjector``: an RMSNorm and the
    h × text-hidden projection). Gemma 3 4B: 419,816,304, which with the language model's 3,880,263,168 is the
    published 4,300,079,472."""
    h, i_w = v.hidden_size, v.intermediate_size
    embed = 3 * v.patch_size**2 * h + h + (v.image_size // v.patch_size) ** 2 * h
    layer = 4 * (h * h + h) + 4 * h + (h * i_w + i_w) + (i_w * h + h)
    return embed + v.depth * layer + 2 * h + h + h * v.out_hidden_size


def uncounted_tower(m: ModelSpec, train: TrainSpec) -> int:
    """Parameters of a tower fed images that the language model's count leaves out (Gemma 3's formula)."""
    v = m.vision
    if v is None or not train.images or m.inventory is not None or v.rule is not ImageRule.FIXED:
        return 0
    return siglip_params(v)


def tower_params(m: ModelSpec) -> int:
    """Parameters of the vision tower and projector: a meta-built model's are everything outside its embeddings,
    output layer and decoder layers (catalog/inventory.py ``other_params``) less the final norm's weight; Gemma 3's
    formula counts them apart (``siglip_params``); 0 without a tower."""
    if m.vision is None:
        return 0
    if m.inventory is not None:
        return m.inventory.other_params - m.hidden_size
    return siglip_params(m.vision) if m.vision.rule is ImageRule.FIXED else 0


def uncounted_tower_params(m: ModelSpec, train: TrainSpec) -> int:
    """Frozen tower parameters the weight budget does not count (Gemma 3's tower fed images, unless it trains)."""
    return 0 if tower_trains(train) else uncounted_tower(m, train)


def full_tuning_tower_params(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """Full fine-tuning: (tower parameters the model's count includes that stay frozen, tower parameters it leaves
    out that train). LLaMA-Factory ``model/adapter.py`` ``_setup_full_tuning`` sets ``requires_grad`` False on the
    ``get_forbidden_modules`` (the tower with ``freeze_vision_tower``, the projector with
    ``freeze_multi_modal_projector``, both true by default) and leaves them in the load dtype; the rest train."""
    if train.method is not Method.FULL or m.vision is None:
        return 0, 0
    if train.freeze_vision_tower:
        return (tower_params(m) if m.inventory is not None else 0), 0
    return 0, uncounted_tower(m, train)
