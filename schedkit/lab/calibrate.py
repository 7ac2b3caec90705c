"""Calibrate the simulator: record the real runner's step times, fit a cost model.

    python scripts/fit_cost_model.py CONFIG.yaml --name h200-qwen2.5-0.5b -o profile.json

runs the config's workload on its (real) runner, records every step's features
(tokens, requests, context tokens read, prefill attention work; see
:func:`schedkit.runners.simulated.step_features`) with the measured duration, and fits
the linear model by non-negative least squares (coefficients that come out negative are
dropped and the rest refitted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schedkit.config import Config
from schedkit.runners.simulated import FEATURES, step_features

StepRecord = tuple[tuple[float, float, float, float], float]


class _Recorder:
    """Wraps a runner: records (features, measured duration) of every non-empty step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.records: list[StepRecord] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, scheduler_output: Any) -> Any:
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        out = self.runner.execute(scheduler_output)
        if out.req_ids and out.step_duration is not None:
            self.records.append((step_features(scheduler_output, before), out.step_duration))
        return out


def record_steps(config: Config, runner: Any = None) -> list[StepRecord]:
    """Run the config's workload and return every step's features and duration."""
    from schedkit.core.engine_core import EngineCore
    from schedkit.lab.simulate import run_workload

    recorder = _Recorder(runner if runner is not None else EngineCore._build_runner(config))
    run_workload(config, runner=recorder)
    return recorder.records


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares via the normal equations (Gauss-Jordan with partial pivoting)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
         for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-30:
            a[piv][col] = 1e-30  # a feature that never varies: its coefficient goes to 0
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit(records: Sequence[StepRecord]) -> dict[str, float]:
    """Non-negative least-squares fit of the simulator's cost model.

    Features are scaled to unit mean before solving so the tiny per-token coefficients
    and the per-step base share one numeric range.
    """
    if len(records) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(records)}")
    xs = [[1.0, *f] for f, _ in records]
    ys = [d for _, d in records]
    scale = [max(sum(abs(x[i]) for x in xs) / len(xs), 1e-30) for i in range(len(FEATURES))]
    active = list(range(len(FEATURES)))
    while True:
        coef = _solve([[x[i] / scale[i] for i in active] for x in xs], ys)
        negative = [i for i, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
        if not active:
            coef = []
            break
    out = dict.fromkeys(FEATURES, 0.0)
    for i, c in zip(active, coef, strict=True):
        out[FEATURES[i]] = c / scale[i]
    return out


def relative_error(records: Sequence[StepRecord], coefficients: dict[str, float]) -> float:
    """Mean |predicted - measured| / measured over the records."""
    from schedkit.runners.simulated import CostModel

    c = coefficients
    model = CostModel(base_s=c["base_s"], per_token_s=c["per_token_s"], per_request_s=c["per_request_s"],
                      per_context_token_s=c["per_context_token_s"],
                      per_prefill_attention_s=c["per_prefill_attention_s"])
    errs = [abs(model.step_time(f) - d) / d for f, d in records if d > 0]
    return sum(errs) / len(errs) if errs else float("nan")


def write_profile(path: str | Path, name: str, coefficients: dict[str, float], description: str,
                  num_steps: int, error: float) -> None:
    Path(path).write_text(json.dumps({
        "name": name, "description": description, "fitted": True, "num_steps": num_steps,
        "mean_relative_step_error": error, "coefficients": coefficients}, indent=2) + "\n")
