"""bitsandbytes' 4-bit quantisation state under FSDP and ZeRO-3: whole on every rank, never offloaded.

A QLoRA weight is two things (analytic/weights.py ``quantised_tensors``): the packed 4-bit codes, which are the
``Params4bit`` parameter's own storage, and its ``QuantState`` (one absmax per 64-element block; with double
quantisation those as uint8 plus one fp32 absmax per 256 blocks), which is an attribute, not a parameter or a buffer:

- bitsandbytes 0.43.0 (the version PEFT's FSDP-QLoRA guide requires) ``nn/modules.py`` ``Params4bit._quantize``
  (l. 278-292) quantises on the GPU and hands the state to its module (``self.module.quant_state = quant_state``);
  ``Linear4bit.forward`` (l. 410-417) restores it onto the weight "when the quant state got lost when the parameter
  got converted. This happens for example for fsdp".
- transformers ``modeling_utils.py`` ``_load_state_dict_into_meta_model`` (from 4.39, the guide's
  ``transformers>4.38.2``): "For quantized modules with FSDP/DeepSpeed Stage 3, we need to quantize the parameter on
  the GPU and then cast it to CPU": ``type(value)(value.data.to(param_to), **value.__dict__)`` moves only the packed
  data (to the CPU on local rank 0, to meta elsewhere) and passes the GPU ``quant_state`` on unchanged.
- FSDP1 flattens, shards and (under ``CPUOffload(offload_params=True)``) moves to the host only parameters
  (torch ``distributed/fsdp/_flat_param.py`` ``FlatParamHandle``: a flat parameter of the modules' ``nn.Parameter``
  data); DeepSpeed ZeRO-3 partitions only parameters (``parameter_offload.py`` ``_convert_to_zero_parameters``).

So each rank keeps the whole model's quantisation state on its GPU, while the packed codes are sharded (and
offloaded). For Llama-2-70B in NF4 with double quantisation that is 1.09 GB per rank.
"""

from __future__ import annotations

from vramledger.analytic.params import in_layers, layer_linears
from vramledger.analytic.weights import quantised_tensors
from vramledger.specs import ModelSpec, TrainSpec

SOURCE = (
    "bitsandbytes 0.43 nn/modules.py Params4bit._quantize (module.quant_state) and transformers modeling_utils.py "
    "_load_state_dict_into_meta_model (only value.data moves): the QuantState is no parameter, so FSDP and ZeRO-3 "
    "neither shard nor offload it"
)


def quant_state_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """Bytes of every 4-bit linear's ``QuantState`` (absmax, nested absmax) over the whole model: what a rank keeps
    whole under FSDP or ZeRO-3 (0 without a bitsandbytes 4-bit base).

    >>> from vramledger.catalog import resolve_model
    >>> from vramledger.specs import Method, QuantSpec
    >>> t = TrainSpec(method=Method.QLORA, quant=QuantSpec(bits=4, double_quant=False))
    >>> quant_state_bytes(resolve_model("llama-2-7b"), t) == 32 * 4 * (4 * 4096 * 4096 + 3 * 4096 * 11008) // 64
    True
    """
    q = train.quant
    if q is None or q.bits != 4:
        return 0
    total = 0
    for lin in layer_linears(m):
        packed, *state = quantised_tensors(lin.in_features * lin.out_features, lin.out_features, q)
        total += in_layers(m, lin) * lin.per_layer * sum(state)
    return total
