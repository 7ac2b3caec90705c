"""Meta-tests: the plugin contract is documented and tested, and the docs' code is real.

* every hook has a ``### <name>`` reference section in docs/hooks.md and an example
  (the reference itself is generated: tests/test_hooks_reference.py);
* every hook has a ``test_hook_<name>`` test somewhere under tests/;
* every code block in the plugin docs marked ``<!-- from: PATH -->`` is a verbatim copy
  of lines of PATH (a tested file), and every YAML block is a valid config;
* docs/reference.md has a row for every public ``Request`` attribute, property and
  method, every ``SamplingParams`` field, every ``make_scheduler`` / ``make_request``
  parameter and every workload / compare / runner config field, with the code's types,
  defaults and allowed values; its python blocks run and its YAML blocks generate
  workloads;
* the worked example of docs/lab.md's counterfactual replay runs and prints what it shows.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shlex
import shutil
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from schedkit import config as config_models
from schedkit import hookspecs
from schedkit.config import config_from_dict
from schedkit.core.request import EventType, Request, RequestStatus, SamplingParams
from schedkit.lab.workloads import generate
from schedkit.plugins import testing

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOOKS_MD = DOCS / "hooks.md"
PLUGIN_DOCS = [HOOKS_MD, DOCS / "writing-plugins.md"]
REFERENCE_MD = DOCS / "reference.md"
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


def test_hook_sections_are_real_hooks():
    """The reference has one ``### <name>`` section per hook (its text is checked against
    the hook specs by tests/test_hooks_reference.py)."""
    documented = re.findall(r"^### (schedkit_\w+) *$", HOOKS_MD.read_text(), flags=re.M)
    assert sorted(documented) == sorted(hookspecs.ALL_HOOK_NAMES)


def test_every_hook_has_a_tested_example():
    """Under ``## Examples``, each hook has a ``### Example: <name>`` with a block copied
    from a tested file (the reference links to it)."""
    examples = sections(HOOKS_MD.read_text())["Examples"]
    parts = re.split(r"^### Example: (\w+) *$", examples, flags=re.M)
    bodies = {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}
    assert sorted(bodies) == sorted(hookspecs.ALL_HOOK_NAMES)
    missing = [h for h, body in bodies.items() if not any(src for src, _, _ in code_blocks(body))]
    assert not missing, f"examples without a '<!-- from: PATH -->' block: {missing}"


def _test_function_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def test_hooks_have_tests():
    names = _test_function_names()
    missing = [h for h in hookspecs.ALL_HOOK_NAMES if f"test_hook_{h}" not in names]
    assert not missing, f"no test_hook_<name> test under tests/ for {missing}"


@pytest.mark.parametrize("doc", PLUGIN_DOCS, ids=lambda p: p.name)
def test_doc_snippets_are_copied_from_tested_files(doc):
    text = doc.read_text()
    signatures = {render_signature(h) for h in hookspecs.ALL_HOOK_NAMES}
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


# ---------------------------------------------------------------------- docs/reference.md
def reference_sections() -> dict[str, str]:
    """``##`` and ``###`` headings of docs/reference.md -> their text up to the next one."""
    parts = re.split(r"^#{2,3} +(.+?) *$", REFERENCE_MD.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def table(heading: str) -> dict[str, list[str]]:
    """The section's table: first-cell name -> every cell, backticks and ``\\|`` undone."""
    rows = {}
    for line in reference_sections()[heading].splitlines():
        if re.match(r"\| `[\w.]+` \|", line):
            cells = [c.strip().strip("`").replace("\\|", "|")
                     for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            assert cells[0] not in rows, f"{heading}: {cells[0]} has two rows"
            rows[cells[0]] = cells
    assert rows, f"docs/reference.md: no table rows under {heading!r}"
    return rows


def same_names(heading: str, names: list[str]) -> dict[str, list[str]]:
    rows = table(heading)
    assert not set(names) - set(rows), f"{heading}: undocumented: {sorted(set(names) - set(rows))}"
    assert not set(rows) - set(names), f"{heading}: not in the code: {sorted(set(rows) - set(names))}"
    return rows


def _annotation(a: object) -> str:
    return a if isinstance(a, str) else inspect.formatannotation(a)


def render_method(fn: typing.Callable) -> str:
    """``(self, kind: EventType) -> float | None`` from the source annotations."""
    params = []
    for p in inspect.signature(fn).parameters.values():
        text = p.name if p.annotation is p.empty else f"{p.name}: {_annotation(p.annotation)}"
        params.append(text if p.default is p.empty else f"{text} = {p.default!r}")
    return f"({', '.join(params)}) -> {_annotation(inspect.signature(fn).return_annotation)}"


def render_default(value: object) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"  # type: ignore[attr-defined]
    return repr(value)


def test_reference_request_attributes():
    fields = [f for f in dataclasses.fields(Request) if not f.name.startswith("_")]
    rows = same_names("Request", [f.name for f in fields])
    wrong = [(f.name, rows[f.name][1], f.type) for f in fields if rows[f.name][1] != f.type]
    assert not wrong, f"docs/reference.md Request: (name, documented type, code type): {wrong}"


def test_reference_request_properties_and_methods():
    members = {n: m for n, m in vars(Request).items()
               if not n.startswith("_") and (isinstance(m, property) or inspect.isfunction(m))}
    rows = same_names("Request properties and methods", list(members))
    for name, member in members.items():
        want = (_annotation(member.fget.__annotations__["return"]) if isinstance(member, property)
                else render_method(member))
        assert rows[name][1] == want, f"Request.{name}: documented {rows[name][1]!r}, code {want!r}"


def test_reference_enums():
    same_names("RequestStatus", [m.name for m in RequestStatus])
    same_names("EventType", [m.name for m in EventType])


def test_reference_sampling_params():
    fields = dataclasses.fields(SamplingParams)
    rows = same_names("SamplingParams", [f.name for f in fields])
    for f in fields:
        assert rows[f.name][1:3] == [f.type, repr(f.default)], f"SamplingParams.{f.name}: {rows[f.name]}"


def test_reference_test_kit_functions():
    """Every public function and class of the test kit has a row (fixtures aside)."""
    names = [n for n, v in vars(testing).items() if not n.startswith("_")
             and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == testing.__name__]
    same_names("Test kit functions", names)


@pytest.mark.parametrize("heading", ["make_scheduler", "make_request", "step"])
def test_reference_test_kit_parameters(heading):
    params = inspect.signature(getattr(testing, heading)).parameters.values()
    rows = same_names(heading, [p.name for p in params])
    for p in params:
        want = [_annotation(p.annotation), render_default(p.default)]
        assert rows[p.name][1:3] == want, f"{heading}({p.name}): documented {rows[p.name][1:3]}, code {want}"


SECTION_MODELS = {
    "workload": config_models.WorkloadConfig,
    "workload.prompt_len, workload.output_len": config_models.LengthConfig,
    "workload.tenants": config_models.TenantConfig,
    "workload.priorities": config_models.PriorityClassConfig,
    "workload.shared_prefix": config_models.SharedPrefixConfig,
    "workload.trace": config_models.TraceConfig,
    "workload.slo": config_models.SLOConfig,
    "workload.fairness": config_models.FairnessConfig,
    "compare": config_models.CompareConfig,
    "compare.profiles": config_models.ProfileConfig,
    "runner (fake)": config_models.FakeRunnerConfig,
    "runner (simulated)": config_models.SimulatedRunnerConfig,
    "runner (paged)": config_models.PagedRunnerConfig,
    "runner (plugin)": config_models.PluginRunnerConfig,
    "server": config_models.ServerConfig,
    "replicas": config_models.ReplicasConfig,
    "router": config_models.RouterConfig,
    "flow_control": config_models.FlowControlConfig,
}


def _default(field) -> object:
    return field.default_factory() if field.default_factory is not None else field.default


@pytest.mark.parametrize("heading", list(SECTION_MODELS))
def test_reference_config_section_fields(heading):
    """Every field has a row whose default, read as YAML, is the code's default and whose
    type lists exactly the allowed values of a Literal."""
    model = SECTION_MODELS[heading]
    rows = same_names(heading, list(model.model_fields))
    for name, field in model.model_fields.items():
        _, type_cell, default_cell, *_ = rows[name]
        if typing.get_origin(field.annotation) is typing.Literal:
            assert type_cell.split("`, `") == list(typing.get_args(field.annotation)), (
                f"{heading}.{name}: documented values {type_cell!r}")
        if field.is_required():
            assert default_cell == "required", f"{heading}.{name}: required, documented {default_cell!r}"
            continue
        value, documented = _default(field), yaml.safe_load(default_cell)
        if isinstance(value, BaseModel):
            documented = type(value).model_validate(documented)
        assert documented == value, f"{heading}.{name}: documented default {default_cell!r}, code {value!r}"


def test_reference_examples_run():
    blocks = code_blocks(REFERENCE_MD.read_text())
    namespace: dict[str, object] = {}
    for _, lang, body in blocks:
        if lang == "python":
            exec(compile(body, str(REFERENCE_MD), "exec"), namespace)
        elif lang == "yaml":
            cfg = config_from_dict(yaml.safe_load(body), source="docs/reference.md block")
            assert len(generate(cfg.workload, cfg.runner.vocab_size, ROOT)) == cfg.workload.num_requests
    assert sum(lang == "python" for _, lang, _ in blocks) >= 2
    assert sum(lang == "yaml" for _, lang, _ in blocks) >= 3


# ---------------------------------------------------------------------- docs/lab.md
LAB_MD = DOCS / "lab.md"


def console_runs(block: str) -> list[tuple[str, str]]:
    """(command, output) pairs of a console block: each ``$ `` line and the lines under it."""
    runs: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        else:
            assert runs, f"console output before any command: {line!r}"
            runs[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in runs]


def test_lab_replay_example_prints_what_it_shows(tmp_path, monkeypatch, capsys):
    """The worked example of docs/lab.md's counterfactual replay: every ``$ schedkit``
    line runs (in a scratch folder with a copy of configs/) and prints exactly the lines
    shown under it."""
    from schedkit.cli import main

    blocks = [body for _, lang, body in code_blocks(sections(LAB_MD.read_text())["Counterfactual replay"])
              if lang == "console"]
    assert blocks
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        for command, shown in console_runs(block):
            args = shlex.split(command)
            assert args[0] == "schedkit", command
            assert main(args[1:]) == 0, command
            assert capsys.readouterr().out.rstrip("\n") == shown, command
