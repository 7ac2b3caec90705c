"""Benchmark schedkit's paged runner on the peer's workload (../shared/bench): output
tokens/s, total tokens/s, TTFT and TPOT, printed as one JSON line like bench_hf_cb.py.

Methodology: fixed seeds; random weights of the named shape (seed 0; ``--hf-init`` builds
them with transformers' own initialisation, i.e. the peer's exact weights); one warm-up
request batch; then every request is added at once (offline throughput) and the engine
steps until all finish. TTFT and TPOT come from the wall-clock time of the step that
produced each token.

  python scripts/bench_paged.py --model tiny --device cpu --n 64
  python scripts/bench_paged.py --model qwen0.5b --device cuda --dtype bfloat16 --n 256 \\
      --prompt 64,512 --out 128,128 --block-size 32 --num-blocks 100000 --max-batch-tokens 2048
  python scripts/bench_paged.py --model qwen0.5b --device cuda --dtype bfloat16 --decode-step 256,1024

``--scheduling both`` runs the workload twice in one process, synchronously and with
async scheduling (two steps in flight), one JSON line each; the decode-step figure is
then the steady-state time between consecutive steps' outputs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.runners.paged.builder import build_random_model, tiny_config
from schedkit.runners.paged.loader import cache_dir

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # the peer's CONFIGS, same names
    "tiny": ("llama", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=8, num_kv_heads=2, max_position_embeddings=4096)),
    "smollm135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                 num_layers=30, num_heads=9, num_kv_heads=3,
                                 max_position_embeddings=8192, rope_theta=100000.0,
                                 rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_layers=24, num_heads=14, num_kv_heads=2,
                               max_position_embeddings=32768, rope_theta=1000000.0,
                               tie_word_embeddings=True)),
}


def make_workload(n_req: int, prompt_lo: int, prompt_hi: int, out_lo: int, out_hi: int,
                  vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """Identical to ../shared/bench/workload.py (same seed, same draws)."""
    r = random.Random(seed)
    return [dict(prompt=[r.randrange(10, vocab - 10) for _ in range(r.randint(prompt_lo, prompt_hi))],
                 max_new_tokens=r.randint(out_lo, out_hi)) for _ in range(n_req)]


def model_folder(name: str, dtype: str, hf_init: bool) -> str:
    if name not in SHAPES:
        return name  # a built-in name or a folder
    family, kw = SHAPES[name]
    path = cache_dir() / "bench" / f"{name}-{dtype}{'-hf' if hf_init else ''}"
    if not (path / "config.json").is_file():
        cfg = tiny_config(family, **kw)
        if hf_init:
            from transformers import AutoConfig, AutoModelForCausalLM

            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=getattr(torch, dtype))
            hf.save_pretrained(str(path))
        else:
            build_random_model(path, cfg, seed=0, std=0.02, dtype=getattr(torch, dtype))
    return str(path)


def build_engine(a: argparse.Namespace, max_model_len: int, async_scheduling: bool = False) -> EngineCore:
    return EngineCore(config_from_dict({
        "model": {"name": model_folder(a.model, a.dtype, a.hf_init), "dtype": a.dtype},
        "runner": {"kind": "paged", "device": a.device, "vocab_size": 2, "num_threads": a.threads,
                   "enforce_eager": a.eager},
        "cache": {"block_size": a.block_size, "num_blocks": a.num_blocks,
                  "enable_prefix_caching": False},
        "scheduler": {"max_num_batched_tokens": a.max_batch_tokens, "max_num_seqs": a.max_num_seqs,
                      "max_model_len": max_model_len, "async_scheduling": async_scheduling},
    }))


def run(engine: EngineCore, workload: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    t_start = time.perf_counter()
    for i, w in enumerate(workload):
        engine.add_request(Request(f"{tag}{i}", w["prompt"], SamplingParams(
            max_tokens=w["max_new_tokens"], temperature=0.0), arrival_time=time.monotonic()))
    stamps: dict[str, list[float]] = {}
    num_steps = 0
    while engine.has_requests():
        outs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        for eco in outs.values():
            for o in eco.outputs:
                stamps.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
    wall = time.perf_counter() - t_start
    n_out = sum(len(s) for s in stamps.values())
    n_in = sum(len(w["prompt"]) for w in workload)
    ttft = sorted(s[0] - t_start for s in stamps.values())
    tpot = sorted((s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1)

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    return dict(n=len(stamps), steps=num_steps, wall_s=wall, out_tok_s=n_out / wall,
                total_tok_s=(n_in + n_out) / wall, ttft_p50_s=q(ttft, .5), ttft_p99_s=q(ttft, .99),
                tpot_p50_ms=1e3 * q(tpot, .5))


def _time_calls(obj: Any, name: str, into: list[float]) -> None:
    """Wrap ``obj.name`` so that each call's wall time is appended to ``into``."""
    inner = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        into.append(time.perf_counter() - t)
        return out

    setattr(obj, name, timed)


def decode_step_bench(engine: EngineCore, batch: int, ctx: int, vocab: int, steps: int = 20) -> dict[str, Any]:
    """Median wall time of a decode-only step of ``batch`` requests at ``ctx`` tokens,
    and where it goes: schedule(), the runner's launch (host work and kernel launches;
    on CPU the compute too), waiting for the sampled tokens (on CUDA: the device time
    not hidden behind host work), update_from_output()."""
    wl = make_workload(batch, ctx, ctx, steps + 10, steps + 10, vocab, seed=1)
    for i, w in enumerate(wl):
        engine.add_request(Request(f"d{i}", w["prompt"], SamplingParams(
            max_tokens=w["max_new_tokens"], temperature=0.0), arrival_time=time.monotonic()))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    parts: dict[str, list[float]] = {k: [] for k in ("schedule", "launch", "collect", "update")}
    runner = engine.runner
    _time_calls(engine.scheduler, "schedule", parts["schedule"])
    _time_calls(engine.scheduler, "update_from_output", parts["update"])
    _time_calls(runner, "execute_async", parts["launch"])
    _time_calls(runner, "_collect", parts["collect"])
    if not engine.config.scheduler.async_scheduling:
        runner.execute = lambda so: runner.execute_async(so).result()  # through the timed calls
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    med = {k: 1e3 * statistics.median(v[-steps:]) for k, v in parts.items() if v}
    return dict(decode_batch=batch, context=ctx, step_ms_p50=1e3 * statistics.median(times),
                step_ms_min=1e3 * min(times), **{f"{k}_ms_p50": v for k, v in med.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help=f"{', '.join(SHAPES)}, a built-in name or a folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--prompt", default="64,512")
    ap.add_argument("--out", default="128,128")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="default: what fits on CUDA; the workload's need on CPU")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--hf-init", action="store_true", help="the peer's exact random weights")
    ap.add_argument("--decode-step", default=None, help="BATCH,CONTEXT: time decode steps only")
    ap.add_argument("--scheduling", choices=["sync", "async", "both"], default="sync",
                    help="async: two steps in flight (scheduler.async_scheduling)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    pl, ph = map(int, a.prompt.split(","))
    oh = int(a.out.split(",")[1])
    if a.num_blocks is None:
        need = a.max_num_seqs * -(-(ph + oh + 16) // a.block_size) + 1
        a.num_blocks = 10**7 if a.device == "cuda" else need
    modes = ["sync", "async"] if a.scheduling == "both" else [a.scheduling]
    results = []
    for mode in modes:
        results.append(bench_one(a, pl, ph, oh, mode == "async"))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results[-1].items()}))
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(json.dumps(results if len(results) > 1 else results[0]))


def bench_one(a: argparse.Namespace, pl: int, ph: int, oh: int, async_scheduling: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    if a.decode_step:
        batch, ctx = map(int, a.decode_step.split(","))
        if a.device == "cpu":
            a.num_blocks = batch * -(-(ctx + 64) // a.block_size) + 1
        a.max_num_seqs = max(a.max_num_seqs, batch)
        a.max_batch_tokens = max(a.max_batch_tokens, batch)
        engine = build_engine(a, ctx + 64, async_scheduling)
        result = decode_step_bench(engine, batch, ctx, engine.runner.args.vocab_size)
    else:
        engine = build_engine(a, ph + oh + 16, async_scheduling)
        vocab = engine.runner.args.vocab_size
        build_s = time.perf_counter() - t0
        run(engine, make_workload(4, 32, 32, 8, 8, vocab, seed=99), "warm")
        result = dict(build_s=build_s, **run(engine, make_workload(a.n, pl, ph, *map(int, a.out.split(",")), vocab), "r"))
    threads = torch.get_num_threads() if a.device == "cpu" else None
    del engine
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return dict(engine="schedkit-paged", model=a.model, device=a.device, dtype=a.dtype, threads=threads,
                scheduling="async" if async_scheduling else "sync", **result)


if __name__ == "__main__":
    main()
