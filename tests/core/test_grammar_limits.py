"""Grammar work off the engine's critical path, bounded (docs/structured-outputs.md,
"Limits"): the backend's check and compile run on compile workers, never in
add_request; a compile has a timeout; a compile nobody waits for is cancelled; the
compile queue is fair between clients and bounded; constraint size and JSON-schema
depth are refused before compiling; a request whose matcher costs more than its
per-step budget fails alone.

The backend is the sequence test backend of test_structured_outputs.py, whose compiles
run on threads (it has no process compiler)."""

from __future__ import annotations

import threading
import time

import pytest

from schedkit import hookimpl
from schedkit.config import StructuredOutputsConfig, config_from_dict
from schedkit.core.compile_pool import CompileJob, CompileTimeout, FairQueue
from schedkit.core.grammar_limits import json_nesting_depth
from schedkit.core.request import Request, RequestStatus, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import EngineBusyError, RequestError
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler, step
from tests.core.test_structured_outputs import (
    VOCAB,
    BackendPlugin,
    SequenceBackend,
    SequenceGrammar,
    manager,
    structured,
)


def limits(**kw) -> StructuredOutputsConfig:
    return StructuredOutputsConfig(**kw)


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


class SlowCheckBackend(SequenceBackend):
    """``validate`` takes ``delay`` seconds (a deep schema's parse, for instance)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay
        self.validated_on: list[str] = []

    def validate(self, params):
        self.validated_on.append(threading.current_thread().name)
        time.sleep(self.delay)
        super().validate(params)


def test_the_backends_check_runs_on_a_compile_worker_not_in_add_request():
    backend = SlowCheckBackend(delay=1.0)
    mgr, _ = manager(backend)
    sched = make_scheduler(structured_output_manager=mgr)
    t0 = time.monotonic()
    req = structured("s", [1, 2], "seq:5")
    sched.add_request(req)
    assert time.monotonic() - t0 < 0.5  # the engine thread did not wait for the check
    req.structured_output.compiled.result(timeout=10)
    assert backend.validated_on and threading.main_thread().name not in backend.validated_on
    mgr.shutdown()


def test_a_deep_json_schema_and_a_long_constraint_are_refused_before_compiling():
    mgr, backend = manager(limits=limits(max_json_schema_depth=10, max_constraint_chars=16000))
    sched = make_scheduler(structured_output_manager=mgr)
    deep = make_request("deep", [1], structured_outputs={"json": deep_schema(600)})
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"nests 601 levels deep, over the limit of 10 "
                                           r"\(structured_outputs.max_json_schema_depth\)"):
        sched.add_request(deep)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(RequestError, match=r"regex constraint is 16001 characters long, over the limit "
                                           r"of 16000 \(structured_outputs.max_constraint_chars\)"):
        sched.add_request(structured("long", [1], "x" * 16001))
    ok = make_request("ok", [1], structured_outputs={"json": deep_schema(9)})  # depth 10: at the limit
    sched.add_request(ok)
    assert set(sched.requests) == {"ok"} and mgr.num_refused == 2
    mgr.shutdown()


def test_json_nesting_depth_skips_brackets_inside_strings():
    assert json_nesting_depth('{"a":"[[[{{{","b":[1,{"c":"\\"]"}]}') == 3
    assert json_nesting_depth("true") == 0 and json_nesting_depth("[]") == 1


def test_a_compile_past_its_timeout_fails_its_request_naming_the_key_and_others_go_on():
    engine = EngineCore(config_from_dict({"runner": {"vocab_size": VOCAB},
                                          "structured_outputs": {"backend": "sequence",
                                                                 "compile_timeout_s": 0.3}}),
                        extra_plugins=[plugin := BackendPlugin()])
    engine.add_request(Request("stuck", [1, 2], SamplingParams(
        max_tokens=3, structured_outputs={"regex": "gate:never"}), 0.0))
    engine.add_request(Request("plain", [3, 4], SamplingParams(max_tokens=3), 0.0))
    finished = run(engine, limit_s=10)
    assert finished["plain"] == ("length", "")
    reason, error = finished["stuck"]
    assert reason == "error" and "took longer than 0.3 s (structured_outputs.compile_timeout_s)" in error
    assert engine.stats()["grammar_compile_timeouts"] == 1
    # The same constraint again is refused at once: it would time out again.
    t0 = time.monotonic()
    engine.add_request(Request("again", [1], SamplingParams(
        max_tokens=3, structured_outputs={"regex": "gate:never"}), 0.0))
    assert run(engine, limit_s=10)["again"][0] == "error" and time.monotonic() - t0 < 0.25
    plugin.backend.gate("never").set()
    engine.close()


def test_aborting_the_only_request_cancels_its_queued_compile():
    mgr, backend = manager(num_workers=1)
    sched = make_scheduler(structured_output_manager=mgr)
    busy, queued = structured("busy", [1], "gate:a"), structured("queued", [2], "seq:5")
    sched.add_request(busy)
    sched.add_request(queued)
    sched.finish_requests("queued", RequestStatus.FINISHED_ABORTED)
    assert queued.structured_output.compiled.cancelled() and mgr.num_cancelled == 1
    backend.gate("a").set()
    busy.structured_output.compiled.result(timeout=10)
    assert backend.compiles == ["gate:a"]  # the cancelled one never ran
    mgr.shutdown()


def test_a_running_compile_nobody_waits_for_is_abandoned_and_frees_its_worker():
    mgr, backend = manager(num_workers=1)
    sched = make_scheduler(structured_output_manager=mgr)
    a, b = structured("a", [1], "gate:a"), structured("b", [1], "gate:a")  # one compile, two waiters
    sched.add_request(a)
    sched.add_request(b)
    deadline = time.monotonic() + 5
    while backend.compiles != ["gate:a"] and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not a.structured_output.compiled.done()  # b still waits for it
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    c = structured("c", [2], "seq:5")
    sched.add_request(c)
    c.structured_output.compiled.result(timeout=5)  # the worker is free again
    assert a.structured_output.compiled.cancelled() and mgr.num_cancelled == 1
    backend.gate("a").set()
    mgr.shutdown()


def test_the_compile_queue_serves_clients_in_turn():
    queue = FairQueue(max_jobs=10, max_jobs_per_owner=4)
    for i in range(4):
        queue.push(CompileJob(("a", i), None, "A"))
    queue.push(CompileJob(("b", 0), None, "B"))
    queue.push(CompileJob(("c", 0), None, "C"))
    order = [queue.pop().key for _ in range(6)]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert queue.pop() is None and len(queue) == 0


def test_a_full_compile_queue_refuses_naming_its_limit_and_other_clients_still_get_in():
    mgr, backend = manager(num_workers=1, limits=limits(max_queued_compiles=3, max_queued_compiles_per_client=2))
    sched = make_scheduler(structured_output_manager=mgr)
    sched.add_request(structured("run", [1], "gate:run"))
    deadline = time.monotonic() + 5
    while backend.compiles != ["gate:run"] and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.add_request(structured("a1", [1], "seq:1", client_index=0))
    sched.add_request(structured("a2", [1], "seq:2", client_index=0))
    with pytest.raises(EngineBusyError, match=r"compile queue is full .*max_queued_compiles_per_client = 2"):
        sched.add_request(structured("a3", [1], "seq:3", client_index=0))
    sched.add_request(structured("b1", [1], "seq:4", client_index=1))  # another client gets in
    with pytest.raises(EngineBusyError, match=r"compile queue is full .*max_queued_compiles = 3"):
        sched.add_request(structured("c1", [1], "seq:5", client_index=2))
    assert "a3" not in sched.requests and "c1" not in sched.requests and mgr.num_refused == 2
    backend.gate("run").set()
    mgr.shutdown()


class SlowGrammar(SequenceGrammar):
    def __init__(self, tokens, delay):
        super().__init__(tokens)
        self.delay = delay

    def fill_bitmask(self, bitmask, row):
        time.sleep(self.delay)
        super().fill_bitmask(bitmask, row)


class SlowFillBackend(SequenceBackend):
    """``regex="slow:<seconds>"``: token 1 forever, each fill taking that long."""

    def validate(self, params):
        pass

    def compile(self, params):
        return float(params.regex[5:]) if params.regex.startswith("slow:") else super().compile(params)

    def new_grammar(self, compiled, max_rollback_tokens):
        if isinstance(compiled, float):
            return SlowGrammar(None, compiled)
        return super().new_grammar(compiled, max_rollback_tokens)


def test_a_request_over_its_step_budget_fails_alone_and_the_step_goes_on():
    class Plugin:
        @hookimpl
        def schedkit_create_structured_output_backend(self, config):
            return SlowFillBackend() if config.backend == "slow" else None

    engine = EngineCore(config_from_dict({"runner": {"vocab_size": VOCAB},
                                          "structured_outputs": {"backend": "slow", "step_budget_ms": 20}}),
                        extra_plugins=[Plugin()])
    engine.add_request(Request("slow", [1, 2], SamplingParams(
        max_tokens=50, structured_outputs={"regex": "slow:0.03"}), 0.0))
    engine.add_request(Request("cheap", [3, 4], SamplingParams(
        max_tokens=20, structured_outputs={"regex": "slow:0"}), 0.0))
    engine.add_request(Request("plain", [5, 6], SamplingParams(max_tokens=20), 0.0))
    finished = run(engine, limit_s=20)
    assert finished["plain"] == ("length", "") and finished["cheap"] == ("length", "")
    reason, error = finished["slow"]
    assert reason == "error" and "over its budget of 20 ms (structured_outputs.step_budget_ms)" in error
    assert engine.stats()["grammar_step_budget_failures"] == 1
    engine.close()


def run(engine: EngineCore, limit_s: float) -> dict[str, tuple[str, str]]:
    finished = {}
    deadline = time.monotonic() + limit_s
    while engine.has_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests in time"
        for group in engine.step().values():
            for o in group.outputs:
                if o.finish_reason:
                    finished[o.request_id] = (o.finish_reason, o.error or "")
        assert_scheduler_consistent(engine.scheduler)
    return finished


def test_a_constraint_that_timed_out_fails_again_at_once_even_when_no_schedule_reaches_it():
    mgr, backend = manager(limits=limits(compile_timeout_s=0.2))
    sched = make_scheduler(structured_output_manager=mgr, max_num_seqs=1)
    sched.add_request(make_request("busy", [1, 2], max_tokens=50))
    step(sched, sampled=7)  # "busy" takes the only running slot: schedule() reaches no one else
    first = structured("first", [3], "gate:never")
    sched.add_request(first)
    with pytest.raises(CompileTimeout):
        first.structured_output.compiled.result(timeout=5)
    failed = [o.request_id for o in step(sched, sampled=7).outputs if o.finish_reason]
    again = structured("again", [4], "gate:never")
    sched.add_request(again)
    failed += [o.request_id for o in step(sched, sampled=7).outputs if o.finish_reason]
    assert failed == ["first", "again"] and backend.compiles == ["gate:never"]
    assert "compile_timeout_s" in again.structured_output.error and "busy" in sched.requests
    backend.gate("never").set()
    mgr.shutdown()


def test_the_step_budget_is_the_backends_unless_the_config_sets_one():
    """A backend whose honest fills cost more (the python backend tries every token of
    its vocabulary for each new state) brings its own default budget; the config's
    value, when set, wins for every backend."""
    from schedkit.structured.python_backend import PythonBackend

    small = PythonBackend(["a", "b"], [0], vocab_size=4)
    big = PythonBackend(["a", "b"], [0], vocab_size=49152)
    assert small.default_step_budget_ms() == 10.0
    assert big.default_step_budget_ms() == pytest.approx(98.304)
    assert SequenceBackend().default_step_budget_ms() == 10.0
    mgr, _ = manager(limits=limits())
    assert mgr.step_budget_ms == 10.0
    mgr, _ = manager(limits=limits(step_budget_ms=3))
    assert mgr.step_budget_ms == 3


def test_a_compile_worker_leaves_no_socket_folder_behind_while_it_runs(tmp_path, monkeypatch):
    """The folder of a worker's connect socket is gone once the worker is connected, so
    an engine that dies without shutting its pool down leaves nothing in the temp dir."""
    import os
    import tempfile

    from schedkit.core.compile_worker import Zygote

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    zygote = Zygote((), start_timeout_s=60)
    try:
        pid, conn = zygote.fork()
        assert pid > 0 and pid != os.getpid()
        assert list(tmp_path.iterdir()) == []
        conn.close()
    finally:
        zygote.stop()
