"""Means and confidence intervals over repeated runs (seeds, repeats) of one comparison.

A run's summary (:func:`schedkit.lab.metrics.summarize`) is a tree of dicts with numbers
at the leaves. Over several runs, :func:`mean_summary` gives the same tree with each
number replaced by its mean over the runs, and :func:`ci_summary` the same tree with the
half-width of its 95% Student-t confidence interval: ``mean ± t(0.975, n-1) * s / sqrt(n)``,
``s`` the sample standard deviation. A figure that is infinite in some run (a percentile
reaching into requests never served) has an infinite mean and no interval (NaN); NaN
values (a figure undefined in a run) are left out of both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom (a table to
    30, then the Cornish-Fisher expansion around the normal quantile, within 1e-3)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, half-width of the 95% t-interval)`` of ``values`` (module docstring):
    NaN values are left out; any infinite one makes the mean infinite; fewer than two
    values, or an infinite one, give a NaN half-width."""
    xs = [float(v) for v in values if not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    infinite = {x for x in xs if math.isinf(x)}
    if infinite:  # +inf and -inf together have no mean
        return (infinite.pop() if len(infinite) == 1 else math.nan), math.nan
    n = len(xs)
    if n < 2:
        return xs[0], math.nan
    if all(x == xs[0] for x in xs):  # identical runs (a virtual clock): exactly that value
        return xs[0], 0.0
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, t975(n - 1) * math.sqrt(var / n)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numbers(values: Sequence[Any]) -> list[float] | None:
    """``values`` as floats when every present one is a number (None is skipped)."""
    present = [v for v in values if v is not None]
    if present and all(_is_number(v) for v in present):
        return [float(v) for v in present]
    return None


def _keys(trees: Sequence[Mapping[Any, Any]]) -> list[Any]:
    """Every key of the trees, in first-seen order."""
    return list(dict.fromkeys(k for t in trees for k in t))


def mean_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summaries' tree with every number replaced by its mean over the summaries
    that have it (module docstring); anything else (text, lists) is the first one's."""
    return _combine(summaries, lambda xs: mean_ci(xs)[0]) if summaries else {}  # type: ignore[no-any-return]


def ci_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summaries' tree with every number replaced by the half-width of its 95%
    t-interval (NaN with fewer than two runs); leaves that are not numbers are left out."""
    if not summaries:
        return {}
    return _combine(summaries, lambda xs: mean_ci(xs)[1], keep_other=False)  # type: ignore[no-any-return]


def _combine(trees: Sequence[Any], reduce: Any, keep_other: bool = True) -> Any:
    present = [t for t in trees if t is not None]
    if present and all(isinstance(t, Mapping) for t in present):
        out = {}
        for k in _keys(present):
            value = _combine([t.get(k) for t in present], reduce, keep_other)
            if value is not _SKIP:
                out[k] = value
        return out
    numbers = _numbers(trees)
    if numbers is not None:
        return reduce(numbers)
    return present[0] if keep_other and present else _SKIP


_SKIP = object()
