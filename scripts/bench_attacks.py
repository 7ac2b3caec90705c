"""What each attack on a live ``schedkit serve`` costs its other clients, and what a
thousand of them leave behind.

Method: the server runs in its own process (its engine in a third) on the fake runner
with a wall clock (``--step-ms``, 10 ms steps by default), the xgrammar backend over a
word-level tokenizer of 49,152 tokens built here (SmolLM2's vocabulary size: compile
costs grow with it; ``max_model_len`` 2048) and an API key. Two victims authenticate:
an unconstrained 100-token stream (a token-id prompt, EOS ignored) and, 0.2 s after it,
a small structured request (a text prompt, a ``choice`` of two words never asked for
before, so compiled fresh). "Alone" is the median of three runs of both without an
attack; then each attack starts 0.2 s into the stream (the structured victim 0.2 s
after it), from its own connections, while a prober sends ``GET /health`` every 20 ms.
An attack holds when the stream takes at most 2x its time alone and the structured
request at most 2 s more than alone. The attacks (``attack_kit.timed_attacks``):

1. an ambiguous EBNF grammar (``s ::= s s s | s s | t | ""``, 300 words), and the regex
   ``(a*)*b``; 2. a 600-level nested-array JSON schema; 3. four clients each sending a
   regex that takes about 20 s to compile and disconnecting after 1 s; 4. a 48 MB
   request line, 48 MB of one header, headers at a byte per 100 ms (unauthenticated);
5. bodies: 5 MB with an escaped lone surrogate after a million strings, 8 MB token-id
   prompt, 8 MB of ``stop_token_ids``, 8 MB to ``/detokenize``, three 8 MB text prompts;
6. a prompt with a surrogate's raw UTF-8 bytes; 7. a process that reads the engine's
   socket address from its ``/proc`` command line and sends ``shutdown`` there without
   the key. The grammar and body attacks authenticate (a key does not make a client
   harmless); the others need none.

Then the soak (``--soak N``, 1,000): N attacks of :data:`SOAK_MIX`, shuffled, 8 at a time
(the bodies of 5 MB and more one at a time, so their peak is the warm-up's). Before it, a
warm-up: 100 of the same mix, then 5 MB bodies of a million strings until the server's
RSS stops climbing (:func:`warm_up` says why), so that first-use allocations and the
allocator's high-water mark are not counted. Before
and after it, once the server is idle (no request running, waiting or compiling; the
open fds unchanged over 1.5 s): the RSS and open fds of the server and the engine process,
``schedkit:kv_cache_usage_perc`` and the request gauges from ``/metrics``; afterwards the
victims once more, to show both processes still serve.

    python scripts/bench_attacks.py                       # all attacks, then the soak
    python scripts/bench_attacks.py --attacks deep-schema,slow-headers --soak 0
    python scripts/bench_attacks.py --json attacks.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from attack_kit import (
    Target,
    choice_once,
    metrics,
    num_fds,
    probe_health,
    rss_mib,
    start_server,
    stream_once,
    text_prompts,
    timed_attacks,
)

ATTACK_AT_S = 0.2
SOAK_MIX: dict[str, int] = {
    "engine-socket-shutdown": 25, "surrogate-bytes": 20, "deep-schema": 10, "request-line-48mb": 10,
    "headers-48mb": 10, "ambiguous-grammar": 5, "nested-star-regex": 5, "slow-regexes-4x": 4,
    "slow-headers": 2, "surrogate-escape-5mb": 2, "token-id-prompt-8mb": 2, "stop_token_ids-8mb": 2,
    "detokenize-8mb": 2, "text-prompt-8mb": 1,
}
"""Soak attacks of each kind per 100 (``slow-regexes-4x`` comes in fours)."""
ONE_AT_A_TIME = {"surrogate-escape-5mb", "token-id-prompt-8mb", "stop_token_ids-8mb", "detokenize-8mb",
                 "text-prompt-8mb"}
WARM_UP = 100
WARM_UP_BODY = "surrogate-escape-5mb"
MAX_WARM_UP_BODIES = 150
SOAK_THREADS = 8


# -- each attack against the victims -----------------------------------------------------------
def one_round(t: Target, attack: Callable[[Target], str] | None) -> dict[str, Any]:
    """The victims, with ``attack`` started 0.2 s into the stream (or none)."""
    server0, engine0 = rss_mib(t.proc.pid), rss_mib(t.engine_pid)
    worst = {"health_s": 0.0, "server_mib": server0, "engine_mib": engine0}
    stop, got = threading.Event(), {}

    def record(key: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            try:
                got[key] = fn()
            except Exception as e:  # a victim that failed is a result, not a crash
                got[key] = f"{type(e).__name__}: {e}"
        return run
    threads = [threading.Thread(target=probe_health, args=(t, stop, worst))]
    timers = [threading.Timer(2 * ATTACK_AT_S, record("choice_s", lambda: choice_once(t)))]
    if attack is not None:
        timers.append(threading.Timer(ATTACK_AT_S, record("answer", lambda: attack(t))))
    for th in threads + timers:
        th.start()
    record("stream_s", lambda: stream_once(t))()
    for th in timers:
        th.join()
    stop.set()
    threads[0].join()
    return {**got, "health_max_ms": round(worst["health_s"] * 1e3),
            "server_mib": [round(server0), round(worst["server_mib"]), round(rss_mib(t.proc.pid))],
            "engine_mib": [round(engine0), round(worst["engine_mib"]), round(rss_mib(t.engine_pid))]}


def alone(t: Target) -> dict[str, float]:
    runs = [one_round(t, None) for _ in range(3)]
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in ("stream_s", "choice_s")}


def judged(row: dict[str, Any], base: dict[str, float]) -> dict[str, Any]:
    """``row`` with its bounds checked: the stream within 2x alone, the structured request
    within 2 s of alone."""
    stream, choice = row["stream_s"], row["choice_s"]
    if not isinstance(stream, float) or not isinstance(choice, float):
        return {**row, "holds": False}
    row["stream_vs_alone"] = round(stream / base["stream_s"], 2)
    row["choice_minus_alone_s"] = round(choice - base["choice_s"], 2)
    row["holds"] = row["stream_vs_alone"] <= 2 and row["choice_minus_alone_s"] <= 2
    row["stream_s"], row["choice_s"] = round(stream, 2), round(choice, 2)
    return row


# -- the soak --------------------------------------------------------------------------------------
def soak_attacks() -> dict[str, Callable[[Target], str]]:
    table = timed_attacks()
    del table["text-prompts-3x8mb"]
    return {**table, "text-prompt-8mb": lambda t: text_prompts(t, 1)}


def soak_schedule(n: int, seed: int) -> list[str]:
    """``n`` attacks of :data:`SOAK_MIX` (kinds of four counted four times), shuffled."""
    kinds: list[str] = []
    for kind, per_100 in SOAK_MIX.items():
        size = 4 if kind.endswith("-4x") else 1
        kinds += [kind] * round(n * per_100 / 100 / size)
    random.Random(seed).shuffle(kinds)
    return kinds


def run_soak(t: Target, kinds: list[str]) -> dict[str, dict[str, int]]:
    """Every attack of ``kinds``, ``SOAK_THREADS`` at a time; what each kind got."""
    table, one_at_a_time = soak_attacks(), threading.Lock()
    answers: dict[str, Counter[str]] = {k: Counter() for k in SOAK_MIX}

    def run(kind: str) -> None:
        if kind in ONE_AT_A_TIME:
            with one_at_a_time:
                answers[kind][table[kind](t)] += 1
        else:
            answers[kind][table[kind](t)] += 1
    with ThreadPoolExecutor(SOAK_THREADS) as pool:
        for f in [pool.submit(run, k) for k in kinds]:
            f.result()
    return {k: dict(v) for k, v in answers.items() if v}


def snapshot(t: Target, limit_s: float = 120.0) -> dict[str, Any]:
    """The resources of the server and the engine once the server is idle: no request
    running, waiting or compiling, and the fd counts unchanged over 1.5 s."""
    deadline, last, same = time.monotonic() + limit_s, None, 0
    while time.monotonic() < deadline and same < 3:
        m = metrics(t)
        busy = sum(m.get(f"schedkit:{g}", 0) for g in ("num_requests_running", "num_requests_waiting",
                                                         "num_requests_waiting_for_grammar"))
        time.sleep(0.5)
        fds = (num_fds(t.proc.pid), num_fds(t.engine_pid))
        same = same + 1 if fds == last and not busy else 0
        last = fds
    m = metrics(t)
    time.sleep(0.5)
    return {"server_rss_mib": round(rss_mib(t.proc.pid), 1), "engine_rss_mib": round(rss_mib(t.engine_pid), 1),
            "server_fds": num_fds(t.proc.pid), "engine_fds": num_fds(t.engine_pid),
            **{k.removeprefix("schedkit:"): m.get(k, float("nan"))
               for k in ("schedkit:kv_cache_usage_perc", "schedkit:num_requests_running",
                         "schedkit:num_requests_waiting", "schedkit:num_requests_waiting_for_grammar",
                         "schedkit:engine_healthy", "schedkit:engine_refused_connections_total")}}


def warm_up(t: Target) -> int:
    """A round of the mix, then 5 MB bodies of a million strings, ten at a time, until
    the server's RSS climbs less than 1 MiB over each of two tens; returns how many it
    took.

    Decoding such a body fills some 60 MiB of the interpreter's small-object arenas, and
    the objects other threads allocate meanwhile (the event loop's) pin some of them:
    the server's RSS climbs about 1 MiB a body until it holds one decode's worth, then
    stays there (reused by the next decode; ``gc.collect`` gives none of it back)."""
    run_soak(t, soak_schedule(WARM_UP, 1))
    flat, rss = 0, rss_mib(t.proc.pid)
    for i in range(1, MAX_WARM_UP_BODIES // 10 + 1):
        run_soak(t, [WARM_UP_BODY] * 10)
        time.sleep(1.0)
        rss, last = rss_mib(t.proc.pid), rss
        flat = flat + 1 if rss - last < 1 else 0
        if flat == 2:
            return 10 * i
    return MAX_WARM_UP_BODIES


def soak(t: Target, n: int) -> dict[str, Any]:
    bodies = warm_up(t)
    before = snapshot(t)
    t0 = time.monotonic()
    answers = run_soak(t, soak_schedule(n, 2))
    took = time.monotonic() - t0
    after = snapshot(t)
    still = one_round(t, None)
    alive = t.proc.poll() is None and Path(f"/proc/{t.engine_pid}").exists()
    leaks = {"server_rss_mib": after["server_rss_mib"] - before["server_rss_mib"] > 5,
             "engine_rss_mib": after["engine_rss_mib"] - before["engine_rss_mib"] > 5,
             "server_fds": after["server_fds"] != before["server_fds"],
             "engine_fds": after["engine_fds"] != before["engine_fds"],
             "kv_cache_usage_perc": after["kv_cache_usage_perc"] != 0,
             "requests": any(after[k] for k in ("num_requests_running", "num_requests_waiting",
                                                "num_requests_waiting_for_grammar"))}
    return {"warm_up": f"{WARM_UP} of the mix, then {bodies} x {WARM_UP_BODY}", "attacks": sum(sum(c.values()) * (4 if k.endswith("-4x") else 1) for k, c in answers.items()),
            "seconds": round(took, 1), "answers": answers, "before": before, "after": after,
            "leaks": [k for k, bad in leaks.items() if bad],
            "still_serving": alive and all(isinstance(still[k], float) for k in ("stream_s", "choice_s"))}


# -- the report ------------------------------------------------------------------------------------
def markdown(base: dict[str, float], rows: list[dict[str, Any]]) -> str:
    lines = [f"alone: stream {base['stream_s']:.2f} s, structured {base['choice_s']:.2f} s", "",
             "| attack | answer | stream, x alone | structured, s over alone | `/health` max (ms) "
             "| server RSS, MiB: start / peak / end | engine RSS, MiB: start / peak / end | holds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attack']} | {r.get('answer', '?')} | {r.get('stream_vs_alone', r['stream_s'])} "
                     f"| {r.get('choice_minus_alone_s', r['choice_s'])} | {r['health_max_ms']} "
                     f"| {' / '.join(map(str, r['server_mib']))} | {' / '.join(map(str, r['engine_mib']))} "
                     f"| {'yes' if r['holds'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    table = timed_attacks()
    p.add_argument("--attacks", default="", help=f"comma-separated, of {', '.join(table)} (default: all; "
                   "'none' for none)")
    p.add_argument("--soak", type=int, default=1000, help="attacks in the leak check (0: none)")
    p.add_argument("--step-ms", type=float, default=10.0, help="the fake runner's step time")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    names = [n for n in args.attacks.split(",") if n and n != "none"] or ([] if args.attacks == "none" else list(table))
    out: dict[str, Any] = {"step_ms": args.step_ms}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        t = start_server(Path(tmp), args.step_ms, log)
        try:
            one_round(t, None)  # warm-up: the compile workers start, the first grammar compiles
            out["alone"] = base = alone(t)
            print(json.dumps({"attack": "none", **base}), flush=True)
            out["attacks"] = rows = []
            for name in names:
                rows.append(judged({"attack": name, **one_round(t, table[name])}, base))
                print(json.dumps(rows[-1]), flush=True)
            if args.soak:
                out["soak"] = soak(t, args.soak)
                print(json.dumps(out["soak"]), flush=True)
        finally:
            t.proc.terminate()
            t.proc.wait(30)
            out["server_log_errors"] = [line for line in log.read_text().splitlines()
                                        if "Traceback" in line or line.startswith(("ERROR", "CRITICAL"))][:20]
    print(markdown(base, rows))
    if out["server_log_errors"]:
        print("server log errors:", *out["server_log_errors"], sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
