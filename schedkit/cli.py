"""``schedkit run | compare | serve | calibrate | check | plugins | record | replay``."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from schedkit.config import Config, load_config
from schedkit.errors import ConfigError, PluginError, SchedkitError

if TYPE_CHECKING:
    from schedkit.lab.compare import CompareResult, Sample, SweepPoint

STEAL_WARNING = 0.03
"""A calibration during which the hypervisor took more than this share of the CPU time
warns that its step times are another guest's load as much as the runner's."""


def _run(args: argparse.Namespace) -> int:
    from schedkit.core.request import SamplingParams
    from schedkit.engine.tokenizer import load_tokenizer
    from schedkit.lab import report
    from schedkit.lab.metrics import metrics_from_output, summarize
    from schedkit.lab.workloads import generate
    from schedkit.llm import LLM

    config = load_config(args.config)  # a bad file stops here, before any process starts
    if args.output:
        check_writable(args.output)
    tokenizer = load_tokenizer(config) if config.workload.prompts else None
    workload = generate(config.workload, config.runner.vocab_size, Path(args.config).parent, tokenizer)
    wall0 = time.perf_counter()
    with LLM(config, tokenizer=tokenizer) as llm:
        outs = llm.generate(
            [w.prompt_token_ids for w in workload],
            [SamplingParams(max_tokens=w.max_tokens, eos_token_id=config.runner.eos_token_id)
             for w in workload],
            arrival_offsets=[w.arrival_time for w in workload],
            priorities=[w.priority for w in workload], tenants=[w.tenant for w in workload],
            request_ids=[w.request_id for w in workload], use_tqdm=_show_progress(args))
        stats = llm.call_utility("stats")
    wall = time.perf_counter() - wall0
    # The engine clock at arrival offset 0, from any request that has metrics.
    origin = min((o.metrics.arrival_time - w.arrival_time for o, w in zip(outs, workload, strict=True)
                  if o.metrics is not None), default=0.0)
    metrics = [metrics_from_output(o, w, origin) for o, w in zip(outs, workload, strict=True)]
    wl = config.workload
    summary = summarize(metrics, wl.slo, fairness=wl.fairness, shares=wl.tenant_shares)
    _print_summary(config, summary, wall, stats["num_steps"], stats.get("router"))
    texts = config.workload.prompts
    for i, o in enumerate(outs[: args.samples]):
        toks = o.output_token_ids
        if tokenizer is not None:
            answer = tokenizer.decode(toks, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False).strip()
            print(f"\n>>> {texts[i % len(texts)]}\n{answer}")
            continue
        print(f"  {o.request_id}: {len(o.prompt_token_ids)} prompt tokens -> "
              f"{toks[:8]}{'...' if len(toks) > 8 else ''} ({len(toks)} tokens, {o.finish_reason})")
    failed = [o for o in outs if o.error is not None]
    for o in failed[:5]:
        print(f"  failed {o.request_id}: {o.error}", file=sys.stderr)
    if args.output:
        report.write_json(args.output, {"summary": summary, "requests": [m.to_dict() for m in metrics]})
        print(f"per-request results written to {args.output}")
    return 1 if failed else 0


def _shown(x: float) -> str:
    """One decimal, or "n/a" where nothing was measured (no request produced a token)."""
    return f"{x:.1f}" if math.isfinite(x) else "n/a"


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress bars go to stderr, only when it is a terminal and ``--no-progress`` is off."""
    return sys.stderr.isatty() and not args.no_progress


def _ms(dist: dict) -> str:
    """``mean / p50 / p90 / p99`` of a latency distribution, in milliseconds."""
    return " / ".join(_shown(dist[q] * 1e3) for q in ("mean", "p50", "p90", "p99"))


def _is_virtual(config: Config) -> bool:
    runner = config.runner
    return runner.kind == "simulated" or getattr(runner, "clock", "wall") == "virtual"


def _print_summary(config: Config, s: dict, wall: float, steps: int, router: dict | None = None) -> None:
    clock = "virtual" if _is_virtual(config) else "wall"
    rows = [
        ("policy", config.scheduler.policy), ("runner", config.runner.kind),
        ("requests", s["requests"]), ("steps", steps),
        (f"makespan ({clock} s)", f"{s['makespan_s']:.2f}"),
        ("offered load (req/s)", _shown(s["offered_load_req_s"])),
        ("output tokens/s", _shown(s["output_tokens_per_s"])),
        ("TTFT mean / p50 / p90 / p99 (ms)", _ms(s["ttft_s"])),
        ("TPOT mean / p50 / p90 / p99 (ms)", _ms(s["tpot_s"])),
        ("rejected", s["rejected"]), ("preemptions", s["preemptions"]), ("prefix hit rate", f"{s['prefix_hit_rate']:.1%}"),
        ("wall time (s)", f"{wall:.2f}"),
    ]
    if s.get("draft_tokens"):
        rows.insert(-1, ("draft tokens (accepted)", f"{s['draft_tokens']} ({s['draft_acceptance']:.1%})"))
    if router is not None:
        routed = " / ".join(str(r["num_routed"]) for r in router["replicas"])
        rows.insert(2, ("replicas (routed)", f"{len(router['replicas'])} ({config.router.policy}): {routed}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _compare(args: argparse.Namespace) -> int:
    from schedkit.lab import report
    from schedkit.lab.compare import RayRunner, parse_seeds, parse_sweep, runs_of, submit

    config = load_config(args.config)
    base = Path(args.config).parent
    knob, values = parse_sweep(args.sweep) if args.sweep else (None, [])
    seeds, repeats = runs_of(config, parse_seeds(args.seeds) if args.seeds else None, args.repeats)
    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # before any profile runs
        raise ConfigError(f"--output-dir {out}: cannot create it ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"--output-dir {out}: not writable")
    if repeats > 1 and _is_virtual(config):
        print(f"note: runner {config.runner.kind} runs on a virtual clock, so its {repeats} repeats "
              "are identical; vary the workload with --seeds", file=sys.stderr)
    ray = RayRunner(args.ray or None) if args.ray is not None else None  # no Ray: fails here
    try:
        # Everything is submitted at once (on Ray, all points run side by side); serially,
        # the single-load comparison runs (and is printed) before the sweep.
        todo = submit(config, single=not args.sweep_only, knob=knob, values=values, base_dir=base,
                      runner=ray, seeds=seeds, repeats=repeats, progress=ray is None and _show_progress(args))
        result = todo.compared()
        if result.summaries:
            if result.num_runs > 1:
                print(f"mean ± 95% confidence interval over {result.num_runs} runs per profile "
                      f"(seeds {', '.join(map(str, seeds))}; {repeats} repeat{'s' * (repeats > 1)} each)\n")
            print(report.format_table(result.summaries, intervals=result.ci95))
            for name, failed in result.failed.items():
                if failed:
                    print(f"  {name}: {len(failed)} requests failed, e.g. {next(iter(failed.values()))}")
        if knob is not None:
            todo.swept()
            print(f"\nhighest offered load (req/s) meeting the SLO "
                  f"(attainment >= {config.workload.slo.attainment:.0%}):")
            for name, best in result.sustained.items():
                print(f"  {name:<20} {'none of the loads' if best is None else f'{best:.3g}'}")
    finally:
        if ray is not None:
            ray.close()
    report.write_json(out / "results.json", _compare_payload(config, result, knob))
    print(f"wrote {', '.join(_compare_plots(config, result, out))} to {out}")
    return 0


def _compare_payload(config: Config, result: CompareResult, knob: str | None) -> dict:
    """``results.json``: the means, intervals and runs only when a profile ran more than once."""
    from schedkit.lab.compare import request_records

    several = result.num_runs > 1

    def point(p: SweepPoint) -> dict:
        rec: dict = {knob or "knob": p.knob, "load": p.load, "summary": p.summary}
        if several:
            rec["ci95"] = p.ci95
            rec["samples"] = _runs(p.samples)
        if any(s.result.metrics for s in p.samples):  # --sweep-only keeps the requests
            rec["requests"] = request_records(p.samples)
        return rec

    payload = {
        "config": config.model_dump(mode="json"),
        "seeds": result.seeds, "repeats": result.repeats,
        "summaries": result.summaries,
        "failed": result.failed,
        "requests": {n: request_records(samples) for n, samples in result.samples.items()},
        "sweep": {n: [point(p) for p in pts] for n, pts in result.sweep.items()},
        "sustained": result.sustained,
    }
    if several:
        payload["ci95"] = result.ci95
        payload["samples"] = {n: _runs(samples) for n, samples in result.samples.items()}
    return payload


def _runs(samples: list[Sample]) -> list[dict]:
    return [{"seed": s.seed, "repeat": s.repeat, "summary": s.result.summary} for s in samples]


def _compare_plots(config: Config, result: CompareResult, out: Path) -> list[str]:
    """Write the plots there is data for; the names of the files written, results.json first."""
    from schedkit.lab import report

    written = ["results.json"]
    if result.metrics and report.plot_cdfs(result.metrics, out / "latency_cdf.png"):
        written.append("latency_cdf.png")
    wl = config.workload
    first_runs = {n: samples[0].result.metrics for n, samples in result.samples.items()}  # one timeline each
    if result.metrics and report.plot_tenant_service(first_runs, out / "tenant_service.png",
                                                     wl.fairness, wl.tenant_shares):
        written.append("tenant_service.png")
    sweep = {n: [(p.load, p.summary) for p in pts] for n, pts in result.sweep.items()}
    intervals = {n: [p.ci95 for p in pts] for n, pts in result.sweep.items()} if result.num_runs > 1 else None
    if sweep and report.plot_latency_vs_load(sweep, out / "latency_vs_load.png", intervals=intervals):
        written.append("latency_vs_load.png")
    return written


def _calibrate(args: argparse.Namespace) -> int:
    from schedkit.engine.tokenizer import load_tokenizer
    from schedkit.lab.calibrate import calibrate
    from schedkit.lab.profiles import profile_payload, write_profile
    from schedkit.lab.workloads import generate

    config = load_config(args.config)
    if config.runner.kind == "fake":
        raise ConfigError(f"{config.where('runner', 'kind') or args.config}: runner.kind = 'fake': "
                          "calibrate measures a real runner's step times (kind paged); the fake "
                          "runner's are a constant")
    check_writable(args.output)
    if args.steps:
        check_writable(args.steps, "--steps")
    if args.rescale:
        return _rescale(args, config)
    tokenizer = load_tokenizer(config) if config.workload.prompts else None
    workload = generate(config.workload, config.runner.vocab_size, Path(args.config).parent, tokenizer)
    try:
        result = calibrate(config, budget_s=args.budget_s, workload=workload,
                           progress=lambda line: print(line, flush=True))
    except ValueError as e:  # too few steps to fit
        raise ConfigError(f"--budget-s {args.budget_s:g}: {e}; give calibration more time") from None
    name = args.name or Path(args.output).stem
    write_profile(args.output, profile_payload(name, result, config, args.config))
    if args.steps:
        from schedkit.lab.cost_fit import write_steps

        write_steps(args.steps, result.records)
    print(f"\n{len(result.records)} steps in {result.wall_s:.0f} s (budget {args.budget_s:g} s); "
          "relative step error:")
    print(f"  {'steps':<8} {'count':>6} {'mean':>7} {'median':>7} {'p90':>7}")
    for kind, r in result.residuals.items():
        print(f"  {kind:<8} {r['num_steps']:>6} {r['mean']:>7.1%} {r['median']:>7.1%} {r['p90']:>7.1%}")
    if result.probe_ratio is not None:
        print(f"speed probe, {result.num_probes} runs between the passes: {result.probe_ratio:.3f}x the fitted "
              "prediction (the reference a later --rescale reads the machine against)")
    if result.steal is not None and result.steal > STEAL_WARNING:
        print(f"warning: the hypervisor took {result.steal:.1%} of the CPU time during the fit (steal): "
              "this VM shares its cores, its steps ran slower than alone; fit again on a quiet machine "
              "or read the profile's errors against that")
    print(f"wrote profile {name!r} to {args.output} (runner: {{kind: simulated, profile: {args.output}}})")
    return 0


def _rescale(args: argparse.Namespace, config: Config) -> int:
    """``calibrate --rescale PROFILE``: the speed probe instead of a fit."""
    from schedkit.lab.accuracy import speed_probe
    from schedkit.lab.profiles import rescaled_payload, write_profile
    from schedkit.runners.cost_model import CostModel

    model = CostModel.load(args.rescale)
    probe = speed_probe(config, model)
    factor, prefill = probe.speeds(model)
    payload = rescaled_payload(args.rescale, factor, probe.step_s, args.config, probe.steal, prefill)
    if args.name:
        payload["name"] = args.name
    write_profile(args.output, payload)
    against = "" if model.probe_ratio == 1.0 else f" (the probe read {model.probe_ratio:.3f}x during the fit)"
    scale = (f"scaled by {factor:.3f}" if prefill is None else
             f"its decode-only steps scaled by {factor:.3f}, those with a prompt chunk by {prefill:.3f}")
    print(f"speed probe: steps took {probe.step_s:.2f} s, {probe.ratio:.3f}x what {model.name!r} predicts"
          f"{against}; wrote it {scale} to {args.output}")
    return 0


def _positive_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(s) or s <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return s


def check_writable(path: str, flag: str = "--output") -> None:
    """Refuse an output path that cannot be written before a run, not after it."""
    parent = Path(path).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or Path(path).is_dir():
        raise ConfigError(f"{flag} {path}: cannot write there (no such writable folder, or a folder)")


def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be in [0, 65535]")
    try:
        from schedkit.server.launch import serve
    except ImportError as e:
        raise ConfigError(f"schedkit serve needs the server extras ({e.name} is missing): "
                          "pip install 'schedkit[serve]'") from e
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return serve(config, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level)


def _check(args: argparse.Namespace) -> int:
    from schedkit.core.scheduler import Scheduler
    from schedkit.plugins.facade import HookFacade
    from schedkit.plugins.manager import get_plugin_manager
    from schedkit.runners import find_runner

    config = load_config(args.config)
    find_runner(config.runner.kind, config.where("runner", "kind"))  # registered (not imported)
    if config.runner.kind == "simulated":  # its profile loads (a name, a path, a valid file)
        from schedkit.runners.simulated import SimulatedRunner

        SimulatedRunner.from_config(config)
    # Build the scheduler too: its queue and connector come from the plugins' build
    # hooks, and a KV cache smaller than max_model_len is reported (as a warning) here.
    Scheduler(config.scheduler, config.cache, HookFacade(get_plugin_manager(config)))
    if not config.workload.prompts:  # text prompts need the model's tokenizer: run checks those
        from schedkit.lab.workloads import generate

        generate(config.workload, config.runner.vocab_size, Path(args.config).parent)  # reads a trace
    profiles = ""
    if config.compare is not None:
        from schedkit.lab.compare import check_profiles

        check_profiles(config)
        profiles = f", {len(config.compare.profiles)} compare profiles"
    print(f"{args.config}: ok (policy {config.scheduler.policy}, runner {config.runner.kind}{profiles})")
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from schedkit.plugins.manager import describe_plugins, discover_plugins, get_plugin_manager
    from schedkit.runners import ENTRY_POINT_GROUP, installed_runners

    installed = discover_plugins()
    print("installed plugins (entry-point group 'schedkit'):")
    for name, ep in sorted(installed.items()):
        print(f"  {name:<20} {ep.value}")
    if not installed:
        print("  (none)")
    print(f"installed runners (entry-point group '{ENTRY_POINT_GROUP}'):")
    for name, ep in sorted(installed_runners().items()):
        print(f"  {name:<20} {ep.value}")
    config = load_config(args.config) if args.config else Config()
    pm = get_plugin_manager(config)
    print(f"switched on{' by ' + args.config if args.config else ' by default'}:")
    for name, hooks in describe_plugins(pm):
        print(f"  {name:<20} {', '.join(hooks)}")
    return 0


def _record(args: argparse.Namespace) -> int:
    from schedkit.engine.tokenizer import load_tokenizer
    from schedkit.lab.replay import record_run
    from schedkit.lab.workloads import generate

    config = load_config(args.config)
    check_writable(args.output)
    tokenizer = load_tokenizer(config) if config.workload.prompts else None
    workload = generate(config.workload, config.runner.vocab_size, Path(args.config).parent, tokenizer)
    recording, result = record_run(config, workload)
    recording.write(args.output)
    unit = "steps" if recording.kind == "engine" else "routing decisions"
    preempted = sum(m.num_preemptions for m in result.metrics)
    print(f"recorded {len(workload)} requests, {recording.num_steps} {unit}, {preempted} preemptions "
          f"to {args.output}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from schedkit.lab import report
    from schedkit.lab.replay import read_recording, replay

    recording = read_recording(args.recording)
    config = load_config(args.config) if args.config else None
    if args.output:
        check_writable(args.output)
    result = replay(recording, config=config, from_step=args.from_step, policy=_named(args.policy),
                    victim=args.victim, router=_named(args.router))
    print(result.describe())
    if result.num_forced:
        print("held to the recording: " + ", ".join(f"{n} {k}s" for k, n in sorted(result.num_forced.items())))
    labels = ("recorded", "replayed") if result.changed is None else ("baseline", "changed")
    print(result.diff().format_table(labels, top=args.top))
    if args.output:
        report.write_json(args.output, result.to_dict())
        print(f"written to {args.output}")
    return 0


def _named(value: str | None) -> str | Config | None:
    """A policy or router name, or a YAML file that configures one."""
    if value is not None and value.endswith((".yaml", ".yml")):
        return load_config(value)
    return value


def _int_at_least(text: str, minimum: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {n}")
    return n


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="schedkit")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the YAML's workload through the engine")
    p.add_argument("config")
    p.add_argument("--output", "-o", help="write per-request results as JSON")
    p.add_argument("--samples", type=_non_negative_int, default=3, help="sample outputs to print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr "
                                                              "(it shows only on a terminal)")
    p.set_defaults(func=_run)
    p = sub.add_parser("compare", help="run several policy profiles on the YAML's workload")
    p.add_argument("config")
    p.add_argument("--output-dir", "-o", default="compare-results", help="where results go")
    p.add_argument("--sweep", help="KNOB=V1,V2,...: find the highest load each profile sustains "
                                   "under the SLO (KNOB: rate or time_scale)")
    p.add_argument("--sweep-only", action="store_true",
                   help="skip the single-load comparison (results.json then has the sweep's requests)")
    p.add_argument("--seeds", metavar="S1,S2,...",
                   help="run every profile on the workload generated with each seed (default: "
                        "compare.seeds, else workload.seed)")
    p.add_argument("--repeats", type=_positive_int, metavar="N",
                   help="run every profile N times on each seed's workload, interleaved across "
                        "profiles (default: compare.repeats, 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr "
                                                              "(they show only on a terminal)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run the profiles and load points as Ray tasks (same results.json as "
                        "without); ADDRESS: a running cluster (host:port, ray://host:port, or "
                        "auto); alone (after the config file): start a local cluster and stop "
                        "it after (needs pip install 'schedkit[cluster]')")
    p.set_defaults(func=_compare)
    p = sub.add_parser("serve", help="serve the YAML's engine over an OpenAI-compatible HTTP API")
    p.add_argument("config")
    p.add_argument("--host", help="address to bind (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default: server.port, 8000; 0: any free one)")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 routes "
                                     "(default: $SCHEDKIT_API_KEY, then server.api_key)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_serve)
    p = sub.add_parser("calibrate", help="fit a simulator profile to the YAML's real runner")
    p.add_argument("config")
    p.add_argument("--output", "-o", required=True, help="the profile JSON to write")
    p.add_argument("--name", help="the profile's name (default: the output file's stem)")
    p.add_argument("--budget-s", type=_positive_seconds, default=600.0,
                   help="wall-clock seconds for everything, model loading included (default 600); "
                        "the grid of step shapes is sized to fit")
    p.add_argument("--steps", metavar="FILE",
                   help="also write every measured step (its features and seconds, JSON lines) to FILE, "
                        "to fit a changed cost model to them later without running them again")
    p.add_argument("--rescale", metavar="PROFILE",
                   help="instead of fitting, run the speed probe (40 steps of fixed work, a few seconds) "
                        "on the YAML's runner and write PROFILE with every duration scaled by how much "
                        "slower or faster the machine runs now than when PROFILE was fitted")
    p.set_defaults(func=_calibrate)
    p = sub.add_parser("check", help="validate a config file")
    p.add_argument("config")
    p.set_defaults(func=_check)
    p = sub.add_parser("plugins", help="list installed and enabled plugins")
    p.add_argument("config", nargs="?")
    p.set_defaults(func=_plugins)
    p = sub.add_parser("record", help="run the YAML's workload in-process and record every "
                                      "scheduling decision (for schedkit replay)")
    p.add_argument("config")
    p.add_argument("--output", "-o", required=True, help="the recording (JSON lines; .gz: gzipped)")
    p.set_defaults(func=_record)
    p = sub.add_parser("replay", help="replay a recording on a virtual clock, changing one decision "
                                      "from a step on, and report what it changed per request")
    p.add_argument("recording")
    p.add_argument("--config", help="the config to replay under (default: the recording's own)")
    p.add_argument("--from-step", type=int, metavar="K",
                   help="the step (cluster: routing decision) the change applies at")
    change = p.add_mutually_exclusive_group()
    change.add_argument("--policy", help="the engine policy from step K on: a name, or a YAML "
                                         "whose scheduler.policy and plugins are used")
    change.add_argument("--victim", metavar="REQ_ID",
                        help="the request step K's first preemption takes instead")
    change.add_argument("--router", help="the router from decision K on (cluster recordings): a "
                                         "name, or a YAML whose router section is used")
    p.add_argument("--output", "-o", help="write the comparison as JSON")
    p.add_argument("--top", type=_non_negative_int, default=10,
                   help="requests to list, the largest E2E change first")
    p.set_defaults(func=_replay)
    parser.description = ("A pluggable scheduling-policy framework for LLM inference serving. "
                          f"Commands: {', '.join(sub.choices)}.")
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
