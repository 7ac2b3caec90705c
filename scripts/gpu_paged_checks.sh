#!/usr/bin/env bash
# The paged runner's GPU checks (issue 5) as ONE prepared run on the H200, results in $OUT.
#
# On the dev machine first:  bash ../shared/gpu/wheels.sh .whl   (pydantic & co, which the
# GPU machine lacks; keep .whl out of git), then run this with .whl carried, e.g.
#   run(command="bash scripts/gpu_paged_checks.sh", carry=[".whl"], timeout_s=540)
# Steps (each time-boxed): versions, GPU tests, kernel speed, schedkit vs the peer on the
# peer's workload (qwen0.5b shape, bf16, 256 requests), decode step at batch 256 x 1024.
# The simulator's calibration is scripts/gpu_lab_calibration.sh (a second call).
set -uo pipefail
OUT=${OUT:-/tmp/paged-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_common.sh"

echo "== GPU tests"
timeout 240 python3 -m pytest tests/gpu/test_paged_gpu.py -m gpu -q -rfEs -s -p no:cacheprovider \
  > "$OUT/gpu_tests.txt" 2>&1
tail -25 "$OUT/gpu_tests.txt"

echo "== kernels"
timeout 90 python3 scripts/bench_paged_kernels.py --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
tail -40 "$OUT/kernels.txt"

echo "== decode step, batch 256 x 1024 context"
timeout 120 python3 scripts/bench_paged.py --model qwen0.5b --device cuda --dtype bfloat16 \
  --decode-step 256,1024 --block-size 16 --json "$OUT/decode_step.json" > "$OUT/decode_step.txt" 2>&1
tail -3 "$OUT/decode_step.txt"

echo "== throughput: schedkit then the peer, same workload and shape"
timeout 150 python3 scripts/bench_paged.py --model qwen0.5b --device cuda --dtype bfloat16 --n 256 \
  --prompt 64,512 --out 128,128 --block-size 32 --max-batch-tokens 2048 \
  --json "$OUT/bench_schedkit.json" > "$OUT/bench_schedkit.txt" 2>&1
tail -3 "$OUT/bench_schedkit.txt"
PEER=""
for d in shared/bench ../shared/bench; do [ -f "$d/bench_hf_cb.py" ] && PEER=$d && break; done
if [ -n "$PEER" ]; then
  (cd "$PEER" && timeout 150 python3 bench_hf_cb.py --model-config qwen0.5b --device cuda --n 256 \
    --prompt 64,512 --out 128,128 --block-size 32 --num-blocks 8192 --max-batch-tokens 2048) \
    > "$OUT/bench_peer.txt" 2>&1
  tail -3 "$OUT/bench_peer.txt"
else
  echo "peer bench not found (shared/bench)" | tee "$OUT/bench_peer.txt"
fi

