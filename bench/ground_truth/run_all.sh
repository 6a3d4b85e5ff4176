#!/usr/bin/env bash
# Runs the three ground-truth scripts in order on the GPU machine, each under its own hard timeout, each
# writing under $OUT/gt/; a failing script does not stop the next. Finally packs $OUT/gt into ONE file,
# $OUT/gt.tar.gz, and removes the loose files (the device tool returns few files, two folders deep at most).
#
#   OUT=/some/dir bash bench/ground_truth/run_all.sh            # on the GPU machine
#   OUT=/tmp/x DEVICE=cpu SMOKE=1 bash bench/ground_truth/run_all.sh   # local check of the plumbing
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
DEVICE="${DEVICE:-cuda}"
EXTRA=()
if [ -n "${SMOKE:-}" ]; then EXTRA=(--smoke); fi
GT="$OUT/gt"
mkdir -p "$GT"

{ nvidia-smi || true; } > "$GT/nvidia-smi.txt" 2>&1

run() {
  local name=$1 limit=$2
  echo "== $name (timeout ${limit}s) $(date +%T)"
  timeout -k 10 "$limit" python3 "bench/ground_truth/$name.py" --out "$GT" --device "$DEVICE" "${EXTRA[@]}" \
    2>&1 | tee "$GT/$name.log" | grep -v -E "Warning|warnings.warn|token_id must be"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc $(date +%T)"
  echo "$name $rc" >> "$GT/exit_codes.txt"
}

run whole_run 270
run oom_fixtures 150
run constants 170

ls -la "$GT"
du -sh "$GT"
tar -czf "$OUT/gt.tar.gz" -C "$OUT" gt && rm -rf "$GT"
ls -la "$OUT/gt.tar.gz"
