"""The simulator's accuracy grid: every experiment on the real runner and the simulator.

    python scripts/accuracy_grid.py configs/accuracy/grid-cpu.yaml --reduced -o grid.json
    python scripts/accuracy_grid.py configs/accuracy/grid-cpu.yaml -o grid-full.json
    python scripts/accuracy_grid.py --render grid.json          # the tables of a stored run

Method (schedkit/lab/accuracy.py): per workload and scheduler shape, the simulator's
capacity (every request at once, fcfs) sets the offered loads; each experiment then runs
once on the simulator and ``repeats`` times on the real runner, the real runs in passes
over the whole grid (A B C ... A B C) so that the machine's drift spreads over every
experiment. Results are saved after every real run; ``--resume`` keeps the finished
ones. ``--write-docs`` puts the tables into docs/simulator-accuracy.md (between its
``accuracy_grid`` markers). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from schedkit.lab.accuracy import (
    HEADLINE,
    METRICS,
    load_grid,
    overall,
    rankings,
    run_grid,
    summary_rows,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ of this checkout

from benchmarks.provenance import commit, machine  # noqa: E402

DOC = ROOT / "docs" / "simulator-accuracy.md"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"


def render(data: dict[str, Any]) -> str:
    """Markdown: the overall figures, the per-experiment table, the rankings."""
    results, o = data["results"], data["overall"]
    lines = [f"Grid `{data['grid']}` ({'reduced' if data['reduced'] else 'full'}), commit {data['commit']}, "
             f"{data['date']}, {data['machine']}; profile `{data['profile']}`; "
             f"{o['experiments']} experiments, real runner {data['repeats']} runs each; "
             f"wall {data['wall_s'] / 60:.1f} min; simulator {o['speedup']:.0f}x faster than real time.", "",
             "| metric | mean abs. % error |", "|---|---|"]
    lines += [f"| {m} | {_pct(o['mape'][m])} |" for m in METRICS]
    lines += ["", f"Outside the bound (15% or twice the real runs' spread): "
              f"{', '.join(o['outside_bound']) or 'none'}.",
              f"Policy rankings by E2E mean: mean Kendall's tau {o['kendall_tau_mean']:.2f}.", "",
              "Per experiment (workload/load/shape/policy): simulator error / real runs' spread.", "",
              "| experiment | offered req/s | " + " | ".join(METRICS[:-1]) + " | preemptions sim vs real |",
              "|---" * (len(METRICS) + 2) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(results)]
    lines += ["", "| cell | real order (best first) | simulated order | tau |", "|---|---|---|---|"]
    for cell, r in rankings(results).items():
        lines.append(f"| {cell} | {' < '.join(r['real'])} | {' < '.join(r['sim'])} | {r['tau']:.2f} |")
    return "\n".join(lines) + "\n"


def write_doc(text: str, path: Path = DOC, key: str = "reduced") -> None:
    begin, end = f"<!-- accuracy_grid:{key} -->", f"<!-- /accuracy_grid:{key} -->"
    page = path.read_text()
    if begin not in page or end not in page:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", nargs="?", help="grid file (YAML)")
    ap.add_argument("--reduced", action="store_true", help="the reduced grid")
    ap.add_argument("--profile", help="the simulator's profile instead of the grid file's (a name or a path)")
    ap.add_argument("-o", "--output", default="accuracy-grid.json")
    ap.add_argument("--resume", action="store_true", help="keep the finished real runs in --output")
    ap.add_argument("--render", metavar="JSON", help="print the tables of a stored run, run nothing")
    ap.add_argument("--write-docs", action="store_true", help="put the tables into docs/simulator-accuracy.md")
    a = ap.parse_args()
    if a.render:
        data = json.loads(Path(a.render).read_text())
    else:
        if not a.grid:
            ap.error("give a grid file (or --render JSON)")
        grid = load_grid(a.grid, profile=a.profile)
        experiments = grid.experiments(reduced=a.reduced)
        out = Path(a.output)
        before = json.loads(out.read_text()) if a.resume and out.is_file() else {}
        done, wall_before = before.get("results"), before.get("wall_s", 0.0)
        data = {"grid": a.grid, "reduced": a.reduced, "profile": grid.profile, "repeats": grid.config.repeats,
                "commit": commit(), "date": datetime.date.today().isoformat(), "machine": machine()}
        t0 = time.perf_counter()

        def save(results: dict[str, Any]) -> None:
            out.write_text(json.dumps({**data, "results": results,
                                       "wall_s": wall_before + time.perf_counter() - t0}, indent=1))

        print(f"{len(experiments)} experiments, {grid.config.repeats} real runs each", file=sys.stderr)
        results = run_grid(grid, experiments, done=done, save=save,
                           progress=lambda msg: print(f"[{time.perf_counter() - t0:7.1f} s] {msg}",
                                                      file=sys.stderr, flush=True))
        data.update(results=results, overall=overall(results), wall_s=wall_before + time.perf_counter() - t0)
        out.write_text(json.dumps(data, indent=1))
    text = render(data)
    print(text)
    if a.write_docs:
        write_doc(text, key="reduced" if data["reduced"] else "full")
    o = data["overall"]
    misses = [m for m, limit in zip(HEADLINE, (0.05, 0.05, 0.10), strict=True) if not o["mape"][m] <= limit]
    if misses:
        print(f"targets missed: {', '.join(misses)}", file=sys.stderr)


if __name__ == "__main__":
    main()
