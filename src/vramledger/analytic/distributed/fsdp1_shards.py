"""FSDP1's flat shards split a unit's trainable parameters unevenly: which rank holds how many.

Legend: N ranks sharing a shard; u bytes per element of the unsharded flat parameter (its compute dtype); a the
alignment in elements (16 bytes / u).

FSDP1 flattens each unit's parameters into one flat parameter in the order ``module.parameters()`` yields them
(torch/distributed/fsdp/_flat_param.py ``FlatParamHandle._init_flat_param_and_metadata``), with
``use_orig_params=True`` padding before each tensor to an a-element boundary (``align_addresses``,
``_get_aligned_numel``: 16 bytes, "from TorchInductor"), and gives rank r the r-th of N equal chunks
(``_get_shard`` → ``_get_unpadded_shard``: ``torch.flatten(tensor).chunk(world_size)``, the last padded). A
LoRA layer's unit holds its frozen base weights and its adapters together (distributed/core.py
``adapters_in_layer_units``), in registration order: ``LlamaDecoderLayer.__init__`` registers ``self_attn``
(q, k, v, o), ``mlp`` (gate, up, down), then the two norms, and PEFT's ``lora.Linear`` its ``base_layer`` before the
``lora_A`` / ``lora_B`` ModuleDicts (peft tuners/lora/layer.py ``LoraLayer.__init__``). So each rank holds the
adapters of the weights its chunk covers: on the grid's mid model at 8 ranks rank 0's chunk ends inside v_proj's
base weight and holds q's and k's adapters (r = 16), 53,248 of a layer's 290,816 trainable elements (18.3%, not
12.5%), and the optimizer state of the sharded views (``use_orig_params``: the optimizer steps each parameter's part
in the shard) follows. Checked against the trace of FSDP1 (rank 0's optimizer state, bench/distributed/grid.jsonl;
tests/analytic/test_fsdp1_shards.py).
"""

from __future__ import annotations

from vramledger.analytic.params import layer_linears, layer_params
from vramledger.analytic.weights import WeightBudget
from vramledger.specs import ModelSpec, TrainSpec

ALIGNMENT_BYTES = 16
"""_flat_param.py ``_get_aligned_numel``: ``ALIGNMENT = 16  # bytes``."""


def layer_unit_tensors(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> tuple[tuple[int, bool], ...]:
    """(elements, trainable) of each tensor of one decoder layer's unit, in registration order (module docstring):
    each linear's weight and bias, then its adapter's A and B (and DoRA's magnitude), then the rest of the layer
    (its norms), frozen."""
    adapters = {a.linear.name: a for a in wb.adapted} if train.adapters and train.lora is not None else {}
    r = train.lora.rank if train.lora is not None else 0
    out: list[tuple[int, bool]] = []
    linears = 0
    for lin in layer_linears(m):
        adapted = adapters.get(lin.name)
        for _ in range(lin.per_layer):
            out.append((lin.in_features * lin.out_features, False))
            if lin.bias:
                out.append((lin.out_features, False))
            if adapted is not None:
                a_elems, b_elems = r * lin.in_features, lin.out_features * r
                out += [(a_elems, True), (b_elems, True)]
                if adapted.params > a_elems + b_elems:  # DoRA's magnitude vector
                    out.append((adapted.params - a_elems - b_elems, True))
        linears += lin.numel
    rest = layer_params(m) - linears
    if rest > 0:
        out.append((rest, False))
    return tuple(out)


def trainable_per_rank(tensors: tuple[tuple[int, bool], ...], ranks: int, u: int) -> tuple[int, ...]:
    """Trainable elements of a unit that each of ``ranks`` ranks holds (module docstring).

    >>> trainable_per_rank(((6, False), (2, True), (8, False)), 2, 2)  # aligned to 8: 6 | 2 pad | 2 | 6 pad | 8
    (2, 0)
    """
    aligned = ALIGNMENT_BYTES // u if u else 0
    spans: list[tuple[int, int]] = []
    total = 0
    for numel, trainable in tensors:
        if aligned and total % aligned:
            total += aligned - total % aligned
        if trainable:
            spans.append((total, total + numel))
        total += numel
    chunk = -(-total // ranks)
    return tuple(
        sum(max(0, min(end, (k + 1) * chunk) - max(start, k * chunk)) for start, end in spans) for k in range(ranks)
    )
