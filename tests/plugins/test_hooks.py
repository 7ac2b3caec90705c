"""One test per hook (``test_hook_<name>``, checked by tests/test_docs.py).

Each test registers a small plugin through ``make_scheduler(plugins=[...])``, drives the
real scheduler with the FakeRunner or ``runner_output``, and checks that the hook changed
the behaviour or saw what its hookspec promises. The plugin classes are the examples
shown in docs/hooks.md (tests/test_docs.py checks that they are copied verbatim).
"""

from __future__ import annotations

from collections import Counter

import pytest

from schedkit import (
    AdmissionDecision,
    FinishReason,
    KeyedQueue,
    KVConnectorBase,
    KVConnectorRole,
    PluginError,
    Preemption,
    Rejection,
    RequestStatus,
    hookimpl,
)
from schedkit.config import config_from_dict
from schedkit.engine.core import EngineCore
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    drive_engine,
    make_request,
    make_requests,
    make_scheduler,
    runner_output,
    serve,
    step,
)
from schedkit.runners.fake import FakeRunner


def admitted_order(sched, runner) -> list[str]:
    order = []
    while sched.has_requests():
        order += [new.req_id for new in step(sched, runner).scheduler_output.scheduled_new_reqs]
    return order


# ------------------------------------------------------------- schedkit_create_waiting_queue
class LongestPromptFirst:
    """Admit the waiting request with the longest prompt first."""

    def __init__(self) -> None:
        self.configs = []

    @hookimpl
    def schedkit_create_waiting_queue(self, scheduler_config):
        self.configs.append(scheduler_config)
        return KeyedQueue(lambda r: (-r.num_prompt_tokens, r.arrival_time, r.request_id))


def test_hook_schedkit_create_waiting_queue():
    prompts = [[1] * 10, [2] * 30, [3] * 20]
    fcfs = make_scheduler(max_num_seqs=1)
    for req in make_requests(3, prompts=prompts, max_tokens=2):
        fcfs.add_request(req)
    assert admitted_order(fcfs, FakeRunner()) == ["0", "1", "2"]

    plugin = LongestPromptFirst()
    sched = make_scheduler(plugins=[plugin], max_num_seqs=1)
    assert plugin.configs == [sched.scheduler_config]  # once, when the Scheduler is built
    assert isinstance(sched.waiting.policy_queue, KeyedQueue)
    for req in make_requests(3, prompts=prompts, max_tokens=2):
        sched.add_request(req)
    assert [r.request_id for r in sched.waiting] == ["1", "2", "0"]
    assert admitted_order(sched, FakeRunner()) == ["1", "2", "0"]
    assert len(plugin.configs) == 1  # never again per step


# ---------------------------------------------------- schedkit_select_voluntary_preemptions
class MakeRoomForUrgent:
    """When every seat is taken, preempt the least important running request for a
    more important waiting one."""

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running, waiting, max_num_running):
        if len(running) < max_num_running:
            return None  # the head of the queue gets a seat anyway
        head = next(iter(waiting))
        worst = max(running, key=lambda r: (r.priority, r.arrival_time))
        if head.priority < worst.priority:
            return [Preemption(worst, "urgent request waiting")]
        return None


def test_hook_schedkit_select_voluntary_preemptions():
    def busy(plugins=()):
        sched = make_scheduler(policy="priority", plugins=plugins, max_num_seqs=2)
        low = [make_request(f"low{i}", [i + 1] * 8, max_tokens=6, priority=5) for i in range(2)]
        for req in low:
            sched.add_request(req)
        runner = FakeRunner()
        step(sched, runner)  # both seats taken
        urgent = make_request("urgent", [9] * 8, max_tokens=2, priority=0)
        sched.add_request(urgent)
        return sched, [*low, urgent], runner

    plain, reqs, runner = busy()  # vLLM's rule: running requests keep their seats
    out = step(plain, runner).scheduler_output
    assert not out.preempted_req_ids and not out.scheduled_new_reqs

    sched, reqs, runner = busy([MakeRoomForUrgent()])
    out = step(sched, runner).scheduler_output
    assert out.preempted_req_ids == {"low1"}  # the newer of the two least important
    assert [r.req_id for r in out.scheduled_new_reqs] == ["urgent"]  # admitted at once
    assert reqs[1].status is RequestStatus.PREEMPTED and reqs[1].num_preemptions == 1
    assert sched.voluntary_preemptions == {"urgent request waiting": 1}
    finished = serve(sched, runner)
    assert sorted(o.request_id for o in finished) == ["low0", "low1", "urgent"]
    assert all(o.finish_reason == "length" for o in finished)
    assert_scheduler_consistent(sched, reqs)


class PreemptAStranger:
    """A buggy policy: names a request that is not running."""

    def __init__(self, other) -> None:
        self.other = other

    @hookimpl
    def schedkit_select_voluntary_preemptions(self):
        return [self.other]


def test_voluntary_preemption_of_a_request_not_running_fails_the_step_and_undoes_it():
    sched = make_scheduler(max_num_seqs=1, plugins=[PreemptAStranger(make_request("x", [1, 2]))])
    reqs = make_requests(2, max_tokens=3)
    for req in reqs:
        sched.add_request(req)
    step(sched, FakeRunner())  # "0" runs, "1" waits: from now on the hook is asked
    with pytest.raises(PluginError, match="schedkit_select_voluntary_preemptions.*running"):
        sched.schedule()
    assert_scheduler_consistent(sched, reqs)
    assert reqs[0].status is RequestStatus.RUNNING and sched.voluntary_preemptions == {}


# -------------------------------------------------------- schedkit_select_preemption_victim
class PreemptOldestOther:
    """Preempt the oldest running request other than the one that needs blocks."""

    def __init__(self) -> None:
        self.calls = []

    @hookimpl
    def schedkit_select_preemption_victim(self, running, request):
        self.calls.append(([r.request_id for r in running], request.request_id))
        others = [r for r in running if r is not request]
        return others[0] if others else request


def _three_full_requests(plugins=()):
    """3 requests of 8 tokens fill 6 usable blocks of 4; each new token needs a block."""
    sched = make_scheduler(plugins=plugins, block_size=4, num_blocks=7)
    reqs = make_requests(3, num_tokens=8, max_tokens=4)
    for req in reqs:
        sched.add_request(req)
    runner = FakeRunner()
    step(sched, runner)  # all three prefill and sample their first token
    assert sched.kv_cache_manager.num_free_blocks == 0
    return sched, reqs, runner


def test_hook_schedkit_select_preemption_victim():
    fcfs, _, runner = _three_full_requests()
    assert fcfs.schedule().preempted_req_ids == {"2"}  # built-in: the newest, running[-1]

    plugin = PreemptOldestOther()
    sched, reqs, runner = _three_full_requests([plugin])
    out = sched.schedule()
    assert plugin.calls == [(["0", "1", "2"], "0")]  # once: one preemption made room
    assert out.preempted_req_ids == {"1"}
    assert reqs[1].status is RequestStatus.PREEMPTED and reqs[1].num_preemptions == 1
    assert sorted(out.num_scheduled_tokens) == ["0", "2"]
    assert next(iter(sched.waiting)) is reqs[1]  # re-queued with prepend_request
    sched.update_from_output(out, runner.execute(out))
    finished = serve(sched, runner)
    assert sorted(o.request_id for o in finished) == ["0", "1", "2"]
    assert_scheduler_consistent(sched, reqs)


class PreemptAWaitingRequest:
    """A buggy policy: answers with a request that is not running."""

    def __init__(self, waiting_request) -> None:
        self.waiting_request = waiting_request

    @hookimpl
    def schedkit_select_preemption_victim(self):
        return self.waiting_request


def test_victim_that_is_not_running_raises_plugin_error():
    reqs = make_requests(4, num_tokens=8, max_tokens=4)
    sched = make_scheduler(plugins=[PreemptAWaitingRequest(reqs[3])], block_size=4,
                           num_blocks=7, max_num_seqs=3)
    for req in reqs:
        sched.add_request(req)
    step(sched, FakeRunner())  # "0".."2" fill the cache, "3" waits for a running slot
    with pytest.raises(PluginError, match="schedkit_select_preemption_victim") as exc:
        sched.schedule()
    assert exc.value.hook == "schedkit_select_preemption_victim"
    assert exc.value.plugin == "PreemptAWaitingRequest-0"
    assert "PreemptAWaitingRequest-0" in str(exc.value) and "running" in str(exc.value)
    assert reqs[3].status is RequestStatus.WAITING
    assert_scheduler_consistent(sched, reqs)


# ------------------------------------------------------------- schedkit_prefill_chunk_limit
class ChunkEveryPrompt:
    """Give a request at most ``cap`` tokens per step, even when it is alone."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls = []

    @hookimpl
    def schedkit_prefill_chunk_limit(self, request, num_new_tokens, threshold):
        self.calls.append((request.request_id, num_new_tokens, threshold))
        return self.cap


def test_hook_schedkit_prefill_chunk_limit():
    plugin = ChunkEveryPrompt(cap=8)
    sched = make_scheduler(plugins=[plugin])
    sched.add_request(make_request("alone", [1] * 20, max_tokens=3))
    runner = FakeRunner()
    scheduled, calls_per_step = [], []
    while sched.has_requests():
        before = len(plugin.calls)
        out = step(sched, runner).scheduler_output
        scheduled.append(out.num_scheduled_tokens.get("alone", 0))
        calls_per_step.append(len(plugin.calls) - before)
    assert scheduled[:5] == [8, 8, 4, 1, 1]  # a cap >= num_new_tokens changes nothing
    assert calls_per_step[:5] == [1, 1, 1, 0, 0]  # one-token decodes never ask
    # A lone request gets threshold 0 (never capped by the built-in).
    assert plugin.calls == [("alone", 20, 0), ("alone", 12, 0), ("alone", 4, 0)]

    # With company the configured threshold is passed; the plugin's answer wins over
    # the built-in default (which would return the threshold, 6).
    plugin = ChunkEveryPrompt(cap=8)
    sched = make_scheduler(plugins=[plugin], long_prefill_token_threshold=6)
    for req in make_requests(2, num_tokens=20):
        sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 8, "1": 8}
    assert plugin.calls == [("0", 20, 6), ("1", 20, 6)]
    assert make_scheduler(long_prefill_token_threshold=6).hooks.prefill_chunk_limit(
        request=make_request("x", [1] * 20), num_new_tokens=20, threshold=6) == 6


# -------------------------------------------------------------- schedkit_step_token_budget
class WarmUpBudget:
    """Schedule nothing in the first step, then at most 8 tokens per step."""

    def __init__(self) -> None:
        self.steps = []

    @hookimpl
    def schedkit_step_token_budget(self, max_num_batched_tokens, kv_cache_usage, step):
        assert 0.0 <= kv_cache_usage <= 1.0
        self.steps.append(step)
        return 0 if step == 1 else min(8, max_num_batched_tokens)


def test_hook_schedkit_step_token_budget():
    plugin = WarmUpBudget()
    sched = make_scheduler(plugins=[plugin])
    for req in make_requests(2, num_tokens=10, max_tokens=3):
        sched.add_request(req)
    runner = FakeRunner()
    totals = []
    while sched.has_requests():
        out = step(sched, runner).scheduler_output
        assert plugin.steps[-1] == out.step == sched.current_step  # once per schedule()
        totals.append(out.total_num_scheduled_tokens)
    assert totals[:3] == [0, 8, 8]
    assert max(totals) <= 8 and sum(totals) == 2 * 10 + 2 * 2
    assert plugin.steps == list(range(1, len(totals) + 1))
    sched.schedule()  # also called when there is nothing to schedule
    assert plugin.steps[-1] == len(totals) + 1


# ------------------------------------------------------------ schedkit_num_speculative_tokens
class DraftsForTheFirstOnly:
    """Draft tokens for request "0" alone; every other request decodes a token a step."""

    def __init__(self) -> None:
        self.calls = []

    @hookimpl
    def schedkit_num_speculative_tokens(self, running, num_speculative_tokens, step):
        self.calls.append((step, num_speculative_tokens, sorted(r.request_id for r in running)))
        return {r.request_id: 0 for r in running if r.request_id != "0"}


def test_hook_schedkit_num_speculative_tokens():
    def serve_engine(plugins, k):
        config = config_from_dict({"runner": {"kind": "fake", "vocab_size": 1000},
                                   "scheduler": {"num_speculative_tokens": k}})
        engine = EngineCore(config, extra_plugins=plugins)
        drafted = Counter()
        execute = engine.runner.execute

        def spy(so):
            for rid, drafts in so.scheduled_spec_decode_tokens.items():
                drafted[rid] += len(drafts)
            assert_scheduler_consistent(engine.scheduler)
            return execute(so)

        engine.runner.execute = spy
        tokens, errors = drive_engine(engine, make_requests(3, num_tokens=12, max_tokens=10))
        assert not errors
        return tokens, drafted

    plain, none = serve_engine([], 0)
    plugin = DraftsForTheFirstOnly()
    tokens, drafted = serve_engine([plugin], 3)
    assert tokens == plain and not none  # drafts change steps, never tokens
    assert set(drafted) == {"0"} and drafted["0"] > 0
    steps = [c[0] for c in plugin.calls]
    assert steps == sorted(set(steps)) and all(c[1] == 3 for c in plugin.calls)  # once a step
    _, everyone = serve_engine([], 3)  # no plugin: every request gets the configured 3
    assert set(everyone) == {"0", "1", "2"}


# ------------------------------------------------------------------ schedkit_admit_request
class Gatekeeper:
    """Reject tenant "blocked"; skip request "later" the first time it is examined."""

    def __init__(self) -> None:
        self.examined = []

    @hookimpl
    def schedkit_admit_request(self, request, num_running):
        self.examined.append(request.request_id)
        if request.tenant == "blocked":
            return AdmissionDecision.REJECT
        if request.request_id == "later" and self.examined.count("later") == 1:
            return AdmissionDecision.SKIP
        return None  # no opinion: the built-in default admits


def test_hook_schedkit_admit_request():
    plugin = Gatekeeper()
    sched = make_scheduler(plugins=[plugin], max_num_seqs=1)
    reqs = [make_request("later", [1] * 4, max_tokens=1),
            make_request("spam", [2] * 4, max_tokens=1, tenant="blocked"),
            make_request("a", [3] * 4, max_tokens=1),
            make_request("b", [4] * 4, max_tokens=1)]
    for req in reqs:
        sched.add_request(req)

    out = sched.schedule()
    assert plugin.examined == ["later", "spam", "a"]  # "b": no running slot left
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["later", "b"]  # SKIP: back at the head
    assert reqs[1].status is RequestStatus.FINISHED_ABORTED and "spam" not in sched.requests

    outputs = sched.update_from_output(out, runner_output(out, {"a": [7]}))
    by_id = {o.request_id: o for o in outputs[0].outputs}
    assert by_id["spam"].new_token_ids == []
    assert by_id["spam"].finish_reason == FinishReason.ABORT == "abort"
    assert by_id["spam"].stop_reason == "rejected"
    assert by_id["spam"].rejected_by.startswith("Gatekeeper") and reqs[1].rejected_by == by_id["spam"].rejected_by
    assert by_id["a"].finish_reason == "length" and by_id["a"].rejected_by is None

    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["later"]
    assert plugin.examined[3:] == ["later"]
    sched.update_from_output(out, runner_output(out, {"later": [7]}))
    assert [o.request_id for o in serve(sched, FakeRunner())] == ["b"]
    assert_scheduler_consistent(sched, reqs)


class QuotaGate:
    """Reject tenant "over" with a reason the client is told."""

    @hookimpl
    def schedkit_admit_request(self, request):
        if request.tenant == "over":
            return Rejection(f"tenant {request.tenant!r} is over its token quota")
        return None


def test_a_rejection_carries_its_reason_to_the_output():
    sched = make_scheduler(plugins=[QuotaGate()])
    reqs = [make_request("x", [1] * 4, max_tokens=1, tenant="over"),
            make_request("y", [2] * 4, max_tokens=1, tenant="ok")]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["y"]
    outputs = sched.update_from_output(out, runner_output(out, {"y": [7]}))
    by_id = {o.request_id: o for o in outputs[0].outputs}
    assert (by_id["x"].finish_reason, by_id["x"].stop_reason) == ("abort", "rejected")
    assert by_id["x"].rejected_by.startswith("QuotaGate")
    assert by_id["x"].rejection_reason == reqs[0].rejection_reason == "tenant 'over' is over its token quota"
    assert by_id["y"].rejection_reason is None and by_id["y"].rejected_by is None
    assert sched.hooks.rejections == {by_id["x"].rejected_by: 1}
    assert_scheduler_consistent(sched, reqs)


# -------------------------------------------------------------- schedkit_create_kv_connector
class RecordingConnector(KVConnectorBase):
    """Pretends an external store holds the first 8 tokens of every prompt."""

    def __init__(self, role, config) -> None:
        super().__init__(role, config)
        self.calls = []

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        self.calls.append(("match", request.request_id, num_local_hit_tokens))
        return 8, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", scheduler_output.step))
        return {"step": scheduler_output.step}

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, len(block_ids)))
        return False, {"stored_blocks": len(block_ids)}


class ExternalStore:
    """Creates the RecordingConnector for every role."""

    def __init__(self) -> None:
        self.connectors = []

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connectors.append(RecordingConnector(role, config))
        return self.connectors[-1]


def test_hook_schedkit_create_kv_connector():
    plugin = ExternalStore()
    sched = make_scheduler(plugins=[plugin], block_size=4)
    (conn,) = plugin.connectors  # once, for the scheduler side
    assert sched.connector is conn
    assert conn.role is KVConnectorRole.SCHEDULER and conn.config is sched.cache_config
    assert conn.kv_cache_manager is sched.kv_cache_manager

    sched.add_request(make_request("r", [1] * 20, max_tokens=2))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 12}  # 8 of 20 tokens come from the store
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.kv_connector_metadata == {"step": 1}
    assert conn.calls == [("match", "r", 0), ("alloc", "r", 8), ("meta", 1)]

    outputs = sched.update_from_output(out, runner_output(out, {"r": [5]}))
    out = sched.schedule()
    assert conn.calls[3:] == [("meta", 2)]  # no lookup for a running request
    outputs = sched.update_from_output(out, runner_output(out, {"r": [6]}))
    (done,) = outputs[0].outputs
    assert done.finish_reason == "length"
    assert conn.calls[4:] == [("finished", "r", 6)]  # before its blocks were freed
    assert done.kv_transfer_params == {"stored_blocks": 6}
    assert sched.kv_cache_manager.get_block_ids("r") == []


def test_connector_that_is_not_a_connector_raises_plugin_error():
    class NotAConnector:
        @hookimpl
        def schedkit_create_kv_connector(self):
            return object()

    with pytest.raises(PluginError, match="KVConnectorBase") as exc:
        make_scheduler(plugins=[NotAConnector()])
    assert exc.value.hook == "schedkit_create_kv_connector"
    assert exc.value.plugin == "NotAConnector-0"


# ------------------------------------------------------------------- schedkit_on_step_end
class StepLog:
    """Record, for every step, its number, the running count and who finished."""

    def __init__(self) -> None:
        self.steps = []

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output, outputs, stats, now):
        done = [o.request_id for group in outputs.values() for o in group.outputs if o.finished]
        running = stats.num_running_reqs if stats is not None else None
        self.steps.append((scheduler_output.step, running, done))


def test_hook_schedkit_on_step_end():
    first, second = StepLog(), StepLog()  # an observer hook: every plugin is called
    sched = make_scheduler(plugins=[first, second])
    for req in make_requests(3, num_tokens=5, max_tokens=3):
        sched.add_request(req)
    runner = FakeRunner()
    num_updates = 0
    while sched.has_requests():
        step(sched, runner)
        num_updates += 1
        assert len(first.steps) == num_updates  # once per update_from_output()
    assert first.steps == second.steps
    assert [s for s, _, _ in first.steps] == list(range(1, num_updates + 1))
    assert first.steps[-1][1] == 0  # stats are taken after the step's state changes
    assert sorted(r for _, _, done in first.steps for r in done) == ["0", "1", "2"]

    quiet = StepLog()
    sched = make_scheduler(plugins=[quiet], log_stats=False)
    sched.add_request(make_request("x", [1] * 5, max_tokens=1))
    step(sched, FakeRunner())
    assert quiet.steps == [(1, None, ["x"])]


# ------------------------------------------------------------ schedkit_on_request_finished
class FinishLog:
    """Record every finished request with its finish reason and stop reason."""

    def __init__(self) -> None:
        self.finished = []

    @hookimpl
    def schedkit_on_request_finished(self, request, now):
        reason = request.get_finished_reason()
        self.finished.append((request.request_id, str(reason), request.stop_reason))


class RejectSpam:
    @hookimpl
    def schedkit_admit_request(self, request):
        return AdmissionDecision.REJECT if request.tenant == "spam" else None


def test_hook_schedkit_on_request_finished():
    held_at_finish = {}

    class BlocksAtFinish:  # checks "after its blocks were released"
        kv = None

        @hookimpl
        def schedkit_on_request_finished(self, request):
            held_at_finish[request.request_id] = self.kv.get_block_ids(request.request_id)

    log, checker = FinishLog(), BlocksAtFinish()
    sched = make_scheduler(plugins=[RejectSpam(), log, checker])
    checker.kv = sched.kv_cache_manager
    reqs = [make_request("length", [1] * 5, max_tokens=3),
            make_request("eos", [2] * 5, max_tokens=10),
            make_request("abort", [3] * 5, max_tokens=10),
            make_request("rejected", [4] * 5, tenant="spam")]
    for req in reqs:
        sched.add_request(req)
    runner = FakeRunner(eos_token_id=50256, output_len={"eos": 1}.get)
    step(sched, runner)
    assert [f[0] for f in log.finished] == ["rejected"]
    sched.finish_requests("abort", RequestStatus.FINISHED_ABORTED)
    serve(sched, runner)
    assert sorted(log.finished) == [("abort", "abort", None), ("eos", "stop", None),
                                    ("length", "length", None), ("rejected", "abort", "rejected")]
    assert held_at_finish == {r.request_id: [] for r in reqs}
    sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # nothing left: no calls
    assert len(log.finished) == 4
    assert_scheduler_consistent(sched, reqs)
