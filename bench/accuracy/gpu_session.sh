#!/usr/bin/env bash
# One call on a lent GPU machine (≤ 10 minutes): GPU tests, then as much of the accuracy suite as fits.
#
#   bash bench/accuracy/gpu_session.sh [RESULTS.jsonl to resume]
#
# Writes the results JSONL, the table and the logs under $OUT (or ./out when $OUT is unset). The suite is
# resumable: copy the JSONL back into bench/accuracy/results/, commit it, and run again with its path to
# measure the configurations not yet there. Needs torch, transformers, peft, pyyaml (on the image); QLoRA
# configurations also need bitsandbytes, which the image lacks: carry its wheel in .whl/ (see
# docs/readme/measure.md), else they are recorded as "unsupported".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/measure -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/pytest_gpu.txt"
RESUME=${1:-}
python3 bench/accuracy/run_suite.py run --budget-s "${BUDGET_S:-420}" --timeout 150 \
  ${RESUME:+--resume "$RESUME"} 2>&1 | tee "$OUT/suite.log"
latest=$(ls -t bench/accuracy/results/*.jsonl 2>/dev/null | head -1)
if [ -n "$latest" ]; then
  cp "$latest" "$OUT/"
  python3 bench/accuracy/table.py "$latest" | tee "$OUT/table.txt"
fi
