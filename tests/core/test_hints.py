"""Request hints: each field's type and range checked with the field named, the wire form
round-trips, an SLO class gives a request its targets in the engine, and a hint reaches
the scheduler's and the router's hooks."""

from __future__ import annotations

import pytest

from schedkit.config import config_from_dict
from schedkit.core.hints import NO_HINTS, RequestHints, hints_from_wire
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError


@pytest.mark.parametrize(("field", "value"), [
    ("slo_class", ""), ("slo_class", "has space"), ("slo_class", "x" * 65), ("slo_class", 3),
    ("slo_class", "-lead"), ("deadline_s", 0), ("deadline_s", -1.0), ("deadline_s", float("inf")),
    ("deadline_s", float("nan")), ("deadline_s", True), ("deadline_s", 8 * 86400.0), ("deadline_s", "5"),
    ("expected_output_tokens", -1), ("expected_output_tokens", 2.0), ("expected_output_tokens", True),
    ("expected_output_tokens", 2**40), ("session_id", ""), ("session_id", "a\x00b"), ("session_id", "s" * 257),
])
def test_a_bad_hint_is_a_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError, match=rf"request 'r1': {field} must be") as e:
        RequestHints(**{field: value}).check("r1")
    assert e.value.request_id == "r1"
    with pytest.raises(RequestError, match=field):  # the wire and the Request check the same way
        hints_from_wire({field: value}, "r1")
    with pytest.raises(RequestError, match=field):
        Request("r1", [1, 2], SamplingParams(), arrival_time=0.0, hints=RequestHints(**{field: value}))


def test_good_hints_round_trip_through_the_wire():
    h = RequestHints(slo_class="interactive", deadline_s=2.5, expected_output_tokens=0, session_id="chat-7")
    assert h.check("r") is h and bool(h) and not NO_HINTS
    assert h.to_wire() == {"slo_class": "interactive", "deadline_s": 2.5, "expected_output_tokens": 0,
                           "session_id": "chat-7"}
    assert hints_from_wire(h.to_wire(), "r") == h
    assert hints_from_wire({}, "r") is NO_HINTS
    assert RequestHints(deadline_s=1).to_wire() == {"deadline_s": 1}


@pytest.mark.parametrize(("fields", "words"), [
    ([("slo_class", "a")], "must be a map"), ({"urgency": 1}, "unknown hints ['urgency']"),
    ("gold", "must be a map"),
])
def test_malformed_wire_hints_are_refused(fields, words):
    with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        hints_from_wire(fields, "r")


def test_a_bad_slo_class_name_in_yaml_is_a_config_error():
    from schedkit.errors import ConfigError

    with pytest.raises(ConfigError, match="'has space'"):
        config_from_dict({"slo_classes": {"has space": {"ttft_s": 1}}})
    with pytest.raises(ConfigError, match="ttft_s"):
        config_from_dict({"slo_classes": {"gold": {"ttft_s": -1}}})


def _engine(**extra):
    return EngineCore(config_from_dict({"slo_classes": {"interactive": {"ttft_s": 0.5, "tpot_s": 0.05},
                                                        "batch": {"e2e_s": 600}}, **extra}))


def test_an_slo_class_gives_the_request_its_targets_and_an_unknown_one_is_refused():
    engine = _engine()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0,
                hints=RequestHints(slo_class="interactive"))
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0, ttft_slo_s=2.0,
                hints=RequestHints(slo_class="interactive"))
    c = Request("c", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0,
                hints=RequestHints(slo_class="batch"))
    for r in (a, b, c):
        engine.add_request(r)
    assert (a.ttft_slo_s, a.tpot_slo_s) == (0.5, 0.05)
    assert (b.ttft_slo_s, b.tpot_slo_s) == (2.0, 0.05)  # its own target wins
    assert (c.ttft_slo_s, c.tpot_slo_s) == (None, None)
    bad = Request("d", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0,
                  hints=RequestHints(slo_class="gold"))
    with pytest.raises(RequestError, match=r"slo_class 'gold' is not one of the config's slo_classes "
                                           r"\(batch, interactive\)"):
        engine.add_request(bad)
    while engine.has_requests():  # the others are served
        engine.step()
    assert all(r.is_finished for r in (a, b, c))
    engine.close()


def test_hints_reach_the_scheduler_hooks_in_the_engine_process(install_plugin):
    """Hints sent through ``LLM.generate`` arrive on the engine process's Request: a plugin
    there rejects by them, and its reason carries what it saw."""
    install_plugin("hint_gate", '''
from schedkit import hookimpl, Rejection


class HintGate:
    @hookimpl
    def schedkit_admit_request(self, request, num_running, kv_cache_usage, now):
        h = request.hints
        if h.slo_class == "batch":
            return Rejection(f"batch off; deadline {h.deadline_s}, expects {h.expected_output_tokens}, "
                             f"session {h.session_id}, ttft {request.ttft_slo_s}")
        return None
''', {"hint-gate": "hint_gate:HintGate"})
    from schedkit.llm import LLM

    cfg = config_from_dict({"plugins": [{"name": "hint-gate"}],
                            "slo_classes": {"batch": {"ttft_s": 30}, "interactive": {"ttft_s": 0.5}}})
    with LLM(cfg) as llm:
        outs = llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=2), use_tqdm=False, hints=[
            RequestHints(slo_class="batch", deadline_s=9.5, expected_output_tokens=7, session_id="s1"),
            RequestHints(slo_class="interactive")])
    assert outs[0].rejected_by == "hint-gate"
    assert outs[0].rejection_reason == "batch off; deadline 9.5, expects 7, session s1, ttft 30.0"
    assert outs[1].finish_reason == "length"


def test_hints_reach_the_router_hooks(install_plugin):
    """A router picker that sends the ``batch`` class to replica 1 and the rest to 0."""
    import asyncio

    install_plugin("class_picker", '''
from schedkit import hookimpl


class ClassPicker:
    @hookimpl
    def schedkit_router_pick(self, request, replicas, scores):
        want = 1 if request.hints.slo_class == "batch" else 0
        return next((r for r in replicas if r.index == want), None)
''', {"class-picker": "class_picker:ClassPicker"})
    from schedkit.llm import AsyncLLM

    cfg = config_from_dict({"replicas": {"count": 2}, "router": {"plugins": [{"name": "class-picker"}]},
                            "slo_classes": {"batch": {}, "interactive": {}}})

    async def run():
        async with await AsyncLLM.create(cfg) as llm:
            for i in range(6):
                hints = RequestHints(slo_class="batch" if i % 3 == 0 else "interactive")
                async for _ in llm.generate([1, 2, i + 3], SamplingParams(max_tokens=2), hints=hints):
                    pass
            return (await llm.call_utility("stats"))["router"]["replicas"]

    replicas = asyncio.run(run())
    assert [r["num_routed"] for r in replicas] == [4, 2]
