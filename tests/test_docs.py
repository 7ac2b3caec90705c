"""Meta-tests: the plugin contract is documented and tested, and the docs' code is real.

* every hook has a ``## <name>`` section in docs/hooks.md with its exact signature;
* every hook has a ``test_hook_<name>`` test somewhere under tests/;
* every code block in the plugin docs marked ``<!-- from: PATH -->`` is a verbatim copy
  of lines of PATH (a tested file), and every YAML block is a valid config.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from schedkit import hookspecs
from schedkit.config import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOOKS_MD = DOCS / "hooks.md"
PLUGIN_DOCS = [HOOKS_MD, DOCS / "writing-plugins.md"]
FENCE = re.compile(r"(?:<!-- from: (?P<src>\S+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def render_signature(hook_name: str) -> str:
    """``def name(arg: Annotation, ...) -> Return: ...`` as written in docs/hooks.md.

    hookspecs.py uses ``from __future__ import annotations``, so the annotations are the
    source strings; anything else is rendered with ``inspect.formatannotation``.
    """
    sig = inspect.signature(getattr(hookspecs, hook_name))

    def fmt(annotation: object) -> str:
        return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    params = ", ".join(f"{p.name}: {fmt(p.annotation)}" for p in sig.parameters.values())
    return f"def {hook_name}({params}) -> {fmt(sig.return_annotation)}: ..."


def sections(text: str) -> dict[str, str]:
    """``## heading`` -> the text up to the next ``## `` heading."""
    parts = re.split(r"^## +(.+?) *$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def code_blocks(text: str) -> list[tuple[str | None, str, str]]:
    """(source marker, language, body) of every fenced block."""
    return [(m["src"], m["lang"], m["body"]) for m in FENCE.finditer(text)]


def is_copied_from(snippet: str, source: str) -> bool:
    """True if ``snippet`` equals a run of consecutive lines of ``source``, both dedented."""
    want = textwrap.dedent(snippet).strip("\n").splitlines()
    lines = source.splitlines()
    for i in range(len(lines) - len(want) + 1):
        if lines[i].strip() == want[0].strip():
            run = "\n".join(lines[i:i + len(want)])
            if textwrap.dedent(run).splitlines() == want:
                return True
    return False


def test_hooks_documented():
    docs = sections(HOOKS_MD.read_text())
    problems = []
    for name in hookspecs.HOOK_NAMES:
        if name not in docs:
            problems.append(f"{name}: no '## {name}' section in docs/hooks.md")
            continue
        signature_blocks = [body.strip() for _, lang, body in code_blocks(docs[name])
                            if lang == "python"]
        if render_signature(name) not in signature_blocks:
            problems.append(f"{name}: section lacks the python block\n    {render_signature(name)}")
    assert not problems, "\n".join(problems)


def test_hook_sections_are_real_hooks():
    documented = [h for h in sections(HOOKS_MD.read_text()) if h.startswith("schedkit_")]
    assert sorted(documented) == sorted(hookspecs.HOOK_NAMES)


def test_hook_sections_say_what_none_means_and_the_builtin():
    docs = sections(HOOKS_MD.read_text())
    for name in hookspecs.HOOK_NAMES:
        body = docs[name]
        for needle in ("**Called**", "**Returns**", "**Built-in:**", "engine-core process",
                       "**Example:**"):
            assert needle in body, f"{name}: section lacks {needle!r}"


def _test_function_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def test_hooks_have_tests():
    names = _test_function_names()
    missing = [h for h in hookspecs.HOOK_NAMES if f"test_hook_{h}" not in names]
    assert not missing, f"no test_hook_<name> test under tests/ for {missing}"


@pytest.mark.parametrize("doc", PLUGIN_DOCS, ids=lambda p: p.name)
def test_doc_snippets_are_copied_from_tested_files(doc):
    text = doc.read_text()
    signatures = {render_signature(h) for h in hookspecs.HOOK_NAMES}
    checked = 0
    for src, lang, body in code_blocks(text):
        if src is not None:
            path = ROOT / src
            assert path.is_file(), f"{doc.name}: marker names a missing file {src}"
            assert is_copied_from(body, path.read_text()), (
                f"{doc.name}: this {lang} block is not a copy of lines of {src}:\n{body}")
            checked += 1
        elif lang == "python":
            assert body.strip() in signatures, (
                f"{doc.name}: python block without a '<!-- from: PATH -->' marker:\n{body}")
        elif lang == "yaml":
            config_from_dict(yaml.safe_load(body), source=f"{doc.name} block")
            checked += 1
    assert checked


def test_is_copied_from():
    source = "def f():\n    a = 1\n    b = 2\n\n    return a\n"
    assert is_copied_from("a = 1\nb = 2\n", source)
    assert is_copied_from("def f():\n    a = 1\n", source)
    assert not is_copied_from("a = 1\nb = 3\n", source)
    assert not is_copied_from("a = 1\nreturn a\n", source)
