"""Answer a few chat prompts with SmolLM2-135M-Instruct through schedkit's scheduler and
the paged runner (CPU by default), and print the text and the throughput.

Usage: python scripts/smollm2_demo.py [--config configs/smollm2.yaml] [--max-tokens 64]
       [--temperature 0] [PROMPT ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from schedkit.config import load_config
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to program.",
    "Explain in one sentence what a GPU is.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", default=PROMPTS)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    config = load_config(a.config)
    t0 = time.perf_counter()
    engine = EngineCore(config)
    tokenizer = AutoTokenizer.from_pretrained(str(engine.runner.model_path))
    print(f"model loaded from {engine.runner.model_path} in {time.perf_counter() - t0:.1f} s")
    eos = engine.runner.args.eos_token_ids
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(a.prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                seed=a.seed + i, eos_token_id=eos[0] if eos else None)
        engine.add_request(Request(str(i), list(ids), params, arrival_time=time.monotonic()))
        outputs[str(i)] = []
    t0 = time.perf_counter()
    while engine.has_requests():
        for eco in engine.step().values():
            for out in eco.outputs:
                outputs[out.request_id].extend(out.new_token_ids)
    wall = time.perf_counter() - t0
    for i, prompt in enumerate(a.prompts):
        text = tokenizer.decode(outputs[str(i)], skip_special_tokens=True)
        print(f"\n>>> {prompt}\n{text.strip()}")
    num_out = sum(len(v) for v in outputs.values())
    print(f"\n{len(a.prompts)} requests, {num_out} output tokens in {wall:.2f} s "
          f"({num_out / wall:.1f} tokens/s, {engine.num_steps} steps)")


if __name__ == "__main__":
    main()
