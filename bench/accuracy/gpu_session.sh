#!/usr/bin/env bash
# One call on a lent GPU machine (≤ 10 minutes): as much of the accuracy suite as fits, each trial's allocation
# stream recorded for the allocator check.
#
#   bash bench/accuracy/gpu_session.sh [RESULTS.jsonl to resume] [PYTORCH_CUDA_ALLOC_CONF]
#
# Writes under $OUT (or ./out): results.jsonl (measurements only; fill the predictions afterwards on any
# machine with `run_suite.py predict`), streams.tar (one <id>.json.xz per trial, see streams.py), gpu.txt and
# suite.log. The suite is resumable: commit results.jsonl under bench/accuracy/results/ and pass its path to
# measure the configurations not yet there. Needs torch, transformers, peft, pyyaml (on the image). QLoRA and
# the bitsandbytes optimizers also need bitsandbytes, which the image lacks: unpack its wheel into .whl/site
# (see docs/measure.md) and carry .whl; without it those configurations are recorded as "unsupported".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT/streams"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -d .whl/site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.whl/site"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
python3 -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
RESUME=${1:-}
ALLOC_CONF=${2:-}
if [ -n "$RESUME" ]; then cp "$RESUME" "$OUT/results.jsonl"; fi
timeout "${SUITE_TIMEOUT_S:-560}" python3 bench/accuracy/run_suite.py run --no-predict \
  --budget-s "${BUDGET_S:-420}" --timeout "${TRIAL_TIMEOUT_S:-150}" ${ONLY:+--only "$ONLY"} \
  --streams "$OUT/streams" --out "$OUT/results.jsonl" ${RESUME:+--resume "$OUT/results.jsonl"} \
  ${ALLOC_CONF:+--alloc-conf "$ALLOC_CONF"} 2>&1 | tee "$OUT/suite.log"
rm -f "$OUT"/streams/*.pickle
tar -C "$OUT" -cf "$OUT/streams.tar" streams && rm -rf "$OUT/streams"
ls -la "$OUT"
