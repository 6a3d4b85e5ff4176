"""LoRA on parameters (PEFT ``target_parameters``, analytic/target_parameters.py): the trainable count against
PEFT's own ``get_nb_trainable_parameters`` on the model transformers builds from the catalog config on the meta
device, for the two formula families with fused experts and for gpt-oss (built on the meta device itself)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from vramledger.analytic.activations import merged_experts
from vramledger.analytic.weights import weight_budget
from vramledger.catalog import catalog_entry, resolve_model
from vramledger.errors import VramledgerError
from vramledger.specs import LoraSpec, Method, TrainSpec

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

CASES = [
    # axolotl examples/expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml with its commented target parameters
    pytest.param("qwen3-30b-a3b", ATTENTION, EXPERTS, 32, id="qwen3-moe-attention-and-experts-r32"),
    # all-linear: PEFT's MoE conversion already adapts the experts (gate_up at 2r): naming one adds nothing
    pytest.param("qwen3-30b-a3b", "all-linear", EXPERTS[:1], 8, id="qwen3-moe-all-linear-and-gate-up"),
    # no target modules, one layer's expert stack and every layer's router
    pytest.param("qwen3-30b-a3b", (), ("47.mlp.experts.down_proj", "mlp.gate.weight"), 8, id="qwen3-moe-router"),
    pytest.param(
        "mixtral-8x7b",
        ("q_proj", "v_proj"),
        ("mlp.experts.gate_up_proj", "31.mlp.experts.down_proj", "30.mlp.experts.down_proj"),
        16,
        id="mixtral-some-layers",
    ),
    # axolotl examples/gpt-oss/gpt-oss-20b-sft-lora-singlegpu.yaml with its commented target parameters (the
    # _checkpoint_wrapped_module segment removed: the same parameters)
    pytest.param(
        "gpt-oss-20b",
        "all-linear",
        tuple(f"{i}.{p}" for i in (22, 23) for p in EXPERTS),
        8,
        id="gpt-oss-last-two-layers",
    ),
    pytest.param("gpt-oss-20b", ("q_proj",), (*EXPERTS, "mlp.router.weight"), 8, id="gpt-oss-experts-router"),
]


def _peft_count(config: dict[str, Any], targets: Any, parameters: tuple[str, ...], rank: int) -> int:
    """PEFT's own count, on the model transformers builds from the config (meta device, nothing allocated)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from vramledger.catalog.inventory import build_meta_model, hf_config_object

    model = build_meta_model(hf_config_object(config, "test"), where="test")
    cfg = peft.LoraConfig(
        r=rank, target_modules=list(targets) if isinstance(targets, tuple) else targets,
        target_parameters=list(parameters), task_type="CAUSAL_LM",
    )  # fmt: skip
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return int(peft.get_peft_model(model, cfg).get_nb_trainable_parameters()[0])


@pytest.mark.parametrize(("name", "targets", "parameters", "rank"), CASES)
def test_trainable_count_is_peft_s(name: str, targets: Any, parameters: tuple[str, ...], rank: int) -> None:
    pytest.importorskip("transformers")
    entry = catalog_entry(name)
    assert entry is not None
    lora_targets = ("all",) if targets == "all-linear" else targets
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=rank, targets=lora_targets, parameters=parameters))
    got = weight_budget(entry.spec(), train).trainable_params
    want = _peft_count(entry.config, targets, parameters, rank)
    print(name, targets, parameters, "estimate", got, "PEFT", want, got == want)
    assert got == want


def test_the_wrapped_parameters_merge_as_the_converted_ones() -> None:
    """Qwen3-30B-A3B: naming both expert stacks gives the merged copies ``merged_experts`` counts for PEFT's
    conversion without the router (by hand, bf16: gate_up 128·1536·2048·2 B = 768 MiB and down 384 MiB a layer)."""
    m = resolve_model("qwen3-30b-a3b")
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, targets=ATTENTION, parameters=EXPERTS))
    MiB = 2**20
    assert merged_experts(m, train, weight_budget(m, train)) == (1152 * MiB, 48 * 1152 * MiB, 384 * MiB)
    lora = LoraSpec(rank=8, targets=ATTENTION, parameters=("0.mlp.experts.down_proj",))
    one_layer = TrainSpec(method=Method.LORA, lora=lora)
    assert merged_experts(m, one_layer, weight_budget(m, one_layer)).all_layers == 384 * MiB


@pytest.mark.parametrize(
    ("name", "parameters", "message"),
    [
        pytest.param("qwen3-30b-a3b", ("mlp.experts.gate_proj",), "gate_proj match no weight", id="v4-name"),
        pytest.param("qwen3-30b-a3b", ("48.mlp.experts.down_proj",), "48.mlp.experts.down_proj", id="no-such-layer"),
        pytest.param("llama-3-8b", ("mlp.experts.down_proj",), "adapt them as target modules", id="dense"),
        pytest.param("gpt-oss-20b", ("experts.up_proj",), "name one of mlp.experts.gate_up_proj", id="gpt-oss"),
    ],
)
def test_a_name_that_matches_nothing_is_an_error(name: str, parameters: tuple[str, ...], message: str) -> None:
    """PEFT only warns when a target parameter matches nothing (tuners_utils.py ``inject_adapter``): the run would
    train less than the config says, so the estimate refuses, naming the field and what to name instead."""
    m = resolve_model(name)
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, targets=("q_proj",), parameters=parameters))
    with pytest.raises(VramledgerError, match=message) as info:
        weight_budget(m, train)
    assert info.value.exit_code == 2 and "lora target parameters" in str(info.value)


@pytest.mark.parametrize("changes", [{"dropout": 0.05}, {"dora": True}], ids=["dropout", "dora"])
def test_paramwrapper_refuses_dropout_and_dora(changes: dict[str, Any]) -> None:
    """PEFT 0.21 tuners/lora/layer.py ``ParamWrapper``: ``ValueError`` for lora_dropout != 0 and use_dora."""
    with pytest.raises(VramledgerError, match="ParamWrapper does not work with"):
        LoraSpec(rank=8, parameters=EXPERTS, **changes)


def test_gpt_oss_expert_inputs_by_hand() -> None:
    """gpt-oss stores its experts (E, in, out) for ``x @ W`` (modeling_gpt_oss.py ``GptOssExperts``: gate_up_proj
    (E, H, 2I), ``current_state @ self.gate_up_proj[expert_idx]``): the wrapped gate_up keeps its k = 4 experts'
    H-wide inputs (2880), not 2I; down_proj its I-wide ones (2880). Adapted in layers 22 and 23 of 24 (the
    axolotl example's comment), they count for 2/24 of every trained layer: (4·2880 + 4·2880)·2 B · 2/24."""
    pytest.importorskip("transformers")
    from vramledger.analytic.activations import layer_activations

    m = resolve_model("gpt-oss-20b")
    parameters = tuple(f"{i}.{p}" for i in (22, 23) for p in EXPERTS)
    train = TrainSpec(method=Method.LORA, lora=LoraSpec(rank=8, parameters=parameters))
    parts = dict(layer_activations(m, train, weight_budget(m, train)).detail)
    assert parts["inputs kept for the experts' and router's LoRA (ParamWrapper)"] == (4 * 2880 + 4 * 2880) * 2 * 2 // 24
