#!/usr/bin/env bash
# schedkit serve side by side with vLLM 0.32's OpenAI server on this CPU: the same model
# folder (SmolLM2-135M-Instruct), dtype DTYPE, max_model_len 2048, max_num_seqs 64,
# max_num_batched_tokens 2048 (vLLM's CPU server default), prefix caching on, THREADS
# compute threads each, both measured by vLLM's own load generator
# (`vllm bench serve --backend openai --dataset-name random --ignore-eos`) at each request
# rate, each rate with its own seed (1, 2, ...) so that no rate finds its prompts cached
# by the one before. Both servers are started first and stay up; at each rate vLLM is
# measured, then schedkit, so drift in the machine's speed hits both alike. One JSON file
# per run goes to OUT (vLLM's --save-result format), one summary line per run to
# OUT/summary.jsonl.
#
# ORDER=abba measures each rate twice, mirrored: vLLM then schedkit on the rate's seed,
# then schedkit then vLLM on a second seed (rate seed + 100), so that a drift in the
# machine's speed that is linear over the four runs costs both servers alike (this VM's
# speed moves by 10-40% over minutes). It then adds one pooled line per server and rate
# ("pooled": true): the percentiles over both runs' requests together, throughput the
# mean of the two.
#
#   bash scripts/bench_serve_vs_vllm.sh [OUT] [VLLM_VENV] [MODEL_DIR]
#
# Env: RATES (default "0.25 0.5 1 inf"), ORDER (ab, or abba), N prompts per rate (16), IN / OUT_LEN tokens
# (128 / 32), DTYPE (bfloat16, or float32), THREADS (1: vLLM then keeps the second core
# for its front end, as ../shared/bench/vllm_serve.sh runs it; 2: both cores compute).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-serve-vs-vllm}
VENV=${2:-../vllm-venv}
MODEL=${3:-${SCHEDKIT_CACHE_DIR:-$HOME/.cache/schedkit}/models/smollm2-135m-instruct}
PY=${PYTHON:-.venv/bin/python}
RATES=${RATES:-"0.25 0.5 1 inf"}
N=${N:-16}
IN=${IN:-128}
OUT_LEN=${OUT_LEN:-32}
THREADS=${THREADS:-1}
ORDER=${ORDER:-ab}
case "$ORDER" in ab | abba) ;; *) echo "ORDER is ab or abba, not '$ORDER'" >&2; exit 2 ;; esac
DTYPE=${DTYPE:-bfloat16}
VPORT=8811
SPORT=8812
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$THREADS" = 1 ]; then bind=0; reserved=1; else bind="0-$((THREADS - 1))"; reserved=0; fi

cat > "$OUT/schedkit-serve.yaml" <<EOF
model: {name: $MODEL, dtype: $DTYPE}
runner: {kind: paged, device: cpu, vocab_size: 49152, eos_token_id: 2, num_threads: $THREADS}
cache: {block_size: 16, num_blocks: 4096, enable_prefix_caching: true}
scheduler: {policy: fcfs, max_num_batched_tokens: 2048, max_num_seqs: 64, max_model_len: 2048}
server: {port: $SPORT, served_model_name: smollm2}
EOF

# On an AVX-512 CPU the first schedkit process probes whether its multi-row GEMM or oneDNN
# is the faster and keeps the verdict (docs/model-runner.md): take it now, on a quiet
# machine, rather than in the server while vLLM loads beside it.
"$PY" -c "import torch; torch.set_num_threads($THREADS)
from schedkit.runners.paged import cpu_kernels, cpu_linear
if cpu_kernels.load_cpu_kernels() is not None:
    print('multi-row float32 GEMM:', 'schedkit' if cpu_linear.multi_row_gemm(torch.float32) else 'oneDNN')"

VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=$bind VLLM_CPU_NUM_OF_RESERVED_CPU=$reserved \
  "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype "$DTYPE" \
  --host 127.0.0.1 --port $VPORT --max-model-len 2048 --max-num-seqs 64 --served-model-name smollm2 \
  > "$OUT/vllm-serve.log" 2>&1 &
VPID=$!
"$PY" -m schedkit.cli serve "$OUT/schedkit-serve.yaml" > "$OUT/schedkit-serve.log" 2>&1 &
SPID=$!
trap 'kill $VPID $SPID 2>/dev/null || true' EXIT
for port in $VPORT $SPORT; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server on $port did not start"; exit 1; }
done

bench() {  # bench NAME PORT RATE SEED [SUFFIX of the file names]
  local tag="$1-rate$3${5:-}"
  curl -s "http://127.0.0.1:$2/metrics" > "$OUT/$tag.metrics-before.txt"
  VENV=$VENV bash ../shared/bench/vllm_serve.sh bench "http://127.0.0.1:$2" smollm2 "$MODEL" \
    --request-rate "$3" --num-prompts "$N" --random-input-len "$IN" --random-output-len "$OUT_LEN" \
    --seed "$4" --save-detailed \
    --save-result --result-dir "$OUT" --result-filename "$tag.json" > "$OUT/$tag.txt" 2>&1
  curl -s "http://127.0.0.1:$2/metrics" > "$OUT/$tag.metrics-after.txt"
  "$PY" - "$OUT/$tag" "$1" "$3${5:-}" <<'PY'
import json, sys
from prometheus_client.parser import text_string_to_metric_families

def sums(path):  # histogram name (no prefix) -> (sum, count), over all label sets
    out = {}
    for fam in text_string_to_metric_families(open(path).read()):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            for suffix in ("_sum", "_count"):
                if name.endswith("_seconds" + suffix):
                    key = name[: -len(suffix)]
                    total, count = out.get(key, (0.0, 0.0))
                    out[key] = (total + s.value, count) if suffix == "_sum" else (total, count + s.value)
    return out

base = sys.argv[1]
r = json.load(open(base + ".json"))
line = {"server": sys.argv[2], "rate": sys.argv[3], "completed": r["completed"],
        "out_tok_per_s": round(r["output_throughput"], 1),
        "ttft_p50_ms": round(r["median_ttft_ms"], 1), "ttft_mean_ms": round(r["mean_ttft_ms"], 1), "ttft_p99_ms": round(r["p99_ttft_ms"], 1),
        "tpot_p50_ms": round(r["median_tpot_ms"], 1), "itl_p50_ms": round(r["median_itl_ms"], 1)}
# The server's own view, mean per request over this run: where a TTFT goes (queue wait,
# prefill) and what the server counts as TTFT (the rest of the client's is HTTP + tokenizing).
before, after = sums(base + ".metrics-before.txt"), sums(base + ".metrics-after.txt")
for key, short in (("time_to_first_token_seconds", "srv_ttft"), ("request_queue_time_seconds", "srv_queue"),
                   ("request_prefill_time_seconds", "srv_prefill")):
    if key in after:
        total = after[key][0] - before.get(key, (0.0, 0.0))[0]
        count = after[key][1] - before.get(key, (0.0, 0.0))[1]
        if count:
            line[short + "_mean_ms"] = round(1000 * total / count, 1)
print(json.dumps(line))
PY
}

# one warm-up request each (first-call compilation and caches)
for port in $VPORT $SPORT; do
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "Hello", "max_tokens": 8}' > /dev/null
done
pooled() {  # pooled NAME RATE: one line over NAME-rateRATE.json and NAME-rateRATE-b.json
  "$PY" - "$OUT/$1-rate$2" "$1" "$2" <<'PY'
import json, statistics, sys
runs = [json.load(open(sys.argv[1] + suffix + ".json")) for suffix in ("", "-b")]
# the requests that succeeded (vLLM's own statistics skip the others too)
ok = [(t, lat, n) for r in runs for t, lat, n, err in zip(r["ttfts"], r["latencies"], r["output_lens"], r["errors"])
      if not err]
ttft = sorted(t for t, _, _ in ok)
# TPOT as vLLM's load generator defines it: (latency - TTFT) / (output tokens - 1)
tpot = sorted((lat - t) / (n - 1) for t, lat, n in ok if n > 1)

def pct(xs, p):  # numpy's default (linear) percentile, as vLLM reports; 0 for none, as vLLM
    if not xs:
        return 0.0
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)

print(json.dumps({"server": sys.argv[2], "rate": sys.argv[3], "pooled": True,
                  "completed": sum(r["completed"] for r in runs), "failed": sum(r["failed"] for r in runs),
                  "out_tok_per_s": round(statistics.mean(r["output_throughput"] for r in runs), 1),
                  "ttft_p50_ms": round(1e3 * pct(ttft, 50), 1), "ttft_p99_ms": round(1e3 * pct(ttft, 99), 1),
                  "tpot_p50_ms": round(1e3 * pct(tpot, 50), 1)}))
PY
}

# A seed per rate: the prompts of one rate are not in the prefix cache from the last one.
seed=0
for rate in $RATES; do
  seed=$((seed + 1))
  bench vllm $VPORT "$rate" $seed | tee -a "$OUT/summary.jsonl"
  bench schedkit $SPORT "$rate" $seed | tee -a "$OUT/summary.jsonl"
  if [ "$ORDER" = abba ]; then
    bench schedkit $SPORT "$rate" $((seed + 100)) -b | tee -a "$OUT/summary.jsonl"
    bench vllm $VPORT "$rate" $((seed + 100)) -b | tee -a "$OUT/summary.jsonl"
    pooled vllm "$rate" | tee -a "$OUT/summary.jsonl"
    pooled schedkit "$rate" | tee -a "$OUT/summary.jsonl"
  fi
done
