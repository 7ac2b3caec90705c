"""Benchmark-suite plumbing: serving metrics take part in ``--benchmark-compare``
(docs/benchmarks.md).

A benchmark may put ``extra_info["serving"] = {metric: value}`` (lower is better) and
``extra_info["serving_higher_is_better"] = [metric, ...]`` (benchmarks/serving.py builds
both). With ``--benchmark-compare`` every benchmark is checked against the compared run
as its own test ends: a serving metric worse by more than ``--serving-tolerance``, or a
failed ``--benchmark-compare-fail`` timing check, makes that test fail like any other,
with one line per metric (the worst first, which the short summary shows)::

    serving metric prio0_ttft_mean_s: 0.2447 -> 8.895 (+3534.6%)
    serving metric goodput_req_s: 7.193 -> 5.99 (-16.7%)
    ...
    FAILED benchmarks/test_lab.py::test_bundled_policy[priority] - serving metric prio0_...

Options (besides pytest-benchmark's):

``--serving-tolerance FRACTION``
    Relative worsening that counts as a regression (default 0.10). The serving metrics
    are on the virtual clock, so an unchanged scheduler reproduces them exactly.
``--lab-config PATH`` (repeatable)
    Benchmark the compare profiles of a lab YAML (or its single ``scheduler.policy``)
    as ``test_lab.py::test_lab_config[<file stem>:<profile>]``, with the same serving
    metrics and checks as the bundled policies: a third-party policy installed in the
    ``schedkit`` entry-point group and named in the YAML is regression-checked too.
    Without the option that test is skipped.

Storage: the default ``--benchmark-storage`` (``./.benchmarks``) is taken relative to the
project root (pytest's rootdir, the folder of pyproject.toml), not to the current folder,
so a run from ``benchmarks/`` finds the same baselines; an explicit path is used as
given. ``--benchmark-compare`` that finds no saved run is a usage error (exit code 4)
naming the folder searched, never a silent pass.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "")

DEFAULT_STORAGE = "file://./.benchmarks"  # pytest-benchmark's default, relative to the cwd
_STASH_KEY = pytest.StashKey[dict[str, Any]]()
_LAB_CASES_KEY = pytest.StashKey[list[Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("schedkit benchmarks")
    group.addoption("--serving-tolerance", type=float, default=0.10,
                    help="relative worsening of a serving metric that counts as a regression "
                         "(default 0.10)")
    group.addoption("--lab-config", action="append", default=[], metavar="PATH",
                    help="benchmark the compare profiles of this lab YAML as well (repeatable)")


# ------------------------------------------------------------------------------ checks
def serving_regressions(current: dict, previous: dict, tolerance: float) -> list[str]:
    """One line for every serving metric of ``current`` worse than in ``previous``, the
    worst (largest relative change) first.

    ``current`` and ``previous`` are ``extra_info`` mappings. A metric missing on either
    side, or not a finite number, is not compared; a lower-is-better metric that was 0
    regresses when it becomes positive.
    """
    now, before = current.get("serving", {}), previous.get("serving", {})
    higher = set(current.get("serving_higher_is_better", ()))
    found: list[tuple[float, str]] = []
    for key, value in now.items():
        old = before.get(key)
        if not (_is_number(old) and _is_number(value)):
            continue
        if old == 0:
            if key not in higher and value > 0:
                found.append((math.inf, f"serving metric {key}: 0 -> {value:.4g} (was zero)"))
            continue
        change = (value - old) / abs(old)
        if (change < -tolerance) if key in higher else (change > tolerance):
            found.append((abs(change), f"serving metric {key}: {old:.4g} -> {value:.4g} ({change:+.1%})"))
    return [line for _, line in sorted(found, key=lambda f: -f[0])]


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def timing_regressions(stats: Any, previous_stats: dict, checks: list) -> list[str]:
    """pytest-benchmark's ``--benchmark-compare-fail`` checks, one line each."""
    found = []
    for check in checks or ():
        fail = check.fails(stats, previous_stats)
        if fail:
            found.append(f"timing: {fail}")
    return found


# ----------------------------------------------------------------------------- storage
def pytest_configure(config: pytest.Config) -> None:
    # Runs before pytest-benchmark's own pytest_configure (trylast) opens the storage.
    if getattr(config.option, "benchmark_storage", None) == DEFAULT_STORAGE:
        config.option.benchmark_storage = f"file://{config.rootpath / '.benchmarks'}"
    config.stash[_STASH_KEY] = {"compared": [], "missing": [], "failed": []}
    config.stash[_LAB_CASES_KEY] = lab_cases(config.getoption("--lab-config"))


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_benchmark_compare_machine_info(config, benchmarksession, machine_info, compared_benchmark):
    # pytest-benchmark's warning about a different machine names the storage relative to
    # the current folder, which raises ValueError when the storage (now at the project
    # root) is not below it: warn here instead.
    try:
        return (yield)
    except ValueError:
        benchmarksession.logger.warning(
            f"Benchmark machine_info is different from the saved run's (storage: "
            f"{benchmarksession.storage}).")
        return None


def _session(config: pytest.Config) -> Any:
    bs = getattr(config, "_benchmarksession", None)
    return None if bs is None or bs.disabled else bs


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    bs = _session(session.config)
    if bs is None:
        return
    if bs.compare_fail and not bs.compare:
        raise pytest.UsageError("--benchmark-compare-fail needs --benchmark-compare")
    if bs.compare and not bs.compared_mapping:
        which = "no saved run" if bs.compare is True else f"no saved run matching {bs.compare!r}"
        raise pytest.UsageError(
            f"--benchmark-compare: {which} in {bs.storage} (default storage: .benchmarks at the "
            f"project root {session.config.rootpath}); save a baseline first with "
            "--benchmark-autosave, or point --benchmark-storage at one")


# -------------------------------------------------------------------- --lab-config cases
def lab_cases(paths: list[str]) -> list[Any]:
    """One ``pytest.param((path, profile name), id="<stem>:<profile>")`` per compare
    profile of each ``--lab-config`` file.

    Raises:
        pytest.UsageError: A file that does not load (schedkit's message: key, value, line).
    """
    if not paths:
        return []
    from schedkit.config import load_config
    from schedkit.errors import ConfigError
    from schedkit.lab.compare import profiles_of

    cases = []
    for raw in paths:
        path = Path(raw).resolve()
        try:
            config = load_config(path)
        except ConfigError as e:
            raise pytest.UsageError(f"--lab-config {raw}: {e}") from None
        cases += [pytest.param((str(path), p.name), id=f"{path.stem}:{p.name}")
                  for p in profiles_of(config)]
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "lab_case" in metafunc.fixturenames:
        cases = metafunc.config.stash[_LAB_CASES_KEY] or [
            pytest.param(None, marks=pytest.mark.skip(reason="no --lab-config PATH given"))]
        metafunc.parametrize("lab_case", cases)


# -------------------------------------------------------------------- per-test compare
def compare_benchmark(item: pytest.Item) -> list[str]:
    """The regressions of ``item``'s benchmark against every compared run."""
    bs = _session(item.config)
    fixture = getattr(item, "funcargs", {}).get("benchmark")
    if bs is None or not bs.compared_mapping or fixture is None or fixture.stats is None:
        return []
    state = item.config.stash[_STASH_KEY]
    lines: list[str] = []
    found = False
    for mapping in bs.compared_mapping.values():
        previous = mapping.get(fixture.fullname)
        if previous is None:
            continue
        found = True
        lines += serving_regressions(fixture.extra_info, previous.get("extra_info", {}),
                                     item.config.getoption("--serving-tolerance"))
        lines += timing_regressions(fixture.stats, previous.get("stats", {}), bs.compare_fail)
    state["compared" if found else "missing"].append(fixture.fullname)
    if lines:
        state["failed"].append(fixture.fullname)
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # A benchmark that passed by itself fails here when it regressed; its report's text
    # is the one line per metric, which pytest's short summary starts with (the worst).
    report = yield
    if report.when == "call" and report.passed:
        lines = compare_benchmark(item)
        if lines:
            report.outcome = "failed"
            report.longrepr = "\n".join(lines)
    return report


@pytest.hookimpl(specname="pytest_sessionfinish", wrapper=True, tryfirst=True)
def pytest_sessionfinish_unsaved_if_regressed(session: pytest.Session):
    # Outside pytest-benchmark's own wrapper, which saves the run: a run that regressed
    # must not become the next baseline (``--benchmark-compare --benchmark-autosave``).
    bs = _session(session.config)
    state = session.config.stash[_STASH_KEY]
    if bs is not None and state["failed"] and (bs.save or bs.autosave):
        state["not_saved"] = True
        bs.save = bs.autosave = None
    return (yield)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    bs = _session(session.config)
    if bs is None or not bs.compared_mapping:
        return
    # Every --benchmark-compare-fail finding was already a failure of its own test (above);
    # left in place, pytest-benchmark would raise PerformanceRegression out of pytest.
    bs.performance_regressions.clear()
    state = session.config.stash[_STASH_KEY]
    if state["missing"] and not state["compared"] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # compared nothing: not a pass


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    bs = _session(config)
    if bs is None or not bs.compared_mapping:
        return
    state = config.stash[_STASH_KEY]
    baselines = ", ".join(str(p) for p in bs.compared_mapping)
    tr = terminalreporter
    tr.section("benchmark comparison", sep="-")
    if state["missing"] and not state["compared"]:
        tr.write_line(f"FAILED: none of the {len(state['missing'])} benchmarks run is in the "
                      f"compared run {baselines}: nothing was compared", red=True, bold=True)
        return
    tr.write_line(f"compared against {baselines}: {len(state['compared'])} benchmarks, "
                  f"{len(state['failed'])} regressed (serving tolerance "
                  f"{config.getoption('--serving-tolerance'):.0%})")
    if state.get("not_saved"):
        tr.write_line("this run was NOT saved: a run that regressed does not become the "
                      "baseline (save without --benchmark-compare to accept it)", yellow=True)
    if state["missing"]:
        tr.write_line(f"not in the compared run (not checked): {', '.join(state['missing'])}")
