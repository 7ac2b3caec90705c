"""docs/scheduler-behaviour.md is the repository's own index of pinned behaviours.

* every ``docs/scheduler-behaviour.md#<id>`` cited in schedkit/, tests/ and docs/ is an
  id the page defines, and every id it defines is unique;
* every test the page names (``tests/...py::test_name``) exists;
* no comment or docstring in schedkit/ or tests/ cites the numbering of the external
  specification (sections such as "spec 4.7", scenarios such as "S70", harnesses such
  as "H4"), which a clone of the repository does not have;
* the oracle test fails in CI when ../shared/oracle is missing, and elsewhere skips
  saying so.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scheduler-behaviour.md"
CITATION = re.compile(r"scheduler-behaviour\.md#([A-Za-z0-9_-]+)")
ANCHOR = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
# The external numbering: "spec 4.7", "Spec section 7.2", "spec §2.5", "(spec 2.5 step
# 10)", scenario ids "S01".."S99", harness ids "H1".."H4".
EXTERNAL = [
    re.compile(r"\bspec(?:\s+section)?\s+§?\s*[1-8]\.[0-9]", re.I),
    re.compile(r"\bS[0-9]{2}\b"),
    re.compile(r"\bH[1-4]\b"),
    re.compile(r"\bharness\s+H\d", re.I),
    re.compile(r"shared/spec"),
]


def source_files() -> list[Path]:
    return sorted(p for d in ("schedkit", "tests") for p in (ROOT / d).rglob("*.py"))


def anchors() -> list[str]:
    return ANCHOR.findall(DOC.read_text())


def test_anchors_are_unique_and_each_has_tests():
    ids = anchors()
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    # every item runs from its anchor to the next one and names at least one test
    items = ANCHOR.split(DOC.read_text())[1:]
    untested = [items[i] for i in range(0, len(items), 2) if not NAMED_TEST.search(items[i + 1])]
    assert not untested, f"items naming no test: {untested}"


def test_every_cited_anchor_exists():
    ids = set(anchors())
    files = source_files() + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    missing = [(str(p.relative_to(ROOT)), a) for p in files for a in CITATION.findall(p.read_text())
               if a not in ids]
    assert not missing, f"cited ids the page does not define: {missing}"


def test_code_cites_the_page():
    cited = {a for p in source_files() for a in CITATION.findall(p.read_text())}
    assert len(cited) >= 30, sorted(cited)


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")}


def test_every_named_test_exists():
    named = NAMED_TEST.findall(DOC.read_text())
    assert named
    missing = [f"{f}::{t}" for f, t in named
               if not (ROOT / f).is_file() or t not in _test_names(ROOT / f)]
    assert not missing, f"docs/scheduler-behaviour.md names tests that do not exist: {missing}"


def test_no_citation_of_the_external_spec():
    hits = []
    for path in source_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        for pattern in EXTERNAL:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not hits, "cite docs/scheduler-behaviour.md#<id> instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("ci, rc, says", [
    ("1", 1, "CI must run the oracle"),
    ("", 0, "../shared/oracle is missing"),
])
def test_oracle_without_shared_fails_in_ci_and_skips_elsewhere(ci, rc, says, tmp_path):
    env = dict(os.environ, SCHEDKIT_SHARED=str(tmp_path / "nowhere"), CI=ci)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/core/test_oracle.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert says in proc.stdout, proc.stdout
