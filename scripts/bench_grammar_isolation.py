"""Whether one structured request's grammar work stalls the others
(docs/structured-outputs.md, "Limits").

The engine runs in-process with the fake runner on a wall clock (``step_time_ms`` per
step, so a 100-token stream alone takes about 100 steps of it), the xgrammar backend
over a synthetic word-level tokenizer of 49,152 tokens (SmolLM2's vocabulary size;
compile costs grow with the vocabulary), default ``structured_outputs`` settings.
Each scenario reports the victim's time alone, its time under attack, and the longest
gap between two of its tokens:

1. ``ambiguous``: an unconstrained 100-token stream next to an EBNF grammar whose every
   split of the output into words is a parse (``s ::= s s s | s s | t | ""``), whose
   matcher costs more with every token.
2. ``deep``: an unconstrained stream while a 600-level nested-array JSON schema arrives.
3. ``disconnect``: a ``choice`` request after four regexes that each take about 20 s to
   compile are sent and aborted 1 s later (their clients disconnect), 2 compile workers.

It also times the compile workers (``workers``): a 4-field JSON schema compiled in a
worker process (check, compile, JSON back, deserialize) vs on a thread, medians of 20,
over a synthetic 49,152-token vocabulary; and a worker's first start vs a restart after
a kill.

Usage: PYTHONPATH=. .venv/bin/python scripts/bench_grammar_isolation.py [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError
from schedkit.structured.testing import word_level_tokenizer

AMBIGUOUS = ('root ::= s "w500"\ns ::= s s s | s s | t | ""\nt ::= '
             + " | ".join(f'"w{i}"' for i in range(300)))
SLOW_REGEX = "[^{0}]{{0,20000}}[^{1}]{{0,20000}}"
SCHEMA = ('{"type":"object","properties":{"name":{"type":"string","maxLength":24},'
          '"age":{"type":"integer","minimum":0,"maximum":120},"city":{"type":"string"},'
          '"hobbies":{"type":"array","items":{"type":"string"},"maxItems":3}},'
          '"required":["name","age","city","hobbies"]}')


VOCAB_SIZE = 49152


def deep_schema(levels: int) -> str:
    """A JSON schema of ``levels`` nested arrays around an integer."""
    schema = '{"type":"integer"}'
    for _ in range(levels):
        schema = '{"type":"array","items":' + schema + "}"
    return schema


def make_engine(tokenizer_dir: str, step_time_ms: float) -> EngineCore:
    return EngineCore(config_from_dict({
        "model": {"tokenizer": tokenizer_dir},
        "runner": {"vocab_size": VOCAB_SIZE, "eos_token_id": 0, "clock": "wall", "step_time_ms": step_time_ms},
        "structured_outputs": {"backend": "xgrammar"}}))


def request(rid: str, max_tokens: int, **so: Any) -> Request:
    return Request(rid, [50, 60, 70], SamplingParams(max_tokens=max_tokens, eos_token_id=0, ignore_eos=not so,
                                                  structured_outputs=so or None), 0.0)


def serve(eng: EngineCore, victim: str, limit_s: float, t0: float | None = None) -> tuple[float, float]:
    """Step until the victim (added at ``t0``) finishes; returns (its seconds, its
    longest token gap)."""
    t0 = last = time.monotonic() if t0 is None else t0
    gap = 0.0
    while time.monotonic() - t0 < limit_s:
        for group in eng.step().values():
            for o in group.outputs:
                if o.request_id != victim:
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                if o.finish_reason:
                    return now - t0, gap
        if eng.last_step_empty:
            time.sleep(0.002)
    return float("nan"), float("nan")


def warm(eng: EngineCore) -> None:
    eng.add_request(request("warm", 4, choice=["ok"]))
    serve(eng, "warm", 120)


def scenario(name: str, tokenizer_dir: str, step_time_ms: float) -> dict[str, float]:
    eng = make_engine(tokenizer_dir, step_time_ms)
    warm(eng)
    def victim(run: str) -> Request:  # a choice not seen before: no cache hit
        if name == "disconnect":
            return request("victim", 4, choice=[f"yes-{run}", f"no-{run}"])
        return request("victim", 100)

    eng.add_request(victim("alone"))
    alone, alone_gap = serve(eng, "victim", 60)
    t0 = time.monotonic()
    if name == "ambiguous":
        eng.add_request(request("attacker", 2000, grammar=AMBIGUOUS))
        eng.add_request(victim("attacked"))
    elif name == "deep":
        schema = deep_schema(600)
        eng.add_request(victim("attacked"))
        eng.step()
        t = time.monotonic()
        try:
            eng.add_request(request("attacker", 20, json=schema))
            print(f"  deep schema accepted in {time.monotonic() - t:.3f} s")
        except RequestError as e:
            print(f"  deep schema refused in {time.monotonic() - t:.3f} s: {str(e)[:100]}")
    else:
        slow = [f"slow{i}" for i in range(4)]
        for i, rid in enumerate(slow):
            eng.add_request(request(rid, 20, regex=SLOW_REGEX.format("pqrs"[i], "PQRS"[i])))
        t_sent = time.monotonic()
        while time.monotonic() - t_sent < 1.0:
            eng.step()
            time.sleep(0.002)
        eng.abort_requests(slow)
        t0 = time.monotonic()
        eng.add_request(victim("attacked"))
    attacked, attacked_gap = serve(eng, "victim", 300, t0)
    stats = eng.stats()
    eng.close()
    return {"alone_s": alone, "alone_gap_s": alone_gap, "attacked_s": attacked, "attacked_gap_s": attacked_gap,
            **{k: v for k, v in stats.items() if k.startswith("grammar")}}


def workers() -> None:
    import xgrammar as xgr

    from schedkit.core.compile_pool import CompilePool
    from schedkit.core.grammar import StructuredOutputsParams
    from schedkit.structured.xgrammar_backend import ProcessCompiler, compile_constraint

    tokenizer = word_level_tokenizer(VOCAB_SIZE)
    vocab = tokenizer.convert_ids_to_tokens(list(range(VOCAB_SIZE)))
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    factory = ProcessCompiler(info.serialize_json(), 4, 8)
    compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    params = StructuredOutputsParams(json=SCHEMA)
    t = time.perf_counter()
    pool = CompilePool(lambda p: None, num_workers=1, timeout_s=60, max_queued=10, max_queued_per_owner=10,
                       process_compiler=factory, preload=(ProcessCompiler.__module__,),
                       load=lambda s: xgr.CompiledGrammar.deserialize_json(s, info))
    pool.submit("first", params, 0, "r").result(120)
    first = time.perf_counter() - t
    in_process, in_thread = [], []
    for i in range(20):
        t = time.perf_counter()
        pool.submit(("p", i), params, 0, "r").result(60)
        in_process.append(time.perf_counter() - t)
        t = time.perf_counter()
        compile_constraint(compiler, params, 4)
        in_thread.append(time.perf_counter() - t)
    slow = pool.submit("slow", StructuredOutputsParams(regex=SLOW_REGEX.format("p", "P")), 0, "s")
    time.sleep(0.5)
    pool.release("slow", "s")
    while not slow.cancelled():
        time.sleep(0.001)
    t = time.perf_counter()
    pool.submit("after", params, 0, "r").result(60)
    after_kill = time.perf_counter() - t
    pool.shutdown()
    print(f"  vocabulary {len(vocab)}: JSON schema compile in a worker process {statistics.median(in_process) * 1e3:.1f} ms, "
          f"on a thread {statistics.median(in_thread) * 1e3:.1f} ms (medians of 20)")
    print(f"  first job (zygote start, imports, worker fork, tokenizer info): {first:.2f} s; "
          f"first job after a kill (restart + compile): {after_kill * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", nargs="*", default=["ambiguous", "deep", "disconnect", "workers"])
    ap.add_argument("--step-time-ms", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        word_level_tokenizer(VOCAB_SIZE).save_pretrained(tokenizer_dir)
        for name in args.scenario:
            print(name)
            if name == "workers":
                workers()
                continue
            r = scenario(name, tokenizer_dir, args.step_time_ms)
            print(f"  victim alone {r['alone_s']:.2f} s (longest gap {r['alone_gap_s'] * 1e3:.0f} ms); "
                  f"under attack {r['attacked_s']:.2f} s (longest gap {r['attacked_gap_s'] * 1e3:.0f} ms)")
            print("  " + ", ".join(f"{k} {v}" for k, v in r.items() if k.startswith("grammar")))


if __name__ == "__main__":
    main()
