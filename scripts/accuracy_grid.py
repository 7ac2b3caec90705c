"""The simulator's accuracy grid: every experiment on the real runner and the simulator.

    python scripts/accuracy_grid.py configs/accuracy/grid-cpu.yaml --reduced -o grid.json
    python scripts/accuracy_grid.py configs/accuracy/grid-cpu.yaml -o grid-full.json
    python scripts/accuracy_grid.py --render grid.json          # the tables of a stored run
    python scripts/accuracy_grid.py configs/accuracy/grid-cpu.yaml --reduced \\
        --calibrate configs/calibration/cpu-smollm2.yaml -o grid.json   # fit, then the grid

Method (schedkit/lab/accuracy.py): per workload and scheduler shape, the simulator's
capacity (every request at once, fcfs) sets the offered loads; each experiment then runs
once on the simulator and ``repeats`` times on the real runner, the real runs in passes
over the whole grid (A B C ... A B C) so that the machine's drift spreads over every
experiment. Every real run also records its steps, whose predicted time against their
measured time is the run's speed ratio (the machine's drift since the fit), and the
hypervisor's steal share. A speed probe (the same few seconds of fixed work) runs
before the first real run and after each one; every experiment is also simulated once
per real run with the profile scaled by that run's probe ratios (decode-only steps and
steps with a prompt chunk apart), re-anchored to the machine's speed around the run
(``--no-probe`` skips it), and the mean of those held against the real runs' mean.
Results are saved after every real run; ``--resume`` keeps the finished ones.
``--write-docs`` puts the tables into docs/simulator-accuracy.md (between its
``accuracy_grid`` markers). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schedkit.cli import check_writable
from schedkit.cli import main as cli_main
from schedkit.errors import ConfigError
from schedkit.lab.accuracy import (
    HEADLINE,
    METRICS,
    load_grid,
    mean_noise_floor,
    overall,
    rankings,
    run_grid,
    summary_rows,
)
from schedkit.lab.cost_fit import StepRecord, write_steps
from schedkit.runners.cost_model import CostModel, profile_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ of this checkout

from benchmarks.provenance import commit, machine  # noqa: E402

DOC = ROOT / "docs" / "simulator-accuracy.md"
OUTPUTS = ("docs", "README.md")
"""Pages a run writes (this script's and bench_all's): not a change to what is measured."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"


def render(data: dict[str, Any]) -> str:
    """Markdown: the overall figures, the per-experiment table, the rankings."""
    results, o = data["results"], data["overall"]
    at_kind = o.get("mape_at_kind_speed")
    if at_kind and not any(math.isfinite(v) for v in at_kind.values()):
        at_kind = None  # runs recorded before the two kinds' ratios were kept
    lines = [f"Grid `{data['grid']}` ({'reduced' if data['reduced'] else 'full'}), commit {data['commit']}, "
             f"{data['date']}, {data['machine']}; profile `{data['profile']}`; "
             f"{o['experiments']} experiments, real runner {data['repeats']} runs each; "
             f"wall {data['wall_s'] / 60:.1f} min; simulator {o['speedup']:.0f}x faster than real time."
             + _fitted(data.get("calibrated")), "",
             "| metric | mean abs. % error, profile as fitted | noise floor (an exact simulator's expected error) "
             "| re-anchored by the speed probe | at the runs' own speed |"
             + (" at each step kind's own speed |" if at_kind else ""),
             "|---|---|---|---|---|" + ("---|" if at_kind else "")]
    anchored, at_speed = o.get("mape_anchored") or {}, o.get("mape_at_run_speed") or {}
    floor = o.get("noise_floor") or mean_noise_floor(results)  # results written before the floor was kept
    lines += [f"| {m} | {_pct(o['mape'][m])} | {_pct(floor[m])} | {_pct(anchored.get(m, math.nan))} "
              f"| {_pct(at_speed.get(m, math.nan))} |" + (f" {_pct(at_kind[m])} |" if at_kind else "")
              for m in METRICS]
    lines += ["", "The noise floor is the error a simulator exact to each experiment's expected value "
              f"would still be expected to show against the mean of its {data['repeats']} real runs, "
              "estimated from their spread: an error near it is what the runs' noise explains, and a model "
              "bias smaller than about the floor cannot be told from that noise."]
    if o.get("speed_ratio"):
        r = o["speed_ratio"]
        lines += ["", f"The real runs' steps took {r['min']:.2f}-{r['max']:.2f}x (mean {r['mean']:.2f}x) what "
                  "the profile predicts for those very steps" + _by_kind(o) + _steal(o.get("steal"))
                  + "; the column at the runs' own speed simulates each experiment once per real run with the "
                  "profile scaled by that run's own ratio" + (", the last with its decode-only steps and those with a prompt chunk scaled by "
                             "their own ratios apart" if at_kind else "") + "."]
    if o.get("probe_ratio"):
        r = o["probe_ratio"]
        d, p = o.get("probe_ratio_decode"), o.get("probe_ratio_prefill")
        kinds = (f" (its decode-only steps {d['min']:.2f}-{d['max']:.2f}x, its steps with a prompt chunk "
                 f"{p['min']:.2f}-{p['max']:.2f}x)" if d and p else "")
        lines += ["", f"The speed probe around each real run read the machine {r['min']:.2f}-{r['max']:.2f}x "
                  f"(mean {r['mean']:.2f}x) as slow as during the fit{kinds}; the re-anchored column simulates each "
                  "experiment once per real run with the profile scaled by that run's probe "
                  + ("ratios, each kind of step by its own." if kinds else "ratio.")]
    lines += ["", f"Outside the bound (15% or twice the real runs' spread), profile as fitted: "
              f"{', '.join(o['outside_bound']) or 'none'}."]
    if "outside_bound_anchored" in o and o.get("probe_ratio"):
        lines += [f"Re-anchored by the probe: {', '.join(o['outside_bound_anchored']) or 'none'}."]
    tau = f"Policy rankings by E2E mean: mean Kendall's tau {o['kendall_tau_mean']:.2f}"
    if o.get("probe_ratio") and math.isfinite(o.get("kendall_tau_mean_anchored", math.nan)):
        tau += f" ({o['kendall_tau_mean_anchored']:.2f} re-anchored)"
    lines += [tau + ".", "",
              "Per experiment (workload/load/shape/policy): simulator error / real runs' spread.", "",
              "| experiment | offered req/s | " + " | ".join(METRICS[:-1]) + " | preemptions sim vs real |",
              "|---" * (len(METRICS) + 2) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(results)]
    lines += ["", "| cell | real order (best first) | simulated order | tau |", "|---|---|---|---|"]
    for cell, r in rankings(results).items():
        lines.append(f"| {cell} | {' < '.join(r['real'])} | {' < '.join(r['sim'])} | {r['tau']:.2f} |")
    return "\n".join(lines) + "\n"


def _by_kind(o: dict[str, Any]) -> str:
    """The decode-only and prompt-chunk steps' ratios apart (runs recorded before they
    were kept have none)."""
    d, p = o.get("speed_ratio_decode"), o.get("speed_ratio_prefill")
    if not d or not p:
        return ""
    return (f" (decode-only steps {d['min']:.2f}-{d['max']:.2f}x, mean {d['mean']:.2f}x; steps with a prompt "
            f"chunk {p['min']:.2f}-{p['max']:.2f}x, mean {p['mean']:.2f}x)")


def _fitted(c: dict[str, Any] | None) -> str:
    if not c:
        return ""
    steal = "" if c.get("steal_share") is None else f", steal {_pct(c['steal_share'])}"
    return (f" The profile was fitted to `{c['config']}` right before the grid ({c['wall_s']:.0f} s, "
            f"mean step error {_pct(c['mean_relative_step_error'])}{steal}).")


def _steal(span: dict[str, float] | None) -> str:
    if not span:
        return ""
    return f"; the hypervisor's steal share was {_pct(span['min'])}-{_pct(span['max'])} of the CPU time"


def _steps_writer(steps_dir: Path) -> Callable[[str, int, list[StepRecord]], None]:
    """Write each real run's steps to ``steps_dir/<experiment>-<pass>.jsonl``."""
    steps_dir.mkdir(parents=True, exist_ok=True)

    def save(key: str, rep: int, records: list[StepRecord]) -> None:
        write_steps(steps_dir / f"{key.replace('/', '_')}-{rep}.jsonl", records)

    return save


def _span_from(first: Any, now: str) -> str:
    """``first`` (a stored value, perhaps already a span) to ``now``, or ``now``."""
    start = str(first).split(" to ")[0] if first else now
    return now if start == now else f"{start} to {now}"


def write_doc(text: str, path: Path = DOC, key: str = "reduced") -> None:
    begin, end = f"<!-- accuracy_grid:{key} -->", f"<!-- /accuracy_grid:{key} -->"
    page = path.read_text()
    if begin not in page or end not in page:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def _stored(path: Path, what: str) -> dict[str, Any]:
    """A grid's stored results (``--render``, ``--resume``).

    Raises:
        ConfigError: The file cannot be read, is not JSON, or holds no grid results.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what} {path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict) \
            or not all(isinstance(r, dict) and "real_runs" in r for r in data["results"].values()):
        raise ConfigError(f"{what} {path}: not the results of accuracy_grid.py (a JSON object whose "
                          "results map experiments to their runs)")
    return data


def _grid_digest(grid_file: Path, base_file: Path) -> str:
    """What a resumed grid must share with the stored one: the grid and base files."""
    return hashlib.sha256(grid_file.read_bytes() + b"\0" + base_file.read_bytes()).hexdigest()


def main() -> None:
    try:
        _main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", nargs="?", help="grid file (YAML)")
    ap.add_argument("--reduced", action="store_true", help="the reduced grid")
    ap.add_argument("--profile", help="the simulator's profile instead of the grid file's (a name or a path)")
    ap.add_argument("-o", "--output", default="accuracy-grid.json")
    ap.add_argument("--resume", action="store_true", help="keep the finished real runs in --output")
    ap.add_argument("--repeats", type=int, metavar="N",
                    help="real runs per experiment instead of the grid file's: with --resume and the same "
                         "--profile, adds passes to a finished grid (its noise floor falls as 1/sqrt(N))")
    ap.add_argument("--calibrate", metavar="CONFIG",
                    help="first fit a profile to CONFIG's runner (schedkit calibrate) and use it: "
                         "the fit and the grid back to back")
    ap.add_argument("--budget-s", type=float, default=600.0, help="the calibration's budget (seconds)")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the speed probe around each real run (no re-anchored column)")
    ap.add_argument("--steps-dir", metavar="DIR",
                    help="write each real run's steps (features and seconds, JSON lines) into DIR, and the "
                         "--calibrate fit's as calibration.jsonl: a changed cost model can then be fitted "
                         "and judged offline")
    ap.add_argument("--render", metavar="JSON", help="print the tables of a stored run, run nothing")
    ap.add_argument("--write-docs", action="store_true", help="put the tables into docs/simulator-accuracy.md")
    a = ap.parse_args()
    if a.render:
        data = _stored(Path(a.render), "--render")
        if not isinstance(data.get("overall"), dict):
            raise ConfigError(f"--render {a.render}: an unfinished grid (no overall figures): "
                              "finish it with --resume")
    else:
        if not a.grid:
            ap.error("give a grid file (or --render JSON)")
        out = Path(a.output)
        check_writable(str(out))
        save_steps = _steps_writer(Path(a.steps_dir)) if a.steps_dir else None  # makes the folder
        calibrated = None
        if a.calibrate:
            if a.resume:
                ap.error("--calibrate fits a new profile: it cannot resume runs made with another")
            a.profile = str(out.with_name(f"{out.stem}-profile.json"))
            t_fit = time.perf_counter()
            steps = [] if not a.steps_dir else ["--steps", str(Path(a.steps_dir) / "calibration.jsonl")]
            rc = cli_main(["calibrate", a.calibrate, "-o", a.profile, "--budget-s", str(a.budget_s), *steps])
            if rc:
                raise SystemExit(rc)
            fitted = json.loads(Path(a.profile).read_text())
            calibrated = {"config": a.calibrate, "wall_s": round(time.perf_counter() - t_fit, 1),
                          "steal_share": fitted["calibration"].get("steal_share"),
                          "mean_relative_step_error": fitted.get("mean_relative_step_error")}
        grid = load_grid(a.grid, profile=a.profile)
        CostModel.load(grid.profile)  # a bad profile stops here, before any run
        grid_digest = _grid_digest(Path(a.grid), grid.path.parent / grid.config.base)
        before = _stored(out, "--resume onto") if a.resume and out.is_file() else {}
        if before.get("grid_sha256", grid_digest) != grid_digest:
            ap.error(f"{out} holds runs of another grid (its grid or base file has changed since): "
                     "resume with the same files, or write a new --output")
        done, wall_before = before.get("results"), before.get("wall_s", 0.0)
        stored = max((len(r.get("real_runs", ())) for r in (done or {}).values()), default=0)
        if a.repeats is not None and (a.repeats < 1 or a.repeats < stored):
            ap.error(f"--repeats must be at least 1 and at least the {stored} real runs {out} holds, "
                     f"got {a.repeats}")
        repeats = a.repeats if a.repeats is not None else max(grid.config.repeats, stored)
        grid.config = grid.config.model_copy(update={"repeats": repeats})
        experiments = grid.experiments(reduced=a.reduced)
        digest = hashlib.sha256(profile_path(grid.profile).read_bytes()).hexdigest()
        if done and before.get("profile_sha256", digest) != digest:
            ap.error(f"{out} holds runs simulated with another profile than {grid.profile}: resume with "
                     "the same --profile (a --calibrate run leaves its profile beside its output)")
        # A profile fitted for this run lives in a scratch file: name where it came from.
        label = f"fitted right before ({a.calibrate})" if a.calibrate else grid.profile
        data = {"grid": a.grid, "reduced": a.reduced, "profile": label, "profile_sha256": digest,
                "grid_sha256": grid_digest, "repeats": repeats, "commit": commit(ignore=OUTPUTS), "date": datetime.date.today().isoformat(),
                "machine": machine(), "calibrated": calibrated}
        if done:  # resumed: the profile's provenance stays, the commit and date span both
            data["calibrated"] = before.get("calibrated")
            data["profile"] = before.get("profile", label)
            for key in ("commit", "date"):
                data[key] = _span_from(before.get(key), data[key])
        t0 = time.perf_counter()

        def save(results: dict[str, Any]) -> None:
            out.write_text(json.dumps({**data, "results": results,
                                       "wall_s": wall_before + time.perf_counter() - t0}, indent=1))

        print(f"{len(experiments)} experiments, {grid.config.repeats} real runs each", file=sys.stderr)
        results = run_grid(grid, experiments, done=done, save=save, probe=not a.no_probe,
                           save_steps=save_steps,
                           progress=lambda msg: print(f"[{time.perf_counter() - t0:7.1f} s] {msg}",
                                                      file=sys.stderr, flush=True))
        data.update(results=results, overall=overall(results), wall_s=wall_before + time.perf_counter() - t0)
        out.write_text(json.dumps(data, indent=1))
    text = render(data)
    print(text)
    if a.write_docs:
        write_doc(text, key="reduced" if data["reduced"] else "full")
    o = data["overall"]
    for label, key in (("as fitted", "mape"), ("re-anchored", "mape_anchored")):
        mape = o.get(key) or {}
        misses = [m for m, limit in zip(HEADLINE, (0.05, 0.05, 0.10), strict=True)
                  if not mape.get(m, math.nan) <= limit]
        if mape and misses:
            print(f"targets missed ({label}): {', '.join(misses)}", file=sys.stderr)


if __name__ == "__main__":
    main()
