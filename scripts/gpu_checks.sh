#!/usr/bin/env bash
# Every GPU check (CUDA tests, runner against the peer, the simulator's calibration,
# decode and kernel benchmarks) as ONE prepared run on an H200; results in $OUT.
#
# On the dev machine first (keep both folders out of git; .git/info/exclude):
#   bash ../shared/gpu/wheels.sh .whl      # pydantic, msgspec, pyzmq: the GPU machine lacks them
#   rm -rf .peer && cp -r ../shared/bench .peer   # the peer benchmark travels with the tree
# then, on the GPU machine, with both folders beside the tree (ends within 540 s):
#   bash scripts/gpu_checks.sh
#
# Sections run in order of importance, each time-boxed and never past the overall
# budget (BUDGET_S, default 480 s, so the call ends inside its timeout with partial
# results). $OUT gets summary.txt (the key lines), logs.tgz (every section's log and
# JSON, refreshed after each section: at most 8 files come back) and the fitted
# profile (h200-qwen2.5-0.5b.json, with its machine, versions and residuals).
# ONLY=name1,name2 runs a subset (to rerun what failed).
#   tests     tests/gpu: kernel vs reference, fp32 greedy = transformers, bf16 top-1,
#             grammar bitmask on the graph, eager, async and n-gram paths
#   calib     schedkit calibrate: fit the simulator's profile to measured steps (the
#             workload, a grid of step shapes sized to its budget, a swap phase), written
#             to $OUT/h200-qwen2.5-0.5b.json; then the reduced accuracy grid (8 experiments,
#             real runner twice and simulator once each) against it, to $OUT/grid-h200.json
#   bench     schedkit (sync, then async scheduling) then the peer on the peer's workload
#             (qwen0.5b shape, bf16, 256 requests)
#   decode    decode step at batch 256 x 1,024 context (sync, then async scheduling)
#   kernels   attention kernel bandwidth (decode) and prefill vs dense SDPA
set -uo pipefail
OUT=${OUT:-/tmp/gpu-checks-out}
LOGS=/tmp/gpu-checks-logs
mkdir -p "$OUT" "$LOGS"
cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-480}
ONLY=${ONLY:-}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export SCHEDKIT_CACHE_DIR=/tmp/schedkit-cache
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/summary.txt"

# section NAME CAP_S LOG COMMAND...: run COMMAND for at most CAP_S seconds (less if the
# overall budget is nearly spent), output to $LOGS/LOG; returns 1 if skipped or failed.
section() {
  local name=$1 cap=$2 log=$3; shift 3
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 1; fi
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, budget spent" | tee -a "$OUT/summary.txt"; return 1; fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name ($log, at most ${cap}s, t=${SECONDS}s)" | tee -a "$OUT/summary.txt"
  timeout "$cap" "$@" > "$LOGS/$log" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && echo "   exit $rc (124: time-boxed)" | tee -a "$OUT/summary.txt"
  tar -C "$LOGS" -czf "$OUT/logs.tgz" .
  return $rc
}

section tests 150 gpu_tests.txt python3 -m pytest tests/gpu -m gpu -q -rfEs -s -p no:cacheprovider
grep -E "passed|failed|error|top-1" "$LOGS/gpu_tests.txt" 2>/dev/null | tail -6 | tee -a "$OUT/summary.txt"

# calib: schedkit calibrate's own budget ends 15 s inside the section's cap (it writes the
# profile at its end); the accuracy grid runs only if the profile came out.
CALIB_S=160
LEFT=$((BUDGET_S - SECONDS))
[ "$CALIB_S" -gt "$LEFT" ] && CALIB_S=$LEFT
section calib "$CALIB_S" calibration.txt python3 -m schedkit.cli calibrate \
  configs/calibration/h200-qwen0.5b.yaml --name h200-qwen2.5-0.5b -o "$OUT/h200-qwen2.5-0.5b.json" \
  --budget-s $((CALIB_S > 40 ? CALIB_S - 15 : 25))
tail -7 "$LOGS/calibration.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
if [ -f "$OUT/h200-qwen2.5-0.5b.json" ]; then
  section calib 130 accuracy_grid.txt python3 scripts/accuracy_grid.py configs/accuracy/grid-h200.yaml \
    --reduced --profile "$OUT/h200-qwen2.5-0.5b.json" -o "$OUT/grid-h200.json"
  sed -n '/mean abs/,/Kendall/p' "$LOGS/accuracy_grid.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
fi

section bench 140 bench_schedkit.txt python3 scripts/bench_paged.py --model qwen0.5b --device cuda \
  --dtype bfloat16 --n 256 --prompt 64,512 --out 128,128 --block-size 32 --max-batch-tokens 2048 \
  --scheduling both --json "$LOGS/bench_schedkit.json"
grep '^{' "$LOGS/bench_schedkit.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
if [ -f .peer/bench_hf_cb.py ]; then
  section bench 100 bench_peer.txt bash -c "cd .peer && python3 bench_hf_cb.py --model-config qwen0.5b \
    --device cuda --n 256 --prompt 64,512 --out 128,128 --block-size 32 --num-blocks 8192 \
    --max-batch-tokens 2048 --json $LOGS/bench_peer.json" && tail -1 "$LOGS/bench_peer.txt" | tee -a "$OUT/summary.txt"
else
  echo "   peer benchmark not carried (.peer)" | tee -a "$OUT/summary.txt"
fi

section decode 80 decode_step.txt python3 scripts/bench_paged.py --model qwen0.5b --device cuda \
  --dtype bfloat16 --decode-step 256,1024 --block-size 16 --scheduling both --json "$LOGS/decode_step.json"
grep '^{' "$LOGS/decode_step.txt" 2>/dev/null | tee -a "$OUT/summary.txt"

section kernels 60 kernels.txt python3 scripts/bench_paged_kernels.py --json "$LOGS/kernels.json" \
  && tail -8 "$LOGS/kernels.txt" | tee -a "$OUT/summary.txt"

echo "== done at t=${SECONDS}s" | tee -a "$OUT/summary.txt"
