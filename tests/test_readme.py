"""The README is the front door: its first screen holds the two set-up commands and a
first policy, and what it shows works as written. The engine example of docs/engine.md
runs too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


def _block(text: str, opening: str) -> str:
    start = text.index(opening)
    return text[start + len(opening): text.index("```", start + len(opening))]


def test_first_screen_holds_the_quick_start_and_a_policy():
    assert "## Quick start" in FIRST_SCREEN and "## A first policy" in FIRST_SCREEN
    assert "@hookimpl" in FIRST_SCREEN


def test_the_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(line.strip() for line in README.splitlines() if "pytest" in line and "pip install" in line)
    assert test_cmd in ci, (test_cmd, ci)
    run_cmd = next(line.strip() for line in README.splitlines() if "schedkit run configs/" in line)
    assert (ROOT / run_cmd.split("schedkit run ")[1]).is_file()


def test_the_first_policy_works_as_written():
    code = _block(README, "```python\n")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    from schedkit.plugins.testing import make_request, make_scheduler

    sched = make_scheduler(plugins=[namespace["ShortestPromptFirst"]()], max_num_seqs=1)
    for rid, n in (("long", 30), ("short", 5), ("mid", 12)):
        sched.add_request(make_request(rid, [1] * n))
    assert [r.request_id for r in sched.waiting] == ["short", "mid", "long"]


def test_links_lead_to_files():
    import re
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_engine_example_runs():
    text = (ROOT / "docs" / "engine.md").read_text()
    code = _block(text, "```python\nimport asyncio")
    code = "import asyncio" + code
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "length" in out.stdout
