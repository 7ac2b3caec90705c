"""docs/hooks.md's reference is generated from the hook specs and kept current.

The reference part of the page (between its ``hooks-reference`` markers) must equal a
fresh generation by scripts/gen_hooks_reference.py; every hook spec's docstring must
state the whole contract (when called, arguments, returns, errors, built-in), so that
the generator can render it.
"""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path

import pytest

from schedkit import hookspecs

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_hooks_reference", ROOT / "scripts" / "gen_hooks_reference.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_committed_page_is_a_fresh_generation():
    page = gen.HOOKS_MD.read_text()
    fresh = gen.update_page(page, gen.render_reference())
    assert fresh == page, (f"docs/hooks.md's hook reference differs from schedkit/hookspecs.py; "
                           f"regenerate it with `{gen.COMMAND}`:\n{gen.diff(page, fresh)}")


@pytest.mark.parametrize("name", hookspecs.ALL_HOOK_NAMES)
def test_hook_spec_states_the_whole_contract(name):
    spec = getattr(hookspecs, name)
    parts = gen.parse_docstring(name, spec.__doc__)  # raises when a section is missing
    process = ("router's process" if name in hookspecs.ROUTER_HOOK_NAMES
               else "front end's process" if name in hookspecs.FLOW_HOOK_NAMES else "engine-core process")
    assert process in " ".join(parts["Called"]), f"{name}: Called does not say it runs in the {process}"
    assert "since" in parts, f"{name}: no '.. versionadded::'"
    section = "\n\n".join(gen.hook_section(name, spec))
    assert gen.signature(name, spec) in section


def test_chunk_limit_spec_states_the_adaptive_threshold_and_its_error():
    parts = gen.parse_docstring("schedkit_prefill_chunk_limit", hookspecs.schedkit_prefill_chunk_limit.__doc__)
    assert "long_prefill_token_threshold_adaptive" in " ".join(parts["Args"])
    assert "PluginError" in " ".join(parts["Errors"])


def _fake_specs(doc: str, firstresult: bool = True) -> types.ModuleType:
    module = types.ModuleType("fake_hookspecs")

    @hookspecs.hookspec(firstresult=firstresult)
    def schedkit_fake(request: int, now: float) -> int | None:
        pass

    schedkit_fake.__doc__ = doc
    module.schedkit_fake = schedkit_fake  # type: ignore[attr-defined]
    module.HOOK_NAMES = ("schedkit_fake",)  # type: ignore[attr-defined]
    module.ROUTER_HOOK_NAMES = ()  # type: ignore[attr-defined]
    return module


FAKE_DOC = """Decide something.

    Called:
        In the engine-core process, once per step.

    Args:
        request: The request.
        now: The clock.

    Returns:
        An int, or None.

    Errors:
        Anything else raises PluginError.

    Built-in:
        None.

    .. versionadded:: 0.9
    """


def test_reference_renders_kind_from_the_marker_and_sections_from_the_docstring():
    first = gen.render_reference(_fake_specs(FAKE_DOC, firstresult=True))
    assert "def schedkit_fake(request: int, now: float) -> int | None: ..." in first
    assert "| [`schedkit_fake`](#schedkit_fake) | first result | Decide something. |" in first
    assert "**Kind:** first result" in first
    assert "- `request`: The request.\n- `now`: The clock." in first
    assert "**Errors:** Anything else raises PluginError." in first
    assert "**Since:** version 0.9." in first
    observer = gen.render_reference(_fake_specs(FAKE_DOC, firstresult=False))
    assert "**Kind:** all plugins" in observer and "## Observers" in observer


@pytest.mark.parametrize("section", gen.SECTIONS)
def test_a_missing_section_is_an_error_naming_hook_and_section(section):
    doc = FAKE_DOC.replace(f"    {section}:", "    Removed:")
    with pytest.raises(gen.HookDocError, match=f"schedkit_fake.*{section}|unknown docstring section 'Removed'"):
        gen.render_reference(_fake_specs(doc))
    lines = inspect.cleandoc(FAKE_DOC).splitlines()
    i = lines.index(f"{section}:")
    without = "\n".join(lines[:i] + lines[i + 2:])
    with pytest.raises(gen.HookDocError, match=f"schedkit_fake: the docstring lacks the section.*{section}"):
        gen.render_reference(_fake_specs(without))


def test_args_must_name_the_signature_parameters():
    doc = FAKE_DOC.replace("now: The clock.", "when: The clock.")
    with pytest.raises(gen.HookDocError, match=r"Args documents \['request', 'when'\].*\['request', 'now'\]"):
        gen.render_reference(_fake_specs(doc))


def test_update_page_replaces_only_between_the_markers():
    page = f"intro\n\n{gen.START}\nold reference\n{gen.END}\n\n## Examples\nhand-written\n"
    new = gen.update_page(page, f"{gen.START}\nnew\n{gen.END}")
    assert new == f"intro\n\n{gen.START}\nnew\n{gen.END}\n\n## Examples\nhand-written\n"
    with pytest.raises(gen.HookDocError, match="must hold"):
        gen.update_page("no markers here\n", "x")
    with pytest.raises(gen.HookDocError, match="must hold"):
        gen.update_page(f"{gen.END}\n{gen.START}\n", "x")


def test_check_exits_1_with_a_diff_until_the_page_is_regenerated(tmp_path, monkeypatch, capsys):
    page = tmp_path / "hooks.md"
    committed = gen.HOOKS_MD.read_text()
    page.write_text(committed.replace("**Kind:** first result", "**Kind:** stale", 1))
    monkeypatch.setattr(gen, "HOOKS_MD", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    out = capsys.readouterr()
    assert "-**Kind:** stale" in out.out and gen.COMMAND in out.err
    assert gen.main([]) == 0
    assert page.read_text() == committed
    assert gen.main(["--check"]) == 0
