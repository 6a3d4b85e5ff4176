"""The load phase of a quantised base: what each framework's load path allocates while it quantises.

Legend: n elements of the largest quantised weight, c bytes of the compute dtype.

- transformers + bitsandbytes (``LoadPath.TRANSFORMERS``): ``bitsandbytes/nn/modules.py`` ``Params4bit._quantize``
  moves one weight to the GPU (``self.data.contiguous().to(device)``, c·n) and ``quantize_4bit`` writes the packed
  codes beside it: one bf16 weight alive at a time on top of what is already quantised.
- torchtune (``LoadPath.TORCHTUNE``): the recipe builds the model under ``with self._device`` so each
  ``FrozenNF4Linear.__init__`` first allocates its bf16 weight on the GPU (c·n), then torchao's
  ``NF4Tensor.from_tensor`` → ``convert_to_norm_float_weight`` makes ``scaled_blocks = blocks / scales`` (c·n) and
  ``quantized_blocks = torch.empty(numel, dtype=torch.uint8)`` (n), filled by ``quantize_tensor_nearest`` in chunks
  of ``CHUNK_SIZE = 1024**2`` elements, each chunk's ``(value - nf4).abs()`` a (chunk, 16) bf16 tensor and its
  ``min`` an int64 index (16·c + 8 + c bytes per chunk element). ``load_state_dict`` then repeats the conversion
  per weight with the checkpoint's tensor copied in. The peak: (2c + 1)·n + (17c + 8)·2^20 beside what is quantised.
  PyTorch's caching allocator keeps these blocks reserved afterwards (nothing returns them to the driver), so
  reserved memory starts the first step at least at the load peak.
"""

from __future__ import annotations

from vramledger.analytic.weights import WeightBudget
from vramledger.specs import Method, ModelSpec, TrainSpec
from vramledger.specs.load import LoadPath

TORCHAO_CHUNK = 1024**2
"""torchao ``nf4tensor.py`` ``CHUNK_SIZE``: elements quantised per ``quantize_tensor_nearest`` call."""

SOURCES = {
    LoadPath.TRANSFORMERS: "bitsandbytes Params4bit._quantize: one weight moved to the GPU in the compute dtype, then "
    "quantize_4bit (c·n of the largest quantised weight)",
    LoadPath.TORCHTUNE: "torchtune FrozenNF4Linear built in bf16 on the GPU, torchao NF4Tensor.from_tensor: weight, "
    "scaled blocks and uint8 codes ((2c+1)·n) plus one 2^20-element chunk of quantize_tensor_nearest",
}


def load_transient_bytes(m: ModelSpec, train: TrainSpec, wb: WeightBudget) -> int:
    """Bytes alive beside the weights at the load's peak (0 unless the base is quantised on the GPU)."""
    if train.method is not Method.QLORA or train.quant is None:
        return 0
    n, c = wb.largest_frozen_matrix_numel, train.precision.compute.bytes
    if train.load_path is LoadPath.TORCHTUNE:
        return (2 * c + 1) * n + (17 * c + 8) * min(n, TORCHAO_CHUNK)
    return c * n
