"""The public surface: what ``import schedkit`` exports is what the docs list as stable.

* docs/writing-plugins.md ("The public surface") has a row for every name in
  ``schedkit.__all__`` and no other, and every one of them resolves;
* nothing public hides in the package namespace outside ``__all__`` (submodules aside);
* ``import schedkit`` pulls in neither torch nor pyzmq;
* the plugin docs, the README and the example plugin import only ``schedkit`` itself
  (and the test kit ``schedkit.plugins.testing``);
* ``py.typed`` ships with the package.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import schedkit

ROOT = Path(__file__).resolve().parents[1]
SURFACE_DOC = ROOT / "docs" / "writing-plugins.md"
SURFACE_HEADING = "The public surface"
ALLOWED_SUBMODULES = {"plugins.testing"}
SUBMODULE_IMPORT = re.compile(r"\b(?:from|import)\s+schedkit\.([\w.]+)")


def documented_names() -> list[str]:
    """First cells of the table under ``## The public surface``."""
    text = SURFACE_DOC.read_text()
    section = re.split(r"^## +(.+?) *$", text, flags=re.M)
    body = dict(zip(section[1::2], section[2::2], strict=True))[SURFACE_HEADING]
    return re.findall(r"^\| `(\w+)` \|", body, flags=re.M)


def files_for_plugin_authors() -> list[Path]:
    """The docs and the example a plugin author copies from."""
    docs = [ROOT / "README.md", ROOT / "docs" / "writing-plugins.md", ROOT / "docs" / "hooks.md"]
    example = sorted(p for p in (ROOT / "examples" / "plugins").rglob("*")
                     if p.suffix in (".py", ".md", ".toml") and p.is_file())
    return docs + example


def submodule_imports(text: str) -> list[str]:
    """``schedkit.<sub>`` modules imported in ``text`` other than the allowed ones."""
    return [m for m in SUBMODULE_IMPORT.findall(text)
            if not any(m == a or m.startswith(a + ".") for a in ALLOWED_SUBMODULES)]


def test_all_names_resolve_once():
    assert len(schedkit.__all__) == len(set(schedkit.__all__)), "a name listed twice in __all__"
    missing = [n for n in schedkit.__all__ if not hasattr(schedkit, n)]
    assert not missing, f"in schedkit.__all__ but not exported: {missing}"


def test_documented_surface_is_all():
    names = documented_names()
    assert len(names) == len(set(names)), f"{SURFACE_DOC.name}: a name has two rows"
    assert not set(schedkit.__all__) - set(names), (
        f"exported but not documented: {sorted(set(schedkit.__all__) - set(names))}")
    assert not set(names) - set(schedkit.__all__), (
        f"documented but not in schedkit.__all__: {sorted(set(names) - set(schedkit.__all__))}")


def test_no_public_name_outside_all():
    public = {n for n, v in vars(schedkit).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public - {"annotations"} <= set(schedkit.__all__), (
        f"public in schedkit but not in __all__: {sorted(public - set(schedkit.__all__))}")
    assert set(schedkit.__all__) <= set(dir(schedkit))


def test_import_schedkit_needs_neither_torch_nor_pyzmq():
    code = ("import sys, schedkit; "
            "bad = [m for m in ('torch', 'triton', 'zmq') if m in sys.modules]; "
            "assert not bad, bad; "
            "assert schedkit.LLM.__module__ == 'schedkit.llm'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("path", files_for_plugin_authors(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_docs_and_example_import_only_the_top_level(path):
    found = submodule_imports(path.read_text())
    assert not found, (f"{path.relative_to(ROOT)} imports schedkit.{found}: import these names "
                       "from schedkit (add them to the public surface if they are missing)")


def test_submodule_imports_are_found():
    text = ("from schedkit import hookimpl\nfrom schedkit.core.queues import KeyedQueue\n"
            "    import schedkit.kv.connector as c\nfrom schedkit.plugins.testing import step\n"
            'python -c "from schedkit.plugins.manager import discover_plugins"\n'
            "see `schedkit.core.request` for more\n")
    assert submodule_imports(text) == ["core.queues", "kv.connector", "plugins.manager"]


def test_py_typed_is_shipped():
    assert (ROOT / "schedkit" / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["schedkit"]
