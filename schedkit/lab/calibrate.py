"""Calibrate the simulator: record the real runner's step times, fit a cost model.

    python scripts/fit_cost_model.py CONFIG.yaml --name h200-qwen2.5-0.5b -o profile.json

runs the config's workload on its (real) runner, then a grid of step shapes (bursts
of identical-length requests: every batch size with every prompt length, so the fit
sees large prefills and large decode batches however the workload is shaped), records
every engine step's features (see :func:`schedkit.runners.simulated.step_features`)
with its measured duration, scheduling and output processing included, and fits the
linear model by non-negative least squares on relative error (coefficients that come
out negative are dropped and the rest refitted).
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schedkit.config import Config
from schedkit.lab.workloads import WorkloadRequest, generate, token_run
from schedkit.runners.simulated import FEATURES, CostModel, StepFeatures, step_features

StepRecord = tuple[StepFeatures, float]


class _Recorder:
    """Wraps a runner: remembers the features of each launched step; :meth:`on_step`
    pairs the oldest with the duration of the engine step that collected it (scheduling
    and output processing included, since the simulator's clock must advance by all of
    it; under async scheduling, the interval between consecutive steps' outputs)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.records: list[StepRecord] = []
        self._launched: deque[StepFeatures | None] = deque()
        if hasattr(runner, "execute_async"):
            self.execute_async = self._execute_async

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _note(self, scheduler_output: Any) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        self._launched.append(step_features(scheduler_output, before)
                              if scheduler_output.num_scheduled_tokens else None)

    def execute(self, scheduler_output: Any) -> Any:
        self._note(scheduler_output)
        return self.runner.execute(scheduler_output)

    def _execute_async(self, scheduler_output: Any) -> Any:
        self._note(scheduler_output)
        return self.runner.execute_async(scheduler_output)

    def on_step(self, engine: Any) -> None:
        features = self._launched.popleft() if self._launched else None
        if features is not None and engine.last_step_s > 0:
            self.records.append((features, engine.last_step_s))


def grid_phases(config: Config, output_len: int = 16, prompt_lens: Sequence[int] | None = None,
                batch_sizes: Sequence[int] | None = None) -> list[list[WorkloadRequest]]:
    """Bursts of ``b`` distinct prompts of ``p`` tokens arriving together, for every
    batch size and prompt length that fits the scheduler and the KV cache: each gives
    prefill steps of up to the token budget, then decode steps at batch ``b`` over
    context ``p``. Defaults: batch sizes 1, 4, 16, 64, 256 up to ``max_num_seqs``
    (and ``max_num_seqs`` itself); prompt lengths 32, 256, 1024, 4096 up to the model
    length."""
    sc, cc = config.scheduler, config.cache
    if batch_sizes is None:
        batch_sizes = sorted({b for b in (1, 4, 16, 64, 256) if b < sc.max_num_seqs} | {sc.max_num_seqs})
    if prompt_lens is None:
        prompt_lens = [p for p in (32, 256, 1024, 4096) if p + output_len <= sc.max_model_len]
    capacity = cc.num_blocks * cc.block_size
    phases, key = [], 1 << 40
    for p in prompt_lens:
        for b in batch_sizes:
            if b * (p + output_len + cc.block_size) > 0.8 * capacity:
                continue
            phase = []
            for i in range(b):
                key += 1
                phase.append(WorkloadRequest(f"grid-p{p}-b{b}-{i}", 0.0,
                                             token_run(key, p, config.runner.vocab_size), output_len))
            phases.append(phase)
    return phases


def record_steps(config: Config, runner: Any = None, workload: list[WorkloadRequest] | None = None,
                 phases: Sequence[list[WorkloadRequest]] = ()) -> list[StepRecord]:
    """Replay a workload (default: the config's own) on one engine, then run each phase
    (requests that all arrive at once) to completion in turn; return every step's
    features and duration on the engine clock."""
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore

    recorder = _Recorder(runner if runner is not None else EngineCore._build_runner(config))
    engine = EngineCore(config, runner=recorder)

    def add(w: WorkloadRequest, offset: float | None) -> None:
        engine.add_request(Request(w.request_id, w.prompt_token_ids,
                                   SamplingParams(max_tokens=w.max_tokens, ignore_eos=True),
                                   arrival_time=engine.now()), offset)

    def drain() -> None:
        while engine.has_requests():
            steps = engine.num_steps
            engine.step()
            if engine.num_steps > steps:
                recorder.on_step(engine)

    for w in workload if workload is not None else generate(config.workload, config.runner.vocab_size):
        add(w, w.arrival_time)
    drain()
    for phase in phases:
        for w in phase:
            add(w, None)
        drain()
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


def fit(records: Sequence[StepRecord], min_samples: int = 3) -> CostModel:
    """The simulator's cost model fitted to recorded steps: the linear part by
    :func:`fit_linear`, then the decode residual table, the median misfit of the
    decode-only steps at each batch size seen at least ``min_samples`` times."""
    coefficients = fit_linear(records)
    linear = CostModel.from_coefficients(coefficients)
    by_batch: dict[int, list[float]] = {}
    for f, d in records:
        if d > 0 and not f[4]:
            by_batch.setdefault(int(f[1]), []).append(d - linear.step_time(f))
    table = {b: statistics.median(r) for b, r in sorted(by_batch.items()) if len(r) >= min_samples}
    return CostModel.from_coefficients(coefficients, table)


def fit_linear(records: Sequence[StepRecord]) -> dict[str, float]:
    """Non-negative least-squares fit of the cost model's coefficients.

    Each step counts by its relative error (rows divided by the measured duration), so
    the many short decode steps that set TPOT weigh as much as long prefill steps.
    Features are scaled to unit mean before solving so the tiny per-token coefficients
    and the per-step base share one numeric range.
    """
    records = [r for r in records if r[1] > 0]
    if len(records) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(records)}")
    xs = [[1.0 / d, *(x / d for x in f)] for f, d in records]
    ys = [1.0] * len(records)
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


def relative_error(records: Sequence[StepRecord], model: CostModel) -> float:
    """Mean |predicted - measured| / measured over the records."""
    errs = [abs(model.step_time(f) - d) / d for f, d in records if d > 0]
    return sum(errs) / len(errs) if errs else float("nan")


def write_profile(path: str | Path, name: str, model: CostModel, description: str,
                  num_steps: int, error: float) -> None:
    Path(path).write_text(json.dumps({
        "name": name, "description": description, "fitted": True, "num_steps": num_steps,
        "mean_relative_step_error": error,
        "coefficients": {k: getattr(model, k) for k in FEATURES},
        "decode_batch_residual_s": {str(b): t for b, t in model.decode_batch_residual_s}}, indent=2) + "\n")
