"""A policy's waiting queue is plugin code: whatever it raises (its methods, the key
function of a KeyedQueue) becomes a PluginError naming plugin, queue and method, fails
only the request(s) concerned, and leaves the scheduler consistent."""

from __future__ import annotations

import pytest

from schedkit import AdmissionDecision, PluginError, hookimpl
from schedkit.config import config_from_dict
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
    serve,
)
from schedkit.runners.fake import FakeRunner


class KeyQueuePolicy:
    """Orders by arrival; the key function raises for requests ``bad(request)`` picks."""

    def __init__(self, bad) -> None:
        self.bad = bad

    @hookimpl
    def schedkit_create_waiting_queue(self):
        def key(req):
            if self.bad(req):
                raise RuntimeError(f"no key for {req.request_id}")
            return req.arrival_time
        return KeyedQueue(key)


def test_raising_key_at_add_registers_nothing():
    sched = make_scheduler(plugins=[KeyQueuePolicy(lambda r: True)])
    req = make_request("r0", [1, 2, 3])
    with pytest.raises(PluginError, match="no key for r0") as exc:
        sched.add_request(req)
    err = exc.value
    assert err.plugin.startswith("KeyQueuePolicy") and "KeyedQueue.add" in err.hook
    assert err.request_id == "r0"
    assert "r0" not in sched.requests and not sched.has_requests()
    sched2 = make_scheduler(plugins=[KeyQueuePolicy(lambda r: r.request_id == "bad")])
    sched2.add_request(ok := make_request("ok", [1, 2, 3], max_tokens=2))
    with pytest.raises(PluginError):
        sched2.add_request(make_request("bad", [1, 2, 3]))
    done = serve(sched2, FakeRunner())
    assert [o.request_id for o in done] == ["ok"] and ok.is_finished


def drive(engine: EngineCore, max_steps: int = 2000) -> dict[str, list]:
    """Step until the engine is idle; every output per request. A livelock fails."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_requests():
            return results
        for group in engine.step().values():
            for o in group.outputs:
                results.setdefault(o.request_id, []).append(o)
    raise AssertionError(f"the engine still has requests after {max_steps} steps (livelock)")


def _engine(*plugins, num_blocks=2048, block_size=16) -> EngineCore:
    cfg = config_from_dict({
        "runner": {"kind": "fake"},
        "cache": {"block_size": block_size, "num_blocks": num_blocks},
        "scheduler": {"max_num_batched_tokens": 64, "max_model_len": 256},
    })
    return EngineCore(cfg, extra_plugins=list(plugins))


def _req(rid: str, n: int = 8, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0)


def test_engine_fails_a_request_whose_key_raises_at_arrival():
    engine = _engine(KeyQueuePolicy(lambda r: r.request_id == "bad"))
    for rid in ("a", "b"):
        engine.add_request(_req(rid), arrival_offset=0.5)
    engine.add_request(_req("bad"), arrival_offset=0.5)  # held: its key runs on arrival
    res = drive(engine)
    assert res["bad"][-1].finish_reason == "error" and "no key for bad" in res["bad"][-1].error
    assert [res[r][-1].finish_reason for r in ("a", "b")] == ["length", "length"]
    assert not engine.scheduler.requests and engine.scheduler.kv_cache_manager.usage == 0


def test_key_raising_for_preempted_requests_fails_only_them():
    """The victim goes back to the queue inside schedule(): its key raises there."""
    engine = _engine(KeyQueuePolicy(lambda r: r.num_preemptions > 0), num_blocks=9, block_size=4)
    reqs = [_req(f"r{i}", n=7, max_tokens=12) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    res = drive(engine)
    errors = [rid for rid, outs in res.items() if outs[-1].finish_reason == "error"]
    assert errors, "nobody was preempted"
    for rid in errors:
        assert "no key for" in res[rid][-1].error and rid in res[rid][-1].error
    ok = [r for r in reqs if r.request_id not in errors]
    assert ok and all(len(r.output_token_ids) == 12 for r in ok)
    assert not engine.scheduler.requests and engine.scheduler.kv_cache_manager.usage == 0


class DeferOnce:
    """Defers "x" the first time it is seen, so it is put back into the queue."""

    def __init__(self) -> None:
        self.seen = 0

    @hookimpl
    def schedkit_admit_request(self, request):
        if request.request_id == "x":
            self.seen += 1
            if self.seen == 1:
                return AdmissionDecision.SKIP
        return None


def test_key_raising_when_a_skipped_request_goes_back_fails_only_it():
    """x is skipped; putting it back calls its key, which now raises. The step is
    undone, x cannot be put back, and only x fails."""
    calls: dict[str, int] = {}

    def bad(req):
        calls[req.request_id] = calls.get(req.request_id, 0) + 1
        return req.request_id == "x" and calls["x"] > 1

    sched = make_scheduler(plugins=[KeyQueuePolicy(bad), DeferOnce()])
    reqs = [make_request(rid, [1, 2, 3], max_tokens=2, eos_token_id=None) for rid in ("x", "y", "z")]
    for r in reqs:
        sched.add_request(r)
    with pytest.raises(PluginError, match="no key for x") as exc:
        sched.schedule()
    assert exc.value.request_ids == ["x"]
    assert [r.request_id for r in sched.waiting] == ["y", "z"]  # x could not go back
    from schedkit.core.request import RequestStatus
    sched.finish_requests(exc.value.request_ids, RequestStatus.FINISHED_ERROR)
    assert_scheduler_consistent(sched, reqs)
    done = serve(sched, FakeRunner())
    assert sorted(o.request_id for o in done) == ["y", "z"]


class BrokenPop:
    """A queue whose pop raises while armed (no request to blame: the step fails)."""

    armed = True

    @hookimpl
    def schedkit_create_waiting_queue(self):
        outer = self

        class Q(KeyedQueue):
            def pop(self):
                if outer.armed:
                    raise KeyError("heap corrupted")
                return super().pop()
        return Q(lambda r: r.arrival_time)


def test_queue_method_raising_without_a_request_fails_the_step_then_recovers():
    plugin = BrokenPop()
    sched = make_scheduler(plugins=[plugin])
    reqs = [make_request(f"r{i}", [1, 2, 3], max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    with pytest.raises(PluginError, match="pop") as exc:
        sched.schedule()
    assert exc.value.request_ids == [] and "Q.pop" in exc.value.hook
    assert_scheduler_consistent(sched, reqs)
    plugin.armed = False
    done = serve(sched, FakeRunner())
    assert sorted(o.request_id for o in done) == ["r0", "r1", "r2"]


def test_engine_fails_everything_after_three_step_failures_and_stays_idle():
    engine = _engine(BrokenPop())
    for rid in ("a", "b"):
        engine.add_request(_req(rid))
    res = drive(engine, max_steps=10)
    assert all(outs[-1].finish_reason == "error" for outs in res.values())
    assert not engine.has_requests()
