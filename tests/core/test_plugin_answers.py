"""Wrong answers from plugin code fail only the request concerned and never end the
engine: victims that are no request, queues that answer None, duplicate, lose or
invent requests, keys that do not compare, connector answers of the wrong shape,
request-scoped hooks answering out of range, SystemExit."""

from __future__ import annotations

import pytest

from schedkit import AdmissionDecision, FCFSQueue, KeyedQueue, PluginError, hookimpl
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError
from schedkit.kv.connector import KVConnectorBase
from tests.core.test_queue_errors import drive


def _engine(*plugins, num_blocks: int = 2048) -> EngineCore:
    cfg = config_from_dict({"runner": {"kind": "fake"},
                            "cache": {"block_size": 16, "num_blocks": num_blocks},
                            "scheduler": {"max_num_batched_tokens": 64, "max_model_len": 112}})
    return EngineCore(cfg, extra_plugins=list(plugins))


def _run(engine: EngineCore, n: int = 4, prompt: int = 40, max_tokens: int = 30) -> dict[str, list]:
    for i in range(n):
        engine.add_request(Request(f"r{i}", [1 + i] * prompt, SamplingParams(max_tokens=max_tokens,
                                                                             ignore_eos=True), 0.0))
    res = drive(engine, max_steps=20_000)
    assert not engine.scheduler.requests and engine.scheduler.kv_cache_manager.usage == 0
    return res


def _reasons(res: dict[str, list]) -> dict[str, str]:
    return {rid: outs[-1].finish_reason for rid, outs in res.items()}


class BadVictim:
    @hookimpl
    def schedkit_select_preemption_victim(self):
        return "oops"


def test_a_victim_that_is_no_request_fails_only_the_request_needing_blocks():
    res = _run(_engine(BadVictim(), num_blocks=9))
    errors = [rid for rid, r in _reasons(res).items() if r == "error"]
    assert errors and len(errors) < 4
    assert all("must be one of the running requests" in res[rid][-1].error for rid in errors)


class OneBadAnswer:
    """admit_request and prefill_chunk_limit answer out of range for r2 only."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    @hookimpl
    def schedkit_admit_request(self, request):
        return "yes" if self.hook == "admit" and request.request_id == "r2" else None

    @hookimpl
    def schedkit_prefill_chunk_limit(self, request):
        return 0 if self.hook == "chunk" and request.request_id == "r2" else None


@pytest.mark.parametrize("hook", ["admit", "chunk"])
def test_an_out_of_range_answer_about_one_request_fails_only_it(hook):
    res = _run(_engine(OneBadAnswer(hook)))
    assert _reasons(res) == {"r0": "length", "r1": "length", "r2": "error", "r3": "length"}
    assert "'r2'" in res["r2"][-1].error


class LyingQueue:
    """An FCFS queue with one bug."""

    def __init__(self, bug: str) -> None:
        self.bug = bug

    @hookimpl
    def schedkit_create_waiting_queue(self):
        bug = self.bug

        class Q(FCFSQueue):
            def add(self, request):
                if bug == "lose" and request.request_id == "r1":
                    return
                super().add(request)
                if bug == "dup" and request.request_id == "r1":
                    super().add(request)

            def peek(self):
                head = super().peek()
                if bug == "ghost" and head.request_id == "r1":
                    return Request("ghost", [1], SamplingParams(), 0.0)
                return None if bug == "none" and head.request_id == "r3" else head
        return Q()


def test_a_queue_that_duplicates_a_request_harms_nobody():
    res = _run(_engine(LyingQueue("dup")))
    assert set(_reasons(res).values()) == {"length"}


def test_a_queue_that_loses_a_request_fails_only_that_one():
    res = _run(_engine(LyingQueue("lose")))
    assert _reasons(res) == {"r0": "length", "r1": "error", "r2": "length", "r3": "length"}


@pytest.mark.parametrize("bug,victim", [("ghost", "r1"), ("none", "r3")])
def test_a_queue_that_keeps_lying_about_its_head_fails_only_that_request(bug, victim):
    """The first lie fails the step (it may be transient); the same lie about the same
    head again names that request."""
    res = _run(_engine(LyingQueue(bug)))
    assert _reasons(res) == {rid: "error" if rid == victim else "length" for rid in ("r0", "r1", "r2", "r3")}


class MixedKey:
    @hookimpl
    def schedkit_create_waiting_queue(self):
        return KeyedQueue(lambda r: ("x",) if r.request_id == "r2" else (r.arrival_time,))


def test_a_key_that_does_not_compare_rejects_only_its_request():
    engine = _engine(MixedKey())
    ok = []
    for i in range(4):
        req = Request(f"r{i}", [1 + i] * 8, SamplingParams(max_tokens=3, ignore_eos=True), float(i))
        try:
            engine.add_request(req)
            ok.append(req.request_id)
        except PluginError as e:
            assert req.request_id == "r2" and e.request_id == "r2"
    res = drive(engine)
    assert ok == ["r0", "r1", "r3"] and _reasons(res) == dict.fromkeys(ok, "length")


class OddConnector(KVConnectorBase):
    def __init__(self, answer) -> None:
        super().__init__(None)
        self.answer = answer

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.answer if request.request_id == "r2" else (0, False)


class ConnectorPlugin:
    def __init__(self, answer) -> None:
        self.answer = answer

    @hookimpl
    def schedkit_create_kv_connector(self, role):
        return OddConnector(self.answer) if role.name == "SCHEDULER" else None


@pytest.mark.parametrize("answer", [None, (3,), ("x", False), (1.5, False), (True, False), (1, "yes")])
def test_a_connector_answer_of_the_wrong_shape_fails_only_its_request(answer):
    res = _run(_engine(ConnectorPlugin(answer)))
    assert _reasons(res) == {"r0": "length", "r1": "length", "r2": "error", "r3": "length"}
    assert "get_num_new_matched_tokens" in res["r2"][-1].error


class Exits:
    @hookimpl
    def schedkit_admit_request(self, request):
        if request.request_id == "r1":
            raise SystemExit(3)


def test_system_exit_in_a_hook_is_a_plugin_error():
    res = _run(_engine(Exits()))
    assert _reasons(res) == {"r0": "length", "r1": "error", "r2": "length", "r3": "length"}


def test_abort_of_one_id_as_a_string():
    engine = _engine()
    for rid in ("a", "b", "ab"):
        engine.add_request(Request(rid, [1, 2], SamplingParams(max_tokens=5), 0.0))
    assert [r.request_id for r in engine.abort_requests("ab")] == ["ab"]
    assert set(engine.scheduler.requests) == {"a", "b"}


def test_stop_token_ids_that_are_not_a_list_are_a_request_error():
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


def test_a_plugin_constructor_raising_anything_is_a_plugin_error():
    from schedkit.plugins.manager import _instantiate

    class Boom:
        def __init__(self):
            raise RuntimeError("init boom")
    with pytest.raises(PluginError, match="init boom"):
        _instantiate("boom", Boom, {})
    assert AdmissionDecision.SKIP  # (the names this file uses are all public)


class OddPops:
    """Queues whose pop disagrees with their peek, or peek answers None once."""

    def __init__(self, bug: str) -> None:
        self.bug = bug

    @hookimpl
    def schedkit_create_waiting_queue(self):
        bug = self.bug

        class Q(FCFSQueue):
            last = None
            peeks = 0

            def pop(self):
                if bug == "popdiff" and len(self) > 1:
                    a = super().pop()
                    b = super().pop()
                    self.prepend_request(a)
                    return b
                if bug == "popdup" and self.last is not None and len(self) % 2:
                    return self.last
                self.last = super().pop()
                return self.last

            def peek(self):
                self.peeks += 1
                return None if bug == "peeknone" and self.peeks == 1 else super().peek()
        return Q()


@pytest.mark.parametrize("bug", ["popdiff", "popdup", "peeknone"])
def test_a_pop_that_disagrees_with_peek_harms_nobody(bug):
    res = _run(_engine(OddPops(bug)))
    assert set(_reasons(res).values()) == {"length"}, res


class CustomBase(BaseException):
    pass


class RaisesBase:
    @hookimpl
    def schedkit_admit_request(self, request):
        if request.request_id == "r1":
            raise CustomBase("mine")


def test_a_custom_base_exception_in_a_hook_is_a_plugin_error():
    res = _run(_engine(RaisesBase()))
    assert _reasons(res) == {"r0": "length", "r1": "error", "r2": "length", "r3": "length"}


class NegativeBudget:
    @hookimpl
    def schedkit_step_token_budget(self):
        return -1


def test_after_three_failed_steps_fail_everything_the_engine_goes_idle():
    engine = _engine(NegativeBudget())
    for i in range(2):
        engine.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), 0.0))
    res = drive(engine, max_steps=20)
    assert set(_reasons(res).values()) == {"error"} and not engine.has_requests()
