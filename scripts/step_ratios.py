"""Measured over predicted step time, by kind of step, for the steps a grid run kept.

An accuracy grid run with ``--steps-dir DIR`` keeps every real run's steps in
``DIR/<experiment>-<pass>.jsonl`` and, with ``--calibrate``, the fit's own steps in
``DIR/calibration.jsonl``. This prints, for each source (the fit's workload phase, the
fit's bursts, each pass of the grid), the sum of the measured times of each kind of step
over the sum of the profile's predictions for them: 1.00 is a step as fast as the
profile says, below 1 faster. A kind the fit priced differently from the runs shows up
as a row whose first columns differ from the rest. The fit's workload phase is told
apart from its bursts by the profile's record of its phases (the first, ``workload``,
and its number of steps)::

    python scripts/step_ratios.py DIR --profile docs/accuracy/grid-cpu-full-onednn-profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from schedkit.errors import ConfigError
from schedkit.lab.calibrate import probe_ratio
from schedkit.lab.cost_fit import StepRecord, read_steps
from schedkit.runners.cost_model import CostModel, StepFeatures, profile_path

KINDS = ("full-budget prompt steps", "smaller prompt steps", "decode, one sequence",
         "decode, 2-4 sequences", "decode, 5 or more")


def kind(f: StepFeatures, budget: int) -> str:
    """The row a step counts in. A prompt step is full-budget from 15/16 of the budget."""
    if f.is_prefill_step:
        return KINDS[0] if f.tokens >= budget * 15 // 16 else KINDS[1]
    if f.requests <= 1:
        return KINDS[2]
    return KINDS[3] if f.requests <= 4 else KINDS[4]


def ratios(records: Iterable[StepRecord], model: CostModel, budget: int) -> dict[str, tuple[float, int]]:
    """Kind -> (measured / predicted time summed over its steps, number of steps)."""
    groups: dict[str, list[StepRecord]] = {}
    for record in records:
        groups.setdefault(kind(record[0], budget), []).append(record)
    return {k: (probe_ratio(group, model), len(group)) for k, group in groups.items()}


def sources(steps_dir: Path, profile: dict) -> list[tuple[str, list[StepRecord]]]:
    """(label, records) for the fit's workload phase and bursts (when the directory
    holds the fit's steps) and each pass of the grid, in that order.

    Raises:
        ValueError: No step file in ``steps_dir``, or a malformed one.
    """
    out: list[tuple[str, list[StepRecord]]] = []
    fit = steps_dir / "calibration.jsonl"
    if fit.is_file():
        records = read_steps(fit)
        calibration = profile.get("calibration")
        phases = calibration.get("phases") if isinstance(calibration, dict) else None
        first = phases[0] if isinstance(phases, list) and phases and isinstance(phases[0], dict) else {}
        steps = first.get("num_steps")
        n = steps if first.get("name") == "workload" and isinstance(steps, int) and steps > 0 else 0
        if n:
            out.append(("fit's workload phase", records[:n]))
        out.append(("fit's bursts" if n else "fit", records[n:]))
    passes: dict[int, list[StepRecord]] = {}
    for path in sorted(steps_dir.glob("*-*.jsonl")):
        m = re.fullmatch(r".+-(\d+)\.jsonl", path.name)
        if m:
            passes.setdefault(int(m.group(1)), []).extend(read_steps(path))
    out += [(f"grid, pass {p + 1}", passes[p]) for p in sorted(passes)]
    if not out:
        raise ValueError(f"{steps_dir}: no step files (calibration.jsonl or <experiment>-<pass>.jsonl)")
    if not any(records for _, records in out):
        raise ValueError(f"{steps_dir}: its step files hold no step")
    return out


def table(rows: Sequence[tuple[str, list[StepRecord]]], model: CostModel, budget: int) -> str:
    by_source = [(label, ratios(records, model, budget)) for label, records in rows]
    lines = ["| steps | " + " | ".join(label for label, _ in by_source) + " |",
             "|---|" + "---|" * len(by_source)]
    for k in KINDS:
        cells = [f"{r[k][0]:.2f}x ({r[k][1]})" if k in r else "-" for _, r in by_source]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps_dir", help="the --steps-dir of an accuracy grid run")
    ap.add_argument("--profile", required=True, help="the profile the grid ran on (a path)")
    ap.add_argument("--budget", type=int,
                    help="the token budget of a step (default: the one the profile was fitted with)")
    a = ap.parse_args(argv)
    if a.budget is not None and a.budget < 1:
        ap.error(f"--budget must be at least 1 token, got {a.budget}")
    try:
        model = CostModel.load(a.profile)
    except ConfigError as e:
        ap.error(str(e))
    data = json.loads(profile_path(a.profile).read_text())  # it loaded: a JSON object
    budget = a.budget or _fitted_budget(data)
    if not budget:
        ap.error("the profile does not say its token budget: give --budget")
    try:
        rows = sources(Path(a.steps_dir), data)
    except ValueError as e:
        ap.error(str(e))
    print(table(rows, model, budget))
    return 0


def _fitted_budget(profile: dict) -> int | None:
    """The token budget the profile was fitted with, where it records one."""
    sections = (profile.get("fitted_on") or {}).get("sections")
    scheduler = sections.get("scheduler") if isinstance(sections, dict) else None
    budget = scheduler.get("max_num_batched_tokens") if isinstance(scheduler, dict) else None
    return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None


if __name__ == "__main__":
    sys.exit(main())
