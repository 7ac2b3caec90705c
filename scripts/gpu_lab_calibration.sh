#!/usr/bin/env bash
# The simulator's calibration on the H200 (issue 4), results in $OUT: fit a cost-model profile
# to the paged runner's measured steps, then replay one workload on both and compare TTFT/TPOT.
#
# On the dev machine first:  bash ../shared/gpu/wheels.sh .whl   (pydantic & co, which the
# GPU machine lacks; keep .whl out of git), then run this with .whl carried, e.g.
#   run(command="bash scripts/gpu_lab_calibration.sh", carry=[".whl"], timeout_s=480)
set -uo pipefail
OUT=${OUT:-/tmp/lab-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_common.sh"

echo "== simulator calibration (issue 4): fit a profile to measured steps, then replay on both"
timeout 200 python3 scripts/fit_cost_model.py configs/calibration/h200-qwen0.5b.yaml \
  --name h200-qwen2.5-0.5b -o "$OUT/h200-qwen2.5-0.5b.json" > "$OUT/calibration.txt" 2>&1
tail -2 "$OUT/calibration.txt"
timeout 200 python3 scripts/validate_simulator.py configs/calibration/h200-qwen0.5b.yaml \
  --profile "$OUT/h200-qwen2.5-0.5b.json" --policy fcfs --policy sjf \
  -o "$OUT/sim_validation.json" > "$OUT/sim_validation.txt" 2>&1
tail -9 "$OUT/sim_validation.txt"
