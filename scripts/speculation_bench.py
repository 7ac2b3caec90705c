"""Speculative decoding on SmolLM2-135M-Instruct (paged runner, CPU): acceptance rate and
output tokens/s of each model-free proposer against no speculation, on repetitive work
(code edits, JSON) and on chat, one request at a time and with every request at once.

Loads: ``1``, one request at a time; ``all``, the workload's requests at once; ``full``,
the server at its busiest: twice ``max_num_seqs`` distinct requests (each workload's
prompts varied, :func:`busy_prompts`) at once, half of them queued, so that a request
that finishes early is replaced at once, as on a saturated server, until the queue runs
out. (In a batch that only drains, the run lasts as long as its slowest request, which
hides what speculation does for the others.)

Each (workload, load) cell runs every mode in turn, ``--repeats`` times in rounds
(A B C ... A B C ...), so the machine's drift spreads over all of them; greedy
decoding, so every mode produces the same text (checked). Every run starts with an
empty proposer (suffix decoding's shared tree learns from that run's finished requests
only). Modes:

* ``off``: no drafts;
* ``ngram`` / ``suffix``: ``--k`` drafts for every request every step;
* ``ngram+policy`` / ``suffix+policy``: as many as ``speculate-by-acceptance`` gives;
* ``draft`` / ``draft+policy``: the model's own first ``--draft-layers`` layers drafting
  (``speculative_method: draft_model``), always or by the policy.

Usage: python scripts/speculation_bench.py [--k 4] [--max-tokens 96] [--repeats 2]
       [--workloads code-edit,json,chat] [--loads 1,all,full] [-o speculation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from schedkit.config import config_from_dict, load_config
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.runners.drafting import make_proposer

ROOT = Path(__file__).resolve().parents[1]

CODE = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)\n",
]
EDITS = ["Rename the function to a clearer name and add type hints.",
         "Add a docstring and keep everything else the same."]
MORE_EDITS = ["Add a comment above every line that is not obvious.",
              "Make it raise a ValueError on empty or invalid input.",
              "Rewrite it with clearer variable names.",
              "Add a short usage example as a doctest in a docstring.",
              "Add type hints only; change nothing else.",
              "Add logging of its inputs with the logging module."]
PEOPLE = [("Ada", 36, "London"), ("Linus", 54, "Portland"), ("Grace", 85, "Arlington"),
          ("Alan", 41, "Manchester"), ("Barbara", 83, "Boston")]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Give me three tips for learning to program.", "Explain in one sentence what a GPU is.",
        "Why is the sky blue?", "Suggest a name for a cat.", "What should I cook tonight?",
        "How do bees make honey?"]


def _code_prompts(edits: list[str]) -> list[str]:
    return [f"{edit}\n\n```python\n{code}```" for code in CODE for edit in edits]


def _json_prompt(start: int, length: int, keys: str = "name, age and city") -> str:
    """Ask for ``length`` people of :data:`PEOPLE`, from the ``start``-th on, as JSON."""
    rows = PEOPLE[start:] + PEOPLE[:start]
    listing = "\n".join(f"- {n}, age {a}, lives in {c}" for n, a, c in rows[:length])
    return f"Write these people as a JSON list of objects with the keys {keys}:\n{listing}"


def workload_prompts(name: str) -> list[str]:
    if name == "code-edit":
        return _code_prompts(EDITS)
    if name == "json":
        return [_json_prompt(i % 5, 3 + i % 3) for i in range(6)]
    if name == "chat":
        return list(CHAT)
    raise SystemExit(f"unknown workload {name!r}")


CHAT_STYLES = ["", " Answer in one sentence.", " Explain it to a ten-year-old.", " Answer as a short list."]


def busy_prompts(name: str, count: int) -> list[str]:
    """``count`` distinct prompts of workload ``name`` for the busiest load (cycled if it
    has fewer): each code snippet under more kinds of edit, each chat question asked in
    more ways, each JSON listing in more orders and lengths. Distinct, so that no request
    is the copy of an earlier one whose output suffix decoding's shared tree already
    holds."""
    if name == "code-edit":
        prompts = _code_prompts(EDITS + MORE_EDITS)
    elif name == "chat":
        prompts = [q + style for style in CHAT_STYLES for q in CHAT]
    elif name == "json":
        orders = ("name, age and city", "city, name and age", "age, city and name")
        prompts = [_json_prompt(i % 5, 3 + (i // 5) % 3, orders[i // 15]) for i in range(45)]
    else:
        raise SystemExit(f"unknown workload {name!r}")
    return [prompts[i % len(prompts)] for i in range(count)]


MODES: dict[str, tuple[str, bool]] = {
    "off": ("ngram", False), "ngram": ("ngram", False), "suffix": ("suffix", False),
    "ngram+policy": ("ngram", True), "suffix+policy": ("suffix", True),
    "draft": ("draft_model", False), "draft+policy": ("draft_model", True)}
DEFAULT_MODES = "off,ngram,suffix,ngram+policy,suffix+policy"


POLICY_SETTINGS = {"draft_cost": 0.04, "min_acceptance": 0.1}
"""speculate-by-acceptance as tuned for SmolLM2 on two CPU threads (docs/policies.md)."""
DRAFT_POLICY_SETTINGS = {"draft_cost": 0.4, "min_acceptance": 0.1, "prior": 0.2, "pooled_prior": True}
"""The same for a draft model: a draft costs about 0.4 of a step (eight of SmolLM2's 30
layers and its whole LM head), a draft model is not trusted before it has shown what
it is worth (prior 0.2), and one that does not fit the workload stops being tried on
each new request."""


def mode_config(base: dict[str, Any], mode: str, k: int, draft_layers: int = 8) -> dict[str, Any]:
    data = json.loads(json.dumps(base))
    method, policy = MODES[mode]
    data["runner"]["speculative_method"] = method
    if method == "draft_model":
        data["runner"]["draft_model"] = {"num_layers": draft_layers}
    data["scheduler"]["num_speculative_tokens"] = 0 if mode == "off" else k
    settings = DRAFT_POLICY_SETTINGS if method == "draft_model" else POLICY_SETTINGS
    data["plugins"] = [{"name": "speculate-by-acceptance", "settings": settings}] if policy else []
    return data


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int, eos: int | None,
        at_once: bool) -> dict[str, Any]:
    """Serve ``prompts`` (all at once, or one after the other) and measure. The proposer
    starts empty: suffix decoding's shared tree learns only from this run's finished
    requests, not from an earlier run of the same prompts, and the prefix cache starts
    empty (every run computes its prompts)."""
    engine.runner.options.proposer = make_proposer(engine.config.runner)
    assert engine.reset_prefix_cache(), "a run starts with no request in the engine"
    tokens: dict[str, list[int]] = {}
    drafted = accepted = misses = 0

    def serve(batch: list[tuple[str, list[int]]]) -> None:
        nonlocal drafted, accepted, misses
        reqs = []
        for rid, ids in batch:
            r = Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, eos_token_id=eos),
                        arrival_time=engine.now())
            engine.add_request(r)
            reqs.append(r)
            tokens[rid] = []
        while engine.has_requests():
            for group in engine.step().values():
                for o in group.outputs:
                    tokens[o.request_id] += o.new_token_ids
        for r in reqs:
            drafted += r.num_draft_tokens
            accepted += r.num_accepted_tokens
            misses += r.num_draft_misses

    items = [(str(i), ids) for i, ids in enumerate(prompts)]
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    if at_once:
        serve(items)
    else:
        for item in items:
            serve([item])
    wall = time.perf_counter() - t0
    out_tokens = sum(len(t) for t in tokens.values())
    return {"wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
            "steps": engine.num_steps - steps0, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2.yaml"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="code-edit,json,chat")
    ap.add_argument("--loads", default="1,all", help="1: one request at a time; all: every request at once; "
                                                      "full: twice max_num_seqs distinct requests at once, "
                                                      "half of them queued (the server at its busiest)")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help=f"of {', '.join(MODES)} (draft: the model's first --draft-layers layers drafting)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("-o", "--output", default="speculation.json")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    base = load_config(a.config).model_dump(mode="json", exclude={"compare", "workload"})
    modes = a.modes.split(",")
    engines = {m: EngineCore(config_from_dict(mode_config(base, m, a.k, a.draft_layers))) for m in modes}
    first = engines[modes[0]]
    tokenizer = AutoTokenizer.from_pretrained(str(first.runner.model_path))
    eos_ids = first.runner.args.eos_token_ids
    eos = eos_ids[0] if eos_ids else None
    results: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    def encode(texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
        return out

    for workload in a.workloads.split(","):
        for load in a.loads.split(","):
            if load not in ("1", "all", "full"):
                raise SystemExit(f"--loads takes 1, all and full, not {load!r}")
            if load == "full":  # every slot busy, a queue behind them
                batch = encode(busy_prompts(workload, 2 * first.config.scheduler.max_num_seqs))
            else:
                batch = encode(workload_prompts(workload))
            cell = f"{workload}/" + {"1": "batch 1", "all": "all at once", "full": f"{len(batch)} at once, queued"}[load]
            for rep in range(a.repeats):
                for m in modes:
                    r = run(engines[m], batch, a.max_tokens, eos, at_once=load != "1")
                    results[cell][m].append(r)
                    acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                    print(f"{cell:24} {m:14} rep {rep + 1}: {r['tokens_per_s']:6.1f} tok/s, "
                          f"acceptance {acc}, {r['steps']} steps", flush=True)
            reference = results[cell]["off" if "off" in modes else modes[0]][0]["tokens"]
            for m in modes:
                for r in results[cell][m]:
                    assert r["tokens"] == reference, f"{cell} {m}: greedy output differs"
    summary = {}
    lines = ["| workload / load | mode | output tok/s (runs) | vs off | acceptance | drafts accepted / proposed |",
             "|---|---|--:|--:|--:|--:|"]
    for cell, by_mode in results.items():
        off = statistics.fmean(r["tokens_per_s"] for r in by_mode["off"]) if "off" in by_mode else None
        for m, runs in by_mode.items():
            tps = [r["tokens_per_s"] for r in runs]
            mean = statistics.fmean(tps)
            drafted = sum(r["drafted"] for r in runs)
            accepted = sum(r["accepted"] for r in runs)
            summary.setdefault(cell, {})[m] = {"tokens_per_s": tps, "drafted": drafted, "accepted": accepted}
            rel = f"{mean / off:.2f}x" if off else "-"
            acc = f"{accepted / drafted:.2f}" if drafted else "-"
            lines.append(f"| {cell} | {m} | {mean:.1f} ({', '.join(f'{x:.1f}' for x in tps)}) | {rel} | {acc} | "
                         f"{accepted} / {drafted} |")
    print("\n".join(lines))
    Path(a.output).write_text(json.dumps({"k": a.k, "max_tokens": a.max_tokens, "repeats": a.repeats,
                                          "date": time.strftime("%Y-%m-%d"), "summary": summary,
                                          "table": lines}, indent=1) + "\n")


if __name__ == "__main__":
    main()
