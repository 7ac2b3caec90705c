"""Fitting the simulator's cost model to recorded steps, and how well it fits.

The linear part is fitted by non-negative least squares on relative error (coefficients
that come out negative are dropped and the rest refitted); then the decode residual
table takes the median misfit of the decode-only steps at each batch size; the two are
fitted in turn a few times, each to what the other leaves. See
:mod:`schedkit.runners.cost_model` for the model itself.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from schedkit.runners.cost_model import FEATURES, STEP_KINDS, CostModel, StepFeatures

StepRecord = tuple[StepFeatures, float]
"""One step: its features and its measured duration (seconds)."""


def write_steps(path: str | Path, records: Sequence[StepRecord]) -> None:
    """Write ``records`` as JSON lines (``{"seconds": s, "features": {name: value}}``),
    so that a change of the cost model can be fitted and judged against measured steps
    without running them again (:func:`read_steps`)."""
    with Path(path).open("w") as f:
        for features, seconds in records:
            f.write(json.dumps({"seconds": seconds, "features": features._asdict()}) + "\n")


def read_steps(path: str | Path) -> list[StepRecord]:
    """The records :func:`write_steps` wrote (features it did not know count 0).

    Raises:
        ValueError: A line is not such a record; the message names the file and line.
    """
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            data = json.loads(line)
            record = (StepFeatures(**{k: float(v) for k, v in data["features"].items()}), float(data["seconds"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: not a step record ({e})") from None
        if not 0 <= record[1] < math.inf or not all(0 <= x < math.inf for x in record[0]):
            raise ValueError(f"{path}:{n}: not a step record (seconds and features must be finite "
                             f"and >= 0, got {data['seconds']!r} and {data['features']!r})")
        out.append(record)
    return out

RIDGE = 1e-9
"""Relative weight of the ridge term that keeps the normal equations solvable when two
features move together in every recorded step (their shared cost is then split evenly)."""


def _solve(rows: list[list[float]], ys: list[float], ridge: float = 0.0) -> list[float]:
    """Least squares via the normal equations (Gauss-Jordan with partial pivoting), with
    ``ridge`` times the number of rows added to the diagonal."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)]
         + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))] for i in range(n)]
    for i in range(n):
        a[i][i] += ridge * len(rows)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-30:
            a[piv][col] = 1e-30  # a feature that never varies: its coefficient goes to 0
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                if f:
                    a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


BACKFIT_ROUNDS = 5
"""Rounds of fitting the linear part and the decode residual table in turn."""
OUTLIER_FACTOR = 5.0
OUTLIER_FLOOR = 0.25
"""A step whose relative error under the first fit exceeds ``OUTLIER_FACTOR`` times the
median one (and ``OUTLIER_FLOOR``) is left out of the second: a step stretched by the
operating system or a garbage collection weighs, squared, as much as hundreds of
ordinary ones."""


def fit(records: Sequence[StepRecord], min_samples: int = 3, attention_workers: int = 0,
        rounds: int = BACKFIT_ROUNDS) -> CostModel:
    """The simulator's cost model fitted to recorded steps: the linear part by
    :func:`fit_linear` (twice: the second time without the outliers of the first), then
    the decode residual table, the median misfit of the decode-only steps at each batch
    size seen at least ``min_samples`` times. The two are fitted in turn ``rounds``
    times, the linear part each time to the durations less the table's residuals
    (backfitting): a jump by batch size that a line cannot follow (a CPU matmul slower
    at 2 rows than at 1) would otherwise bend the line's coefficients, the context one
    above all, since a larger batch also reads more context. ``attention_workers`` is
    what the records' imbalance feature was read with
    (:attr:`CostModel.attention_workers`)."""
    table: dict[int, float] = {}
    coefficients: dict[str, float] = {}
    for _ in range(max(1, rounds)):
        adjusted = [(f, d - table.get(int(f[1]), 0.0) if not f[4] else d) for f, d in records]
        coefficients = _fit_without_outliers([(f, d) for f, d in adjusted if d > 0])
        linear = CostModel.from_coefficients(coefficients)
        by_batch: dict[int, list[float]] = {}
        for f, d in records:
            if d > 0 and not f[4]:
                by_batch.setdefault(int(f[1]), []).append(d - linear.step_time(f))
        table = {b: statistics.median(r) for b, r in sorted(by_batch.items()) if len(r) >= min_samples}
    return CostModel.from_coefficients(coefficients, table, attention_workers)


def _fit_without_outliers(records: Sequence[StepRecord]) -> dict[str, float]:
    """:func:`fit_linear`, then again without the steps the first fit misses by more than
    ``OUTLIER_FACTOR`` times the median relative error (and ``OUTLIER_FLOOR``)."""
    coefficients = fit_linear(records)
    linear = CostModel.from_coefficients(coefficients)
    errs = [abs(linear.step_time(f) - d) / d for f, d in records]
    cut = max(OUTLIER_FLOOR, OUTLIER_FACTOR * statistics.median(errs))
    kept = [r for r, e in zip(records, errs, strict=True) if e <= cut]
    if len(FEATURES) <= len(kept) < len(records):
        coefficients = fit_linear(kept)
    return coefficients


def fit_linear(records: Sequence[StepRecord]) -> dict[str, float]:
    """Non-negative least-squares fit of the cost model's coefficients.

    Each step counts by its relative error (rows divided by the measured duration), so
    the many short decode steps that set TPOT weigh as much as long prefill steps.
    Features are scaled to unit mean before solving so the tiny per-token coefficients
    and the per-step base share one numeric range. A feature that is 0 in every step
    gets 0.

    Raises:
        ValueError: Fewer steps than coefficients.
    """
    records = [r for r in records if r[1] > 0]
    if len(records) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(records)}")
    n = len(FEATURES)
    xs = [[1.0 / d, *(x / d for x in _padded(f))] for f, d in records]
    ys = [1.0] * len(records)
    scale = [max(sum(abs(x[i]) for x in xs) / len(xs), 1e-30) for i in range(n)]
    active = [i for i in range(n) if any(x[i] for x in xs)]
    coef: list[float] = []
    while active:
        coef = _solve([[x[i] / scale[i] for i in active] for x in xs], ys, RIDGE)
        negative = [i for i, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
        coef = []
    out = dict.fromkeys(FEATURES, 0.0)
    for i, c in zip(active, coef, strict=True):
        out[FEATURES[i]] = c / scale[i]
    return out


def _padded(f: StepFeatures | tuple[float, ...]) -> tuple[float, ...]:
    """All the features of ``f`` (a plain tuple of the first five counts the rest 0)."""
    return tuple(f) + (0.0,) * (len(FEATURES) - 1 - len(f))


def relative_errors(records: Sequence[StepRecord], model: CostModel) -> list[tuple[str, float]]:
    """(step kind, |predicted - measured| / measured) of every record."""
    return [(StepFeatures(*_padded(f)).kind, abs(model.step_time(f) - d) / d) for f, d in records if d > 0]


def relative_error(records: Sequence[StepRecord], model: CostModel) -> float:
    """Mean |predicted - measured| / measured over the records."""
    errs = [e for _, e in relative_errors(records, model)]
    return sum(errs) / len(errs) if errs else float("nan")


def _summary(errs: list[float]) -> dict[str, float]:
    errs = sorted(errs)
    return {"num_steps": len(errs), "mean": sum(errs) / len(errs), "median": statistics.median(errs),
            "p90": errs[min(len(errs) - 1, int(0.9 * len(errs)))]}


def residuals(records: Sequence[StepRecord], model: CostModel) -> dict[str, dict[str, float]]:
    """Relative step error (mean, median, p90 and the number of steps) overall and per
    step kind (prefill, decode, mixed; a kind with no step is left out)."""
    errs = relative_errors(records, model)
    if not errs:
        return {}
    out = {"overall": _summary([e for _, e in errs])}
    for kind in STEP_KINDS:
        mine = [e for k, e in errs if k == kind]
        if mine:
            out[kind] = _summary(mine)
    return out
