#!/usr/bin/env bash
# The paged runner on CPU side by side with vLLM 0.32's CPU backend: the four rows of
# docs/results.md ("Model runner on CPU against vLLM"), run one after the other on this
# machine, vLLM first in each pair, REPS pairs per row (alternating, so drift in the
# machine's speed hits both sides alike). One JSON line per run goes to OUT.
#
#   bash scripts/bench_cpu_vs_vllm.sh [OUT] [VLLM_PYTHON] [MODEL_DIR]
#
# Defaults: OUT=bench-cpu-vs-vllm.jsonl, VLLM_PYTHON=../vllm-venv/bin/python (install it
# as ../shared/bench/vllm_cpu.py's header says), MODEL_DIR the converted
# SmolLM2-135M-Instruct (`python scripts/smollm2_demo.py` converts it once). REPS (env,
# default "2 2 1 1") sets the pairs per row.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-cpu-vs-vllm.jsonl}
VPY=${2:-../vllm-venv/bin/python}
MODEL=${3:-${SCHEDKIT_CACHE_DIR:-$HOME/.cache/schedkit}/models/smollm2-135m-instruct}
PY=${PYTHON:-.venv/bin/python}
read -r -a REPS <<< "${REPS:-2 2 1 1}"
ROWS=(
  "32 64,256 64 float32 1"
  "32 64,256 64 float32 2"
  "32 64,256 64 bfloat16 2"
  "64 64,512 128 bfloat16 2"
)
: > "$OUT"
for i in "${!ROWS[@]}"; do
  read -r n prompt out dtype threads <<< "${ROWS[$i]}"
  bind=$([ "$threads" = 1 ] && echo 0 || echo "0-$((threads - 1))")
  for _ in $(seq "${REPS[$i]}"); do
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=$bind VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      "$VPY" scripts/bench_vllm_cpu.py "$MODEL" --n "$n" --prompt "$prompt" --out "$out" \
      --dtype "$dtype" 2>/dev/null | grep '^{' | sed "s/^{/{\"row\": $((i + 1)), \"threads\": $threads, /" >> "$OUT"
    "$PY" scripts/bench_paged.py --model "$MODEL" --device cpu --dtype "$dtype" --n "$n" \
      --prompt "$prompt" --out "$out,$out" --threads "$threads" 2>/dev/null | grep '^{' \
      | sed "s/^{/{\"row\": $((i + 1)), /" >> "$OUT"
    tail -2 "$OUT"
  done
done
