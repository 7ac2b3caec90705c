"""The regression checks of benchmarks/conftest.py: the metric comparison itself, and, in
a throwaway project that uses the same conftest, where the baselines are looked for and
how a regression is reported (an ordinary test failure, never a traceback)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # benchmark runs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("bench_conftest", BENCHMARKS / "conftest.py")
bench_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_conftest)


def test_serving_regressions_flags_worse_metrics_only():
    prev = {"serving": {"ttft_p50_s": 1.0, "goodput_req_s": 10.0, "e2e_p50_s": 2.0}}
    cur = {"serving": {"ttft_p50_s": 1.2, "goodput_req_s": 8.0, "e2e_p50_s": 1.0},
           "serving_higher_is_better": ["goodput_req_s"]}
    msgs = bench_conftest.serving_regressions(cur, prev, 0.10)
    assert msgs == ["serving metric goodput_req_s: 10 -> 8 (-20.0%)",
                    "serving metric ttft_p50_s: 1 -> 1.2 (+20.0%)"]  # worst first
    assert bench_conftest.serving_regressions(cur, prev, 0.5) == []


def test_serving_regressions_from_zero_and_missing_values():
    prev = {"serving": {"preemptions": 0, "slo_attainment": 0.0, "gone": 1.0, "x": None}}
    cur = {"serving": {"preemptions": 3, "slo_attainment": 0.0, "new": 5.0, "x": 2.0},
           "serving_higher_is_better": ["slo_attainment"]}
    assert bench_conftest.serving_regressions(cur, prev, 0.10) == [
        "serving metric preemptions: 0 -> 3 (was zero)"]


PROJECT_TEST = '''
import os


def test_metric(benchmark):
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["serving"] = {"ttft_p99_s": float(os.environ.get("TTFT", "0.21"))}
'''


@pytest.fixture
def project(tmp_path):
    """A project with benchmarks/conftest.py (ours) and one benchmark reporting a TTFT."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider"\n')
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(BENCHMARKS / "conftest.py", tmp_path / "benchmarks" / "conftest.py")
    (tmp_path / "benchmarks" / "test_metric.py").write_text(PROJECT_TEST)
    (tmp_path / "benchmarks" / "test_new.py").write_text(PROJECT_TEST)
    return tmp_path


def pytest_in(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "CI"}
    environ.update(env, COLUMNS="300")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=120)


def test_baselines_are_found_from_the_project_root(project):
    bench = project / "benchmarks"
    none = pytest_in(bench, "test_metric.py", "--benchmark-compare")
    assert none.returncode == 4, none.stdout + none.stderr  # a usage error, not a pass
    assert f"--benchmark-compare: no saved run in {project / '.benchmarks'}" in none.stderr

    saved = pytest_in(project, "benchmarks/test_metric.py", "--benchmark-autosave")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    [baseline] = (project / ".benchmarks").rglob("0001_*.json")

    same = pytest_in(bench, "test_metric.py", "--benchmark-compare")  # from benchmarks/
    assert same.returncode == 0, same.stdout + same.stderr
    assert "1 benchmarks, 0 regressed" in same.stdout and not (bench / ".benchmarks").exists()

    worse = pytest_in(bench, "test_metric.py", "--benchmark-compare", "--benchmark-autosave", TTFT="0.43")
    assert worse.returncode == 1 and "Traceback" not in worse.stdout + worse.stderr
    assert len(list((project / ".benchmarks").rglob("*.json"))) == 1  # not the new baseline
    assert re.search(r"^FAILED test_metric\.py::test_metric - serving metric ttft_p99_s: "
                     r"0\.21 -> 0\.43 \(\+104\.8%\)$", worse.stdout, re.MULTILINE), worse.stdout
    assert re.search(r"^1 failed in ", worse.stdout, re.MULTILINE)

    new = pytest_in(bench, "test_new.py", "--benchmark-compare")  # not in the baseline
    assert new.returncode == 1, new.stdout + new.stderr
    assert "none of the 1 benchmarks run is in the compared run" in new.stdout

    # pytest-benchmark's own timing check fails the test too (the baseline made 1 ns fast)
    data = json.loads(baseline.read_text())
    data["benchmarks"][0]["stats"]["min"] = 1e-9
    baseline.write_text(json.dumps(data))
    slow = pytest_in(bench, "test_metric.py", "--benchmark-compare", "--benchmark-compare-fail=min:5%")
    assert slow.returncode == 1 and "Traceback" not in slow.stdout + slow.stderr
    assert re.search(r"^FAILED test_metric\.py::test_metric - timing: Field 'min' has failed",
                     slow.stdout, re.MULTILINE), slow.stdout
