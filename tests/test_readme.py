"""The README's Python example runs as written (from the repository root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_engine_example_runs():
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\nimport asyncio")
    code = text[start + len("```python\n"): text.index("```", start + 10)]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "length" in out.stdout
