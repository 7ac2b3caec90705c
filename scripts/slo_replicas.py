"""SLO attainment per class behind real replicas: round-robin and least-outstanding
routing against ``slo-headroom``.

Method: ``AsyncLLM`` starts the replicas of ``--config`` (configs/slo-replicas.yaml: two
local engine processes, the fake runner pacing every step at 20 ms on the wall clock, 8
requests running per replica, about 33 requests/s of capacity at 24 output tokens; two
SLO classes, ``interactive`` with a 0.25 s TTFT target and ``batch`` with 3 s). One
open-loop Poisson schedule of ``--rate`` requests/s for ``--duration`` seconds, the same
for every router: each request is ``interactive`` with probability ``--interactive``,
else ``batch``, has a ``--prompt-len`` random prompt and asks for 8 to 40 tokens (EOS
ignored), and carries its class as a hint (``RequestHints(slo_class=...)``), as a
client's ``x-schedkit-slo-class`` header does. ``slo-headroom`` predicts each replica's
TTFT and TPOT from the hand-set profile of those 20 ms steps
(configs/profiles/fake-20ms.json) and what each replica last reported.

Per router and class: requests, refused (the router's admission: 429 over HTTP), TTFT
p50 / p99 of the served (from the scheduled arrival to the first token, as the client
sees it), and attainment: the share of the class's requests served within both its TTFT
and TPOT targets (a refused request misses); goodput is the requests that met their
targets per second of arrivals.

    python scripts/slo_replicas.py -o docs/slo-routing/slo-replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from schedkit import RequestHints
from schedkit.config import Config, load_config
from schedkit.core.request import SamplingParams
from schedkit.errors import EngineBusyError
from schedkit.lab.metrics import percentile
from schedkit.llm import AsyncLLM

ROOT = Path(__file__).resolve().parents[1]
ROUTERS: dict[str, dict[str, Any]] = {
    "round-robin": {"policy": "round-robin"},
    "least-outstanding": {"policy": "least-outstanding"},
    "slo-headroom": {"policy": "slo-headroom"},
    "slo-headroom-refuse": {"policy": "slo-headroom",
                            "plugins": [{"name": "slo-headroom", "settings": {"on_miss": "refuse"}}]},
}


def with_router(base: Config, router: dict[str, Any]) -> Config:
    data = base.model_dump(mode="json")
    data["router"] = {**{k: v for k, v in data["router"].items() if k not in ("policy", "plugins")}, **router}
    return Config.model_validate(data)


def schedule(rate: float, duration: float, interactive: float, seed: int) -> list[tuple[float, str, int]]:
    """``(seconds after the start, class, max_tokens)`` of every request, in time order."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append((t, "interactive" if rng.random() < interactive else "batch", rng.randint(8, 40)))
        t += rng.expovariate(rate)
    return out


async def run_case(config: Config, plan: list[tuple[float, str, int]], *, prompt_len: int,
                   seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = config.runner.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in plan]
    targets = config.slo_classes
    ttft: dict[str, list[float]] = {c: [] for c in targets}
    met: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    async with await AsyncLLM.create(config) as llm:
        async for _ in llm.generate([3, 4, 5], SamplingParams(max_tokens=2)):  # warm up the path
            pass
        loop = asyncio.get_running_loop()

        async def one(i: int, at: float, cls: str, max_tokens: int) -> None:
            arrival = start + at
            await asyncio.sleep(max(0.0, arrival - loop.time()))
            times: list[float] = []
            try:
                async for out in llm.generate(prompts[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              request_id=f"{cls}-{i}", hints=RequestHints(slo_class=cls)):
                    if out.output_token_ids and len(times) < len(out.output_token_ids):
                        times += [loop.time()] * (len(out.output_token_ids) - len(times))
            except EngineBusyError:
                refused[cls] += 1
                return
            first = times[0] - arrival
            ttft[cls].append(first)
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
            if targets[cls].met_by(first, tpot, times[-1] - arrival):
                met[cls] += 1

        start = loop.time()
        await asyncio.gather(*(one(i, at, c, n) for i, (at, c, n) in enumerate(plan)))
        wall = loop.time() - start
        stats = await llm.call_utility("stats")
    sent = Counter(c for _, c, _ in plan)
    duration = max(at for at, _, _ in plan)
    classes = {c: {"requests": sent[c], "refused": refused[c], "served": len(ttft[c]),
                   "ttft_p50_s": percentile(ttft[c], 50) if ttft[c] else None,
                   "ttft_p99_s": percentile(ttft[c], 99) if ttft[c] else None,
                   "attainment": met[c] / sent[c] if sent[c] else None} for c in targets}
    router = stats.get("router", {})
    return {"wall_s": wall, "classes": classes, "attainment": sum(met.values()) / len(plan),
            "goodput_req_s": sum(met.values()) / duration,
            "router": {k: router.get(k) for k in ("num_refused", "num_downgraded")}}


def table(runs: dict[str, Any]) -> str:
    rows = ["| router | interactive attained | interactive TTFT p50 / p99 | interactive refused | "
            "batch attained | batch TTFT p50 / p99 | all attained | goodput req/s |",
            "|---|--:|--:|--:|--:|--:|--:|--:|"]

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:,.0f}"

    for name, r in runs.items():
        i, b = r["classes"]["interactive"], r["classes"]["batch"]
        rows.append(f"| {name} | {i['attainment']:.3f} | {ms(i['ttft_p50_s'])} / {ms(i['ttft_p99_s'])} ms | "
                    f"{i['refused']} / {i['requests']} | {b['attainment']:.3f} | "
                    f"{ms(b['ttft_p50_s'])} / {ms(b['ttft_p99_s'])} ms | {r['attainment']:.3f} | "
                    f"{r['goodput_req_s']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "slo-replicas.yaml"))
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s, both classes together")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--interactive", type=float, default=0.3, help="share of interactive requests")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", help="write the results as JSON here")
    args = ap.parse_args()
    config = load_config(args.config)
    plan = schedule(args.rate, args.duration, args.interactive, args.seed)
    load_before = os.getloadavg()[0]
    runs: dict[str, Any] = {}
    for name in args.routers:
        t0 = time.perf_counter()
        runs[name] = asyncio.run(run_case(with_router(config, ROUTERS[name]), plan, prompt_len=args.prompt_len,
                                          seed=args.seed))
        print(f"{name:>20}: {len(plan)} requests, attained {runs[name]['attainment']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(table(runs))
    if args.output:
        out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
               "settings": {k: v for k, v in vars(args).items() if k != "output"}, "runs": runs}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
