"""LoRA on parameters: PEFT's ``target_parameters`` (axolotl and TRL ``lora_target_parameters``), which adapts a
weight that is no ``nn.Linear`` (a fused 3-D expert stack, a bare router weight) through ``ParamWrapper``.

Legend: r rank, E experts of a 3-D weight (1 for a 2-D one), in/out its matmul's features.

Upstream read (PEFT 0.21.2):
- ``tuners/tuners_utils.py`` ``BaseTuner._inject_parameters``: for every module, each parameter it holds itself
  (``named_parameters(recurse=False)``) has the key ``f"{module_name}.{param_name}"`` (``base_layer`` segments
  stripped); a target matches when it equals the key or the key ends with ``"." + target``. So
  ``mlp.experts.gate_up_proj`` names that parameter in every layer, ``23.mlp.experts.gate_up_proj`` in layer 23 alone.
  A target that matches nothing earns only a ``RuntimeWarning`` there (an error when nothing at all is adapted);
  here it is an error, since the run would train less than the config says.
- ``tuners/lora/layer.py`` ``ParamWrapper.update_layer``: ``lora_A = nn.Linear(in, r·E)``, ``lora_B = nn.Linear(r·E,
  out)``: r·E·(in + out) parameters per wrapped weight; ``ParamWrapper.__init__`` refuses ``lora_dropout`` and DoRA
  (``specs/train.py`` ``LoraSpec`` says so before PEFT would).
- The rank is ``r`` for a named parameter; only PEFT's own conversion of ``all-linear`` for transformers 5's fused MoE
  (``utils/transformers_weight_conversion.py`` ``_convert_peft_config_moe``) puts ``gate_up_proj`` at 2r through its
  rank pattern, which applies to the same parameter named explicitly as well (weights.py ``adapted_linears``).

What the wrapped weights cost at run time (a merged copy per forward, the matmuls' inputs) is
``analytic/activations.py`` ``merged_experts`` and ``_param_wrapper_inputs``: the same for an explicit target as for
PEFT's conversion.
"""

from __future__ import annotations

from dataclasses import replace

from vramledger.analytic.params import Linear
from vramledger.errors import VramledgerError
from vramledger.specs import LoraSpec, ModelSpec

# torch.distributed.algorithms._checkpoint.checkpoint_wrapper ``_CHECKPOINT_WRAPPED_MODULE``: the segment a
# checkpoint-wrapped layer inserts into parameter paths (axolotl's gpt-oss example names its targets with it). The
# parameter is the same tensor: it is matched with the segment removed.
CHECKPOINT_WRAPPER_SEGMENT = "_checkpoint_wrapped_module."


def peft_names(lora: LoraSpec) -> tuple[str, ...]:
    """The target parameters as PEFT matches them against an unwrapped model."""
    return tuple(t.replace(CHECKPOINT_WRAPPER_SEGMENT, "") for t in lora.parameters)


def wrapper_params(lin: Linear, rank: int) -> int:
    """Adapter parameters of ``ParamWrapper`` on ``lin`` in one layer: r·E·(in + out)."""
    return rank * lin.per_layer * (lin.in_features + lin.out_features)


def _parameter_path(lin: Linear) -> str:
    """The path, inside a decoder layer, of the parameter a formula family's non-``nn.Linear`` weight is
    (transformers 5 modeling_mixtral.py / modeling_qwen3_moe.py: the sparse block is the layer's ``mlp``; its router
    ``gate`` holds ``weight``; the experts' 3-D weights are parameters of ``mlp.experts``)."""
    return "mlp.gate.weight" if lin.name == "gate" else f"mlp.{lin.name}"


def matches(target: str, key: str) -> bool:
    """PEFT's rule (``_inject_parameters``): the key itself or a dotted suffix of it."""
    return key == target or key.endswith(f".{target}")


def formula_parameter_targets(m: ModelSpec, linears: tuple[Linear, ...], lora: LoraSpec) -> list[Linear]:
    """The weights of a formula family that ``lora.parameters`` name, each with the number of layers it is adapted
    in (``Linear.layers``; 0 for all); an error naming the targets that match no parameter."""
    names = peft_names(lora)
    matched: set[str] = set()
    out: list[Linear] = []
    candidates = [lin for lin in linears if not lin.lora_targetable]
    for lin in candidates:
        path = _parameter_path(lin)
        layers = 0
        for i in range(m.num_layers):
            hits = {t for t in names if matches(t, f"model.layers.{i}.{path}")}
            matched |= hits
            layers += bool(hits)
        if layers:
            out.append(replace(lin, layers=0 if layers == m.num_layers else layers))
    unknown = [given for given, t in zip(lora.parameters, names, strict=True) if t not in matched]
    if unknown:
        choices = ", ".join(_parameter_path(lin) for lin in candidates)
        raise unknown_error(unknown, m.family, choices)
    return out


def unknown_error(unknown: list[str], family: str, choices: str) -> VramledgerError:
    """One line naming the targets that match no parameter, and what to name instead."""
    fix = (
        f"name one of {choices} (or one layer's, e.g. 0.{choices.split(', ')[-1]})"
        if choices
        else "its weights are nn.Linear modules': adapt them as target modules (--lora-targets)"
    )
    return VramledgerError(
        f"lora target parameters: {', '.join(unknown)} match no weight of {family} outside its nn.Linear modules "
        f"(PEFT matches a parameter's path or a dotted suffix of it); {fix}"
    )
