"""The hook contract is written in four places: the pluggy specs (``hookspecs.py``), the
scheduler's Protocol (``core/hooks.py``), the typed facade over pluggy
(``plugins/facade.py``) and the inline baseline of the overhead benchmark
(``benchmarks/inline_hooks.py``). They must agree on names, parameters and return
types (a firstresult spec returns ``T | None``, None meaning "next plugin"; the
Protocol returns the resolved answer)."""

from __future__ import annotations

import inspect

import pytest

from benchmarks.inline_hooks import InlineFCFSHooks
from schedkit import hookspecs
from schedkit.core.hooks import AdmissionDecision, SchedulerHooks
from schedkit.hookspecs import HOOK_NAMES
from schedkit.plugins.facade import HookFacade

PREFIX = "schedkit_"
# Hooks whose resolved answer may still be None (no cap; no connector).
OPTIONAL = {"prefill_chunk_limit", "create_kv_connector", "create_structured_output_backend",
            "on_step_end", "on_request_finished"}


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")}


def _strip_none(annotation: str) -> str:
    parts = [p.strip() for p in annotation.split("|")]
    return " | ".join(p for p in parts if p != "None") or "None"


def test_every_spec_has_a_protocol_facade_and_inline_method():
    specs = {n[len(PREFIX):] for n in HOOK_NAMES}
    assert set(_methods(SchedulerHooks)) == specs
    assert set(_methods(HookFacade)) >= specs
    assert set(_methods(InlineFCFSHooks)) == specs


@pytest.mark.parametrize("hook", sorted(HOOK_NAMES))
def test_parameters_agree(hook):
    name = hook[len(PREFIX):]
    spec = inspect.signature(getattr(hookspecs, hook))
    expected = [(p.name, p.annotation) for p in spec.parameters.values()]
    for cls in (SchedulerHooks, HookFacade, InlineFCFSHooks):
        sig = inspect.signature(getattr(cls, name))
        params = [p for p in sig.parameters.values() if p.name != "self"]
        assert [p.name for p in params] == [n for n, _ in expected], (cls.__name__, hook)
        assert all(p.kind is p.KEYWORD_ONLY for p in params), f"{cls.__name__}.{name}: keyword-only"
        if cls is not InlineFCFSHooks:  # the benchmark baseline is unannotated
            assert [p.annotation for p in params] == [a for _, a in expected], (cls.__name__, hook)


NORMALISED = {"schedkit_admit_request": "AdmissionDecision | None"}


@pytest.mark.parametrize("hook", sorted(HOOK_NAMES))
def test_return_types_agree(hook):
    name = hook[len(PREFIX):]
    spec = inspect.signature(getattr(hookspecs, hook)).return_annotation
    proto = inspect.signature(getattr(SchedulerHooks, name)).return_annotation
    facade = inspect.signature(getattr(HookFacade, name)).return_annotation
    assert proto == facade, (hook, proto, facade)
    # what a plugin may answer, less what the facade normalises away before the scheduler
    # sees it (a Rejection becomes REJECT, its reason kept on the request)
    spec = NORMALISED.get(hook, spec)
    assert _strip_none(spec) == _strip_none(proto), (hook, spec, proto)
    assert ("None" in proto.split(" | ")) == (name in OPTIONAL), (hook, proto)


def test_admission_decisions():
    """SKIP passes over a request; None leaves the decision to the next plugin. Each
    decision has one name: the enum has no aliases."""
    assert list(AdmissionDecision.__members__) == ["ADMIT", "SKIP", "REJECT"]
