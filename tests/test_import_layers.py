"""The import direction of DESIGN.md: a lower layer never imports a higher one.

    cli, engine wiring ...... anything
    lab/ .................... everything but cli (it runs whole engines)
    plugins/ ................ hookspecs, policies, core, kv, config, errors
    policies/, runners/ ..... hookspecs, core, kv, config, errors
    core/ ................... kv, config, errors (hooks only through core/hooks.py's Protocol)
    kv/ ..................... config, errors
    config, errors .......... stdlib, pydantic, yaml

Engine wiring (core/engine_core.py and the engine process and client modules) builds the
plugin manager and the runner, so it may import anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "schedkit"
WIRING = {"schedkit.cli", "schedkit.core.engine_core", "schedkit.core.engine_proc",
          "schedkit.core.client", "schedkit", "schedkit.runners"}
ALLOWED = {
    "schedkit.plugins": {"hookspecs", "policies", "core", "kv", "config", "errors", "plugins", "runners"},
    "schedkit.policies": {"hookspecs", "core", "kv", "config", "errors", "policies"},
    "schedkit.runners": {"hookspecs", "core", "kv", "config", "errors", "runners"},
    # the lab drives whole engines (workloads, simulator calibration, comparisons)
    "schedkit.lab": {"core", "kv", "config", "errors", "lab", "runners", "plugins", "hookspecs"},
    "schedkit.core": {"kv", "config", "errors", "core"},
    "schedkit.kv": {"config", "errors", "kv"},
    "schedkit.config": {"errors"},
    "schedkit.errors": set(),
    "schedkit.hookspecs": {"config", "core", "kv"},  # annotations only (TYPE_CHECKING)
}
THIRD_PARTY_BANNED = {
    "schedkit.core": {"pluggy", "torch", "triton"},
    "schedkit.kv": {"pluggy", "torch", "triton"},
    "schedkit.policies": {"torch", "triton"},
    "schedkit.config": {"torch", "pluggy"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer_of(mod: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if mod == layer or mod.startswith(layer + "."):
            return layer
    raise AssertionError(f"module {mod} belongs to no layer")


def test_lower_layers_never_import_higher_ones():
    violations = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        if mod in WIRING or mod.startswith("schedkit.runners.paged"):
            continue
        layer = layer_of(mod)
        for imp in imports_of(path):
            top = imp.split(".")[0]
            if top in THIRD_PARTY_BANNED.get(layer, set()):
                violations.append(f"{mod} imports {imp}")
            if imp.startswith("schedkit."):
                target = imp.split(".")[1]
                if target not in ALLOWED[layer]:
                    violations.append(f"{mod} imports {imp}")
    assert not violations, "\n".join(violations)


def test_import_schedkit_and_scheduler_without_torch():
    code = ("import sys; import schedkit, schedkit.core.scheduler, schedkit.plugins.testing, "
            "schedkit.cli, schedkit.core.engine_core; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
