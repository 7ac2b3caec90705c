"""The README's results table and docs/results.md's tables are renderings of the one
JSON file ``scripts/bench_all.py`` writes: the pages equal a fresh rendering of the
committed ``docs/results.json``, every section holds a figure, and the README table
keeps its limits (five columns, at most 12 rows, no row over 200 characters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.results_table import (
    MAX_ROWS,
    SECTIONS,
    readme_table_problems,
    render_readme_table,
    rendered_pages,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "docs" / "results.json").read_text())


def test_every_section_of_the_committed_run_holds_a_figure():
    for s in SECTIONS:
        entry = RESULTS["sections"].get(s.key)
        assert entry is not None, f"docs/results.json has no {s.key!r} section"
        assert "not_run" not in entry and "failed" not in entry, (s.key, entry)
    assert {e["commit"] for e in RESULTS["sections"].values()} == {RESULTS["commit"]}, \
        "every section comes from the same run"


def test_the_pages_equal_a_fresh_rendering_of_the_committed_json():
    for path, text in rendered_pages(RESULTS, ROOT).items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from docs/results.json's rendering: run "
            "`python scripts/bench_all.py --render --write-docs`")


def test_the_readme_table_keeps_its_limits():
    assert readme_table_problems(render_readme_table(RESULTS)) == []


@pytest.mark.parametrize("change, problem", [
    (lambda rows: rows + rows[:1] * (MAX_ROWS + 1 - len(rows)), "rows, more than"),
    (lambda rows: [rows[0].replace("| **", "| **" + "9" * 200, 1)] + rows[1:], "characters, more than"),
    (lambda rows: [rows[0] + " extra |"] + rows[1:], "cells"),
])
def test_the_limits_check_finds_each_breach(change, problem):
    lines = render_readme_table(RESULTS).splitlines()
    head = [ln for ln in lines if ln.startswith("|")][:2]
    rows = [ln for ln in lines if ln.startswith("|")][2:]
    assert any(problem in p for p in readme_table_problems("\n".join(head + change(rows))))
