"""``schedkit run | check | plugins``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from schedkit.config import Config, load_config
from schedkit.errors import ConfigError, PluginError, SchedkitError


def _run(args: argparse.Namespace) -> int:
    from schedkit.core.engine_core import EngineCore
    from schedkit.core.request import Request, SamplingParams
    from schedkit.lab.metrics import request_metrics, summarize
    from schedkit.lab.workloads import generate

    config = load_config(args.config)
    engine = EngineCore(config)
    workload = generate(config.workload, config.runner.vocab_size)
    pending = list(reversed(workload))
    finished: list[Request] = []
    wall0 = time.perf_counter()
    start = engine.now()
    while pending or engine.has_requests():
        if not engine.has_requests() and pending:
            engine.advance_to(start + pending[-1].arrival_time)
        while pending and start + pending[-1].arrival_time <= engine.now():
            w = pending.pop()
            engine.add_request(Request(
                w.request_id, w.prompt_token_ids, SamplingParams(max_tokens=w.max_tokens,
                                                                 eos_token_id=config.runner.eos_token_id),
                arrival_time=start + w.arrival_time))
        before = dict(engine.scheduler.requests)
        engine.step()
        finished.extend(r for rid, r in before.items() if r.is_finished)
    wall = time.perf_counter() - wall0
    metrics = [request_metrics(r) for r in sorted(finished, key=lambda r: r.arrival_time)]
    summary = summarize(metrics, engine.now() - start)
    _print_summary(config, summary, wall, engine.num_steps)
    for r in finished[: args.samples]:
        print(f"  {r.request_id}: {r.num_prompt_tokens} prompt tokens -> "
              f"{r.output_token_ids[:8]}{'...' if r.num_output_tokens > 8 else ''} "
              f"({r.num_output_tokens} tokens, {r.get_finished_reason()})")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"summary": summary, "requests": [m.to_dict() for m in metrics]}, indent=1))
        print(f"per-request results written to {args.output}")
    return 0


def _print_summary(config: Config, s: dict, wall: float, steps: int) -> None:
    clock = "virtual" if config.runner.kind == "fake" else "wall"
    rows = [
        ("policy", config.scheduler.policy), ("runner", config.runner.kind),
        ("requests", s["requests"]), ("steps", steps),
        (f"duration ({clock} s)", f"{s['duration_s']:.2f}"),
        ("output tokens/s", f"{s['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{s['ttft_p50_s'] * 1e3:.1f} / {s['ttft_p99_s'] * 1e3:.1f}"),
        ("TPOT p50 / p99 (ms)", f"{s['tpot_p50_s'] * 1e3:.1f} / {s['tpot_p99_s'] * 1e3:.1f}"),
        ("preemptions", s["preemptions"]), ("prefix hit rate", f"{s['prefix_hit_rate']:.1%}"),
        ("wall time (s)", f"{wall:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _check(args: argparse.Namespace) -> int:
    from schedkit.plugins.manager import get_plugin_manager

    config = load_config(args.config)
    get_plugin_manager(config)
    print(f"{args.config}: ok (policy {config.scheduler.policy}, runner {config.runner.kind})")
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from schedkit.plugins.manager import describe_plugins, discover_plugins, get_plugin_manager

    installed = discover_plugins()
    print("installed plugins (entry-point group 'schedkit'):")
    for name, ep in sorted(installed.items()):
        print(f"  {name:<20} {ep.value}")
    if not installed:
        print("  (none)")
    config = load_config(args.config) if args.config else Config()
    pm = get_plugin_manager(config)
    print(f"switched on{' by ' + args.config if args.config else ' by default'}:")
    for name, hooks in describe_plugins(pm):
        print(f"  {name:<20} {', '.join(hooks)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="schedkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the YAML's workload through the engine")
    p.add_argument("config")
    p.add_argument("--output", "-o", help="write per-request results as JSON")
    p.add_argument("--samples", type=int, default=3, help="sample outputs to print")
    p.set_defaults(func=_run)
    p = sub.add_parser("check", help="validate a config file")
    p.add_argument("config")
    p.set_defaults(func=_check)
    p = sub.add_parser("plugins", help="list installed and enabled plugins")
    p.add_argument("config", nargs="?")
    p.set_defaults(func=_plugins)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PluginError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SchedkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
