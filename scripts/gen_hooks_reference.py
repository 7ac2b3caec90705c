"""Write the reference part of docs/hooks.md from schedkit/hookspecs.py.

The reference sits between ``<!-- hooks-reference:start -->`` and
``<!-- hooks-reference:end -->``; everything outside the markers (the introduction, the
examples, the KV connector and router notes) is hand-written and left as it is. Each
hook's subsection comes from its spec: the signature with its annotations as written,
the kind from the ``firstresult`` flag of its ``@hookspec`` marker, and the sections of
its docstring (``Called``, ``Args``, ``Returns``, ``Errors``, ``Built-in``).

Usage:
    python scripts/gen_hooks_reference.py           # rewrite docs/hooks.md
    python scripts/gen_hooks_reference.py --check   # exit 1 with a diff if it is stale
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hook specs, not an installed schedkit's

from schedkit import hookspecs  # noqa: E402

HOOKS_MD = ROOT / "docs" / "hooks.md"
START = "<!-- hooks-reference:start -->"
END = "<!-- hooks-reference:end -->"
COMMAND = "python scripts/gen_hooks_reference.py"
SECTIONS = ("Called", "Args", "Returns", "Errors", "Built-in")
"""The docstring sections every hook must have, in the order they are rendered."""

KINDS = {
    True: "first result: plugins are asked in turn, built-ins last, and the first answer "
          "that is not None is used; None means \"no opinion, ask the next plugin\"",
    False: "all plugins: every plugin that implements it is called",
}
GROUPS = (
    ("Scheduler hooks", "The decisions of the engine's scheduler and the objects it is built "
     "with. Each is first-result: the first plugin that answers decides."),
    ("Observers", "Every plugin that implements an observer is called; return values are "
     "ignored."),
    ("Router hooks", "The router's decisions, with `replicas.count` above 1 (router plugins "
     "and the built-in ones are described under [Router plugins](#router-plugins))."),
    ("Flow-control hooks", "The front door's decisions, with `flow_control.enabled`: whether the "
     "engines are full, and which tenant's held request goes next "
     "([flow-control.md](flow-control.md))."),
)


class HookDocError(ValueError):
    """A hookspec's docstring lacks what the reference needs."""


def signature(name: str, spec: Callable[..., object]) -> str:
    """``def name(arg: Annotation, ...) -> Return: ...`` with the annotations as written."""
    sig = inspect.signature(spec)

    def fmt(annotation: object) -> str:
        return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

    params = ", ".join(f"{p.name}: {fmt(p.annotation)}" for p in sig.parameters.values())
    return f"def {name}({params}) -> {fmt(sig.return_annotation)}: ..."


def is_firstresult(spec: Callable[..., object]) -> bool:
    """The ``firstresult`` flag of the spec's ``@hookspec`` marker."""
    opts = getattr(spec, f"{hookspecs.PROJECT}_spec", None)
    if opts is None:
        raise HookDocError(f"{spec.__name__} has no @hookspec marker")
    return bool(opts.get("firstresult"))


def markdown(text: str) -> str:
    """reST inline markup as Markdown: ``x`` and :role:`x` become `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def paragraphs(lines: Sequence[str]) -> list[str]:
    """Blank-line separated blocks, each joined into one line; in a block of ``* ``
    items, one line per item."""
    out: list[str] = []
    block: list[str] = []
    for line in [*lines, ""]:
        text = line.strip()
        if text.startswith("* ") or (text and not block):
            block.append(text)
        elif text:
            block[-1] += " " + text
        elif block:
            out.append(markdown("\n".join(block)))
            block = []
    return out


def parse_docstring(name: str, doc: str | None) -> dict[str, list[str]]:
    """The docstring's parts: ``summary`` (its first paragraphs, before any section), one
    entry per section in SECTIONS, and ``since`` (from ``.. versionadded::``)."""
    if not doc:
        raise HookDocError(f"{name} has no docstring")
    lines = inspect.cleandoc(doc).splitlines()
    parts: dict[str, list[str]] = {"summary": []}
    current = "summary"
    for line in lines:
        header = re.fullmatch(r"([A-Z][\w-]*):", line)
        version = re.fullmatch(r"\.\. versionadded:: *(\S+)", line)
        if header:
            current = header[1]
            if current not in SECTIONS:
                raise HookDocError(f"{name}: unknown docstring section {current!r} "
                                   f"(the sections are {', '.join(SECTIONS)})")
            parts[current] = []
        elif version:
            parts["since"] = [version[1]]
            current = "since"
        else:
            parts[current].append(line[4:] if current != "summary" and line.startswith("    ") else line)
    missing = [s for s in SECTIONS if not "".join(parts.get(s, [])).strip()]
    if missing:
        raise HookDocError(f"{name}: the docstring lacks the section(s) {', '.join(missing)}")
    return parts


def arguments(name: str, lines: Sequence[str], params: Sequence[str]) -> list[str]:
    """``- `arg`: text`` per argument of the Args section, which must name exactly the
    spec's parameters, in order."""
    entries: list[tuple[str, list[str]]] = []
    for line in lines:
        head = re.match(r"(\w+): (.*)", line)
        if head and not line.startswith(" "):
            entries.append((head[1], [head[2]]))
        elif line.strip() and entries:
            entries[-1][1].append(line.strip())
    documented = [arg for arg, _ in entries]
    if documented != list(params):
        raise HookDocError(f"{name}: Args documents {documented}, the signature has {list(params)}")
    return [f"- `{arg}`: {markdown(' '.join(text))}" for arg, text in entries]


def labelled(label: str, lines: Sequence[str]) -> list[str]:
    """``**Label:** first paragraph``, then any further paragraphs."""
    first, *rest = paragraphs(lines)
    return [f"**{label}:** {first}", *rest]


def hook_section(name: str, spec: Callable[..., object]) -> list[str]:
    """The reference subsection of one hook, as Markdown blocks."""
    parts = parse_docstring(name, spec.__doc__)
    params = list(inspect.signature(spec).parameters)
    blocks = [f"### {name}", f"```python\n{signature(name, spec)}\n```", *paragraphs(parts["summary"])]
    blocks += [f"**Kind:** {KINDS[is_firstresult(spec)]}."]
    blocks += labelled("Called", parts["Called"])
    blocks += ["**Arguments:**\n\n" + "\n".join(arguments(name, parts["Args"], params))]
    for section in SECTIONS[2:]:
        blocks += labelled(section, parts[section])
    if "since" in parts:
        blocks.append(f"**Since:** version {parts['since'][0]}.")
    blocks.append(f"**Example:** [a plugin implementing it](#example-{name}).")
    return blocks


def grouped(module: ModuleType) -> list[tuple[str, str, list[str]]]:
    """(title, introduction, hook names) per group, hooks in the module's order."""
    engine = list(module.HOOK_NAMES)
    decisions = [n for n in engine if is_firstresult(getattr(module, n))]
    observers = [n for n in engine if n not in decisions]
    members = (decisions, observers, list(module.ROUTER_HOOK_NAMES), list(getattr(module, "FLOW_HOOK_NAMES", ())))
    return [(title, intro, names) for (title, intro), names in zip(GROUPS, members, strict=True)]


def summary_table(module: ModuleType) -> list[str]:
    """One row per hook: its kind and its docstring's first sentence."""
    rows = ["| hook | kind | what it is for |", "|---|---|---|"]
    for _, _, names in grouped(module):
        for name in names:
            spec = getattr(module, name)
            kind = "first result" if is_firstresult(spec) else "all plugins"
            first = paragraphs(parse_docstring(name, spec.__doc__)["summary"])[0].replace("|", "\\|")
            rows.append(f"| [`{name}`](#{name}) | {kind} | {first} |")
    return ["\n".join(rows)]


def render_reference(module: ModuleType = hookspecs) -> str:
    """The generated part of docs/hooks.md, markers included."""
    blocks = [START, f"<!-- generated from schedkit/hookspecs.py by {COMMAND}; edit the "
                     "docstrings there, not this part of the page -->",
              "## Hooks at a glance", *summary_table(module)]
    for title, intro, names in grouped(module):
        blocks += [f"## {title}", intro]
        for name in names:
            blocks += hook_section(name, getattr(module, name))
    blocks.append(END)
    return "\n\n".join(blocks)


def update_page(page: str, reference: str) -> str:
    """``page`` with the part between the markers replaced by ``reference``."""
    if page.count(START) != 1 or page.count(END) != 1 or page.index(START) > page.index(END):
        raise HookDocError(f"the page must hold {START} once, then {END} once")
    head, rest = page.split(START)
    _, tail = rest.split(END)
    return head + reference + tail


def diff(old: str, new: str, path: Path = HOOKS_MD) -> str:
    """A unified diff from the committed page to a fresh generation."""
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"{path.name} (committed)", f"{path.name} (generated)"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff when the page is stale")
    args = parser.parse_args(argv)
    page = HOOKS_MD.read_text()
    fresh = update_page(page, render_reference())
    if args.check:
        if fresh != page:
            sys.stdout.write(diff(page, fresh))
            print(f"\ndocs/hooks.md is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        HOOKS_MD.write_text(fresh)
        print(f"wrote {HOOKS_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
