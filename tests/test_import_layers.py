"""The import direction of DESIGN.md: a lower layer never imports a higher one, and no
module imports itself back through another (no cycles, ``TYPE_CHECKING`` imports
included).

    schedkit (the public surface), cli ... anything
    lab/ ........................... cluster, engine and below (it runs whole engines)
    server/ ........................ llm, cluster, engine and below (the HTTP front door)
    llm ............................ cluster, engine and below (LLM and AsyncLLM)
    cluster/ ....................... engine and below (replicas and the router)
    engine/ ........................ plugins, runners and below
    plugins/ ....................... hookspecs, policies, runners (the registry), structured, core, kv
    policies/, runners/ ............ hookspecs, core, kv, config, errors
    structured/ .................... hookspecs, core, config, errors (torch and xgrammar lazily)
    core/ .......................... kv, config, errors (hooks only through core/hooks.py's Protocol)
    kv/ ............................ config, errors
    config, errors ................. stdlib, pydantic, yaml

No module is exempt; imports by name (``importlib.import_module``, ``__import__``) are
checked like statements.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "schedkit"
_BELOW_ENGINE = {"hookspecs", "policies", "runners", "plugins", "structured", "core", "kv", "config",
                 "errors"}
ALLOWED = {
    "schedkit.cli": _BELOW_ENGINE | {"engine", "cluster", "llm", "lab", "server", "cli"},
    "schedkit.server": _BELOW_ENGINE | {"engine", "cluster", "llm", "server"},
    "schedkit.lab": _BELOW_ENGINE | {"engine", "cluster", "lab"},
    "schedkit.llm": _BELOW_ENGINE | {"engine", "cluster"},
    "schedkit.cluster": _BELOW_ENGINE | {"engine", "cluster"},
    "schedkit.engine": _BELOW_ENGINE | {"engine"},
    "schedkit.plugins": {"hookspecs", "policies", "core", "kv", "config", "errors", "plugins", "runners",
                         "structured"},
    "schedkit.structured": {"hookspecs", "core", "config", "errors", "structured"},
    "schedkit.policies": {"hookspecs", "core", "kv", "config", "errors", "policies"},
    "schedkit.runners": {"hookspecs", "core", "kv", "config", "errors", "runners"},
    "schedkit.core": {"kv", "config", "errors", "core"},
    "schedkit.kv": {"config", "errors", "kv"},
    "schedkit.config": {"errors", "config"},
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
    """The modules ``path`` imports: statements, and ``import_module("schedkit...")`` or
    ``__import__("schedkit...")`` calls with a literal name."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.startswith("schedkit.")):
            names.add(node.args[0].value)
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
        if mod == "schedkit":
            continue  # the public surface re-exports from every layer
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


def _module_imports() -> dict[str, set[str]]:
    """Every schedkit module -> the schedkit modules it imports (resolved to modules that
    exist: ``from schedkit.core import queues`` counts as ``schedkit.core.queues``)."""
    mods = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for name in names:
                if name.startswith("schedkit"):
                    while name not in mods and "." in name:
                        name = name.rsplit(".", 1)[0]
                    if name in mods and name != mod:
                        deps.add(name)
        graph[mod] = deps
    return graph


def test_no_import_cycles():
    graph = _module_imports()
    # Packages' __init__ modules re-export their submodules: an edge into a package
    # means "some module of it"; leave the root package out (the public surface).
    graph.pop("schedkit", None)
    for deps in graph.values():
        deps.discard("schedkit")
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_schedkit_and_scheduler_without_torch():
    code = ("import sys; import schedkit, schedkit.core.scheduler, schedkit.plugins.testing, "
            "schedkit.cli, schedkit.engine.core; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
