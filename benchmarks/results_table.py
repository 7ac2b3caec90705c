"""The README's results table and docs/results.md's tables, rendered from the one JSON
file ``scripts/bench_all.py`` writes (``docs/results.json``).

Each section names the benchmark's key in that file, the question of docs/results.md it
answers, its README row (``measure | schedkit | peer | conditions | details``) and its
table on the results page. A section that did not run renders as such, with the reason.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Entry = dict[str, Any]
README_HEADER = ("measure", "schedkit", "peer", "conditions", "details")
MAX_ROWS = 12
MAX_ROW_CHARS = 200


@dataclass(frozen=True)
class Section:
    key: str
    anchor: str  # the heading of docs/results.md the details link points at
    row: Callable[[Entry], tuple[str, str, str, str]] | None  # measure, schedkit, peer, conditions
    table: Callable[[Entry], list[str]]  # markdown lines for docs/results.md
    note: Callable[[Entry], str] | None = None  # a sentence below that table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


# -- scheduler overhead -------------------------------------------------------------------

def _oracle_row(e: Entry) -> tuple[str, str, str, str]:
    return ("decisions equal to vLLM's, step by step", f"**{e['identical']}/{e['traces']}** traces",
            "vLLM 0.32's logs", "FCFS and priority, chunked prefill, preemption")


def _oracle_table(e: Entry) -> list[str]:
    return _table(("traces", "identical to vLLM 0.32, step by step"), [(str(e["traces"]), str(e["identical"]))])


def _sched_row(e: Entry) -> tuple[str, str, str, str]:
    return ("scheduler step, 256 decodes", f"**{e['schedkit_median_ms']:.2f} ms**",
            f"{e['vllm_median_ms']:.2f} ms (vLLM 0.32)", "fake outputs, prefix caching, median")


def _sched_table(e: Entry) -> list[str]:
    return _table(("scheduler", "median per step", "fastest step"), [
        ("schedkit (plugins)", f"{e['schedkit_median_ms']:.3f} ms", f"{e['schedkit_min_ms']:.3f} ms"),
        ("vLLM 0.32 V1 scheduler", f"{e['vllm_median_ms']:.3f} ms", f"{e['vllm_min_ms']:.3f} ms")])


def _boundary_row(e: Entry) -> tuple[str, str, str, str]:
    extra = e["engine_process_ms"] / e["in_process_ms"] - 1
    return ("engine process, time per step", f"**{extra:+.0%}**", "in-process engine",
            "`LLM.generate`, 256 decodes, fake runner")


def _boundary_table(e: Entry) -> list[str]:
    return _table(("256 requests x 400 decode tokens", "per engine step"), [
        ("in-process `EngineCore`", f"{e['in_process_ms']:.3f} ms"),
        ("engine process, `LLM.generate`", f"{e['engine_process_ms']:.3f} ms "
         f"({e['engine_process_ms'] / e['in_process_ms'] - 1:+.1%})")])


# -- runner and servers against vLLM ------------------------------------------------------

def _runner_row(e: Entry) -> tuple[str, str, str, str]:
    return ("paged runner on CPU, output tok/s", f"**{e['schedkit']['out_tok_s']:.1f}**",
            f"{e['vllm']['out_tok_s']:.1f} (vLLM 0.32 CPU)", "SmolLM2-135M, float32, 2 threads, 32 requests")


def _runner_table(e: Entry) -> list[str]:
    def row(name: str, r: Entry) -> tuple[str, ...]:
        return (name, f"{r['out_tok_s']:.1f}", _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), f"{r['tpot_p50_ms']:.1f} ms")
    return _table(("engine", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50"),
                  [row("schedkit", e["schedkit"]), row("vLLM 0.32 CPU backend", e["vllm"])])


def _serve_runs(e: Entry, rate: str) -> dict[str, Entry]:
    return {r["server"]: r for r in e["runs"] if r["rate"] == rate}


def _serve_row(e: Entry) -> tuple[str, str, str, str]:
    r = _serve_runs(e, "0.5")
    return ("OpenAI server, TTFT p50 at 0.5 req/s", f"**{r['schedkit']['ttft_p50_ms']:.0f} ms**",
            f"{r['vllm']['ttft_p50_ms']:.0f} ms (vLLM 0.32)", "SmolLM2, float32, 2 threads, `vllm bench serve`")


def _serve_burst_row(e: Entry) -> tuple[str, str, str, str]:
    r = _serve_runs(e, "inf")
    return ("OpenAI server, tok/s all at once", f"**{r['schedkit']['out_tok_per_s']:.1f}**",
            f"{r['vllm']['out_tok_per_s']:.1f} (vLLM 0.32)", f"same, {e['prompts_per_rate']} requests at once")


def _serve_table(e: Entry) -> list[str]:
    rows = []
    for r in e["runs"]:
        name = "schedkit serve" if r["server"] == "schedkit" else "vLLM 0.32 OpenAI server"
        rate = "all at once" if r["rate"] == "inf" else f"{r['rate']} req/s"
        rows.append((rate, name, str(r["completed"]), f"{r['out_tok_per_s']:.1f}", f"{r['ttft_p50_ms']:.0f} ms",
                     f"{r['ttft_p99_ms']:.0f} ms", f"{r['tpot_p50_ms']:.1f} ms"))
    return _table(("rate", "server", "completed", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50"), rows)


def _overhead_row(e: Entry) -> tuple[str, str, str, str]:
    return ("HTTP server, requests/s", f"**{e['ratio_req_per_s']:.2f}x**", "`AsyncLLM` in-process",
            f"fake runner, {e['step_ms']} ms steps, {e['concurrency']} streams")


def _overhead_table(e: Entry) -> list[str]:
    def row(name: str, r: Entry) -> tuple[str, ...]:
        return (name, f"{r['req_per_s']:.1f}", f"{r['out_tok_per_s']:,.0f}",
                f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} ms", f"{r['itl_p50_ms']:.2f} ms")
    return _table(("side", "requests/s", "output tok/s", "TTFT p50 / p99", "ITL p50"),
                  [row("`AsyncLLM`", e["asyncllm"]), row("`schedkit serve` (HTTP)", e["http"])])


# -- structured outputs, simulator, cluster, policies -------------------------------------

def _structured_row(e: Entry) -> tuple[str, str, str, str]:
    return ("JSON-schema constrained decoding, tok/s", f"**{e['constrained_tok_s']:.1f}**",
            f"{e['unconstrained_tok_s']:.1f} (unconstrained)", f"SmolLM2, {e['batch']} requests, equal lengths")


def _structured_table(e: Entry) -> list[str]:
    return _table(("measure", "figure"), [
        ("tokens/s, every request constrained / unconstrained",
         f"{e['constrained_tok_s']:.1f} / {e['unconstrained_tok_s']:.1f}"),
        ("wait for a schema's grammar: uncached / cached", f"{e['uncached_ms']:.1f} / {e['cached_ms']:.1f} ms"),
        ("engine steps, schema-heavy output: jump-forward on / off", f"{e['jump_steps_on']} / {e['jump_steps_off']}")])


PUBLISHED_SIMULATORS = "BLIS 11.8% / 22.8%, Vidur < 9% (published)"
"""The errors the peers publish (E2E / TTFT mean absolute percentage error; Vidur one
bound over its validated points)."""


def _sim_row(e: Entry) -> tuple[str, str, str, str]:
    m = e["mape"]
    return ("simulator's error, E2E mean / TTFT p50", f"**{m['e2e_mean_s']:.1%} / {m['ttft_p50_s']:.1%}**",
            PUBLISHED_SIMULATORS, f"SmolLM2, CPU, {e['experiments']} experiments, fresh fit")


def _sim_table(e: Entry) -> list[str]:
    names = {"e2e_mean_s": "E2E mean", "ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99",
             "tpot_p50_s": "TPOT p50", "throughput_tok_s": "throughput", "preemptions": "preemptions"}
    return _table(("metric", "mean abs. error, profile as fitted", "noise floor (an exact simulator's expected error)",
                   "at the runs' own speed"),
                  [(name, f"{e['mape'][k]:.1%}", f"{e['noise_floor'][k]:.1%}", f"{e['mape_at_run_speed'][k]:.1%}")
                   for k, name in names.items()])


def _sim_note(e: Entry) -> str:
    r = e["speed_ratio"]
    return (f"{e['experiments']} experiments ({e['outside_bound']} outside their bound), fit's mean step "
            f"error {e['fit_step_error']:.1%}, the real runs' steps {r['min']:.2f}-{r['max']:.2f}x the profile's "
            f"prediction, rankings' mean Kendall's tau {e['kendall_tau_mean']:.2f}, simulator "
            f"{e['speedup']:.0f}x faster than real time.")


def _cluster_row(e: Entry) -> tuple[str, str, str, str]:
    pa, rr = e["routers"]["prefix-affinity"], e["routers"]["round-robin"]
    return ("cluster simulation, prefix hit rate", f"**{pa['prefix_hit_rate']:.3f}** (prefix affinity)",
            f"{rr['prefix_hit_rate']:.3f} (round-robin)", f"{e['replicas']} replicas, {e['requests']:,} Mooncake requests")


def _cluster_table(e: Entry) -> list[str]:
    return _table(("router", "prefix hit rate", "TTFT p50", "TTFT p99", "wall time"), [
        (name, f"{r['prefix_hit_rate']:.3f}", _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), f"{r['wall_s']:.0f} s")
        for name, r in e["routers"].items()])


def _policies_row(e: Entry) -> tuple[str, str, str, str]:
    s = e["short_mean_e2e_s"]
    return ("short jobs' mean E2E, preemptive mlfq", f"**{_span(s['mlfq'], '.3f')} s**",
            f"{_span(s['fcfs'], '.3f')} s (FCFS)", "simulator, heavy-tailed outputs, seeds 0-2")


def _policies_table(e: Entry) -> list[str]:
    s, r, p = e["short_mean_e2e_s"], e["recomputed_tokens"], e["preemptions"]
    seeds = " / ".join(map(str, e["seeds"]))
    fmt = lambda xs, f: " / ".join(format(x, f) for x in xs)  # noqa: E731
    return _table(("measure (seeds " + seeds + ")", "schedkit policy", "baseline"), [
        ("short-job mean E2E, heavy-tailed outputs", f"mlfq {fmt(s['mlfq'], '.3f')} s", f"FCFS {fmt(s['fcfs'], '.3f')} s"),
        ("recomputed tokens under KV pressure", f"swap {fmt(r['swap'], 'd')}", f"recompute {fmt(r['recompute'], 'd')}"),
        ("preemptions under KV pressure", f"swap {fmt(p['swap'], 'd')}", f"recompute {fmt(p['recompute'], 'd')}")])


def _swap_row(e: Entry) -> tuple[str, str, str, str]:
    r = e["recomputed_tokens"]
    ratio = statistics.mean(a / b for a, b in zip(r["swap"], r["recompute"], strict=True))
    return ("tokens recomputed after preemption, swap", f"**{ratio:.2f}x**", "recompute",
            "simulator, KV pressure, seeds 0-2")


def _kv_storage_table(e: Entry) -> list[str]:
    return _table(("engine", "prompt tokens computed", "TTFT p50", "wall time"), [
        (r["engine"], f"{r['prompt_tokens_computed']:,}", _ms(r["ttft_p50_s"]), _ms(r["wall_s"])) for r in e["rows"]])


SECTIONS = [
    Section("oracle", "scheduler-overhead", _oracle_row, _oracle_table),
    Section("scheduler_step", "scheduler-overhead", _sched_row, _sched_table),
    Section("engine_boundary", "scheduler-overhead", _boundary_row, _boundary_table),
    Section("runner_vs_vllm", "runner-vs-vllms-cpu-backend", _runner_row, _runner_table),
    Section("serve_vs_vllm", "server-vs-vllms-server", _serve_row, _serve_table),
    Section("serve_overhead", "server-vs-vllms-server", _overhead_row, _overhead_table),
    Section("structured", "structured-outputs", _structured_row, _structured_table),
    Section("simulator", "simulator-accuracy", _sim_row, _sim_table, _sim_note),
    Section("cluster", "cluster-simulation", _cluster_row, _cluster_table),
    Section("policies", "policies", _policies_row, _policies_table),
    Section("kv_storage", "kv-storage", None, _kv_storage_table),
]
# Sections with a second README row.
EXTRA_ROWS = [("serve_vs_vllm", _serve_burst_row), ("policies", _swap_row)]


def _usable(entry: Entry | None) -> bool:
    return entry is not None and "not_run" not in entry and "failed" not in entry


def _why_not(entry: Entry | None) -> str:
    if entry is None:
        return "not run yet"
    return "not run: " + str(entry.get("not_run") or entry.get("failed"))[:80]


def readme_rows(results: Entry) -> list[tuple[str, ...]]:
    rows = []
    extras = {key: fn for key, fn in EXTRA_ROWS}
    for s in SECTIONS:
        entry = results["sections"].get(s.key)
        link = f"[more](docs/results.md#{s.anchor})"
        fns = ([s.row] if s.row else []) + ([extras[s.key]] if s.key in extras else [])
        for fn in fns:
            if _usable(entry):
                rows.append((*fn(entry), link))
            else:
                rows.append((s.key.replace("_", " "), _why_not(entry), "", "", link))
    return rows


def render_readme_table(results: Entry) -> str:
    head = (f"Measured by `python scripts/bench_all.py` at {results.get('commit', '?')} on "
            f"{results.get('date', '?')}: {results.get('machine', '?')}; both sides of a row in one run (a peer marked published excepted).")
    return "\n".join([head, "", *_table(README_HEADER, readme_rows(results))])


def render_section_table(results: Entry, key: str) -> str:
    entry = results["sections"].get(key)
    if not _usable(entry):
        return f"*{_why_not(entry)}*"
    assert entry is not None
    lines = _table(*_header_rows(entry, key))
    lines.append("")
    note = _section(key).note
    if note is not None:
        lines += [note(entry), ""]
    lines.append(f"*{entry['date']}, {entry['commit']}, {results['machine']}; "
                 f"the benchmark took {entry['wall_s']:.0f} s.*")
    return "\n".join(lines)


def _section(key: str) -> Section:
    return next(s for s in SECTIONS if s.key == key)


def _header_rows(entry: Entry, key: str) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    lines = _section(key).table(entry)
    header = tuple(c.strip() for c in lines[0].strip("|").split("|"))
    rows = [tuple(c.strip() for c in ln.strip("|").split("|")) for ln in lines[2:]]
    return header, rows


README_MARKERS = ("<!-- bench_all:readme -->", "<!-- /bench_all:readme -->")


def _section_markers(key: str) -> tuple[str, str]:
    return f"<!-- bench_all:{key} -->", f"<!-- /bench_all:{key} -->"


def _replace_between(text: str, begin: str, end: str, body: str, page: str) -> str:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{page} has no {begin} ... {end} block")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def rendered_pages(results: Entry, root: Path) -> dict[Path, str]:
    """README.md and docs/results.md as they read with ``results``'s tables in place."""
    readme, page = root / "README.md", root / "docs" / "results.md"
    text = _replace_between(readme.read_text(), *README_MARKERS, render_readme_table(results), "README.md")
    doc = page.read_text()
    for s in SECTIONS:
        doc = _replace_between(doc, *_section_markers(s.key), render_section_table(results, s.key),
                               "docs/results.md")
    return {readme: text, page: doc}


def write_docs(results: Entry, root: Path) -> None:
    for path, text in rendered_pages(results, root).items():
        path.write_text(text)


def readme_table_problems(table: str) -> list[str]:
    """What breaks the README table's limits: its columns, row count and row length."""
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    problems = []
    if not lines or lines[0] != "| " + " | ".join(README_HEADER) + " |":
        problems.append(f"the header is not | {' | '.join(README_HEADER)} |")
    rows = lines[2:]
    if len(rows) > MAX_ROWS:
        problems.append(f"{len(rows)} rows, more than {MAX_ROWS}")
    problems += [f"row of {len(r)} characters, more than {MAX_ROW_CHARS}: {r[:60]}..."
                 for r in rows if len(r) > MAX_ROW_CHARS]
    problems += [f"row with {r.count('|') - 1} cells: {r[:60]}..." for r in rows
                 if r.count("|") - 1 != len(README_HEADER)]
    return problems
