"""Plugin mistakes fail loudly, name the plugin (and the hook), and leave the scheduler
usable: a misspelt hook fails at start-up; a hook that raises surfaces as PluginError
with a consistent scheduler that serves everything once the failure is gone."""

from __future__ import annotations

import types

import pytest

from schedkit import AdmissionDecision, PluginError, Rejection, hookimpl
from schedkit.hookspecs import HOOK_NAMES
from schedkit.plugins.manager import get_plugin_manager
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    finished_in,
    make_request,
    make_scheduler,
    serve,
    step,
)
from schedkit.runners.fake import FakeRunner


# ---------------------------------------------------------------- misspelt hook names
class MisspeltDecorated:
    @hookimpl
    def schedkit_selct_victim(self, running):
        return running[0]


class MisspeltUndecorated:
    def schedkit_selct_victim(self, running):  # no @hookimpl: still a hook by its name
        return running[0]


@pytest.mark.parametrize("cls", [MisspeltDecorated, MisspeltUndecorated])
def test_misspelt_hook_fails_at_start_naming_the_plugin(cls):
    with pytest.raises(PluginError) as exc:
        make_scheduler(plugins=[cls()])
    assert exc.value.plugin == f"{cls.__name__}-0"
    assert cls.__name__ in str(exc.value) and "schedkit_selct_victim" in str(exc.value)
    with pytest.raises(PluginError) as exc:
        get_plugin_manager(extra_plugins=[cls()])
    assert exc.value.plugin == f"{cls.__name__}-0"


def test_misspelt_hook_in_a_module_plugin_names_the_module():
    module = types.ModuleType("my_policy")
    module.schedkit_selct_victim = lambda running: running[0]
    with pytest.raises(PluginError, match="my_policy") as exc:
        make_scheduler(plugins=[module])
    assert exc.value.plugin == "my_policy"


def test_unknown_hook_argument_fails_at_start():
    class WrongArgument:
        @hookimpl
        def schedkit_admit_request(self, req):  # the spec calls it `request`
            return None

    with pytest.raises(PluginError, match="WrongArgument") as exc:
        make_scheduler(plugins=[WrongArgument()])
    assert exc.value.plugin == "WrongArgument-0"
    assert "'req': did you mean 'request'?" in str(exc.value)
    assert "schedkit_admit_request takes request, num_running, kv_cache_usage, now" in str(exc.value)


def test_private_helpers_without_the_prefix_are_not_hooks():
    class Helpers:
        def select_victim(self, running):  # no schedkit_ prefix: an ordinary method
            return running[0]

    make_scheduler(plugins=[Helpers()])


# ------------------------------------------------------------------ hooks that raise
class Exploding:
    """Implements every hook; the one named ``hook`` raises while ``armed``."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.armed = True

    def _maybe_raise(self, name: str) -> None:
        if self.armed and name == self.hook:
            raise RuntimeError(f"boom in {name}")

    @hookimpl
    def schedkit_create_waiting_queue(self):
        self._maybe_raise("schedkit_create_waiting_queue")

    @hookimpl
    def schedkit_select_preemption_victim(self):
        self._maybe_raise("schedkit_select_preemption_victim")

    @hookimpl
    def schedkit_prefill_chunk_limit(self):
        self._maybe_raise("schedkit_prefill_chunk_limit")

    @hookimpl
    def schedkit_select_voluntary_preemptions(self):
        self._maybe_raise("schedkit_select_voluntary_preemptions")

    @hookimpl
    def schedkit_step_token_budget(self):
        self._maybe_raise("schedkit_step_token_budget")

    @hookimpl
    def schedkit_admit_request(self):
        self._maybe_raise("schedkit_admit_request")

    @hookimpl
    def schedkit_create_kv_connector(self):
        self._maybe_raise("schedkit_create_kv_connector")

    @hookimpl
    def schedkit_create_structured_output_backend(self):
        self._maybe_raise("schedkit_create_structured_output_backend")

    @hookimpl
    def schedkit_on_step_end(self):
        self._maybe_raise("schedkit_on_step_end")

    @hookimpl
    def schedkit_on_request_finished(self):
        self._maybe_raise("schedkit_on_request_finished")

    @hookimpl
    def schedkit_num_speculative_tokens(self):
        self._maybe_raise("schedkit_num_speculative_tokens")


BUILD_HOOKS = ["schedkit_create_waiting_queue", "schedkit_create_kv_connector"]
FIRST_USE_HOOKS = ["schedkit_create_structured_output_backend"]
"""Called when the first request that needs them arrives."""
BETWEEN_STEPS_HOOKS = ["schedkit_num_speculative_tokens"]
"""Asked by the engine between steps; a raise costs the next step its drafts and nothing
else (tests/policies/test_speculation.py)."""
STEP_HOOKS = [h for h in HOOK_NAMES if h not in BUILD_HOOKS + FIRST_USE_HOOKS + BETWEEN_STEPS_HOOKS]


def test_exploding_covers_every_hook():
    assert sorted(BUILD_HOOKS + FIRST_USE_HOOKS + STEP_HOOKS + BETWEEN_STEPS_HOOKS) == sorted(HOOK_NAMES)
    assert all(hasattr(Exploding, h) for h in HOOK_NAMES)


def _tight_scheduler(plugin):
    """Small KV pool (10 usable blocks of 4) and a prefill threshold, so a workload of
    growing requests calls every per-step hook: budget, chunk limit, admission,
    preemption victim, request finished and step end."""
    return make_scheduler(plugins=[plugin], block_size=4, num_blocks=11, max_num_seqs=4,
                          max_num_batched_tokens=32, long_prefill_token_threshold=6)


def _workload():
    return [make_request(f"r{i}", [i + 1] * (6 + i), max_tokens=8) for i in range(6)]


@pytest.mark.parametrize("hook", STEP_HOOKS)
def test_raising_hook_is_reported_and_scheduler_recovers(hook):
    plugin = Exploding(hook)
    sched = _tight_scheduler(plugin)
    reqs = _workload()
    for req in reqs:
        sched.add_request(req)
    runner = FakeRunner()
    errors, done = [], []
    for _ in range(500):
        if not sched.has_requests():
            break
        try:
            done += step(sched, runner).finished
        except PluginError as e:
            errors.append(e)
            done += finished_in(e.outputs or {})  # set when the step itself ran
            assert_scheduler_consistent(sched, reqs)
            plugin.armed = False  # the failure is gone; the same scheduler goes on
    assert len(errors) == 1, f"{hook} was never called"
    err = errors[0]
    assert (err.plugin, err.hook) == ("Exploding-0", hook)
    assert "'Exploding-0'" in str(err) and hook in str(err) and "boom" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert sorted(o.request_id for o in done) == sorted(r.request_id for r in reqs)
    assert all(o.finish_reason == "length" for o in done)
    assert_scheduler_consistent(sched, reqs)


@pytest.mark.parametrize("hook", BUILD_HOOKS)
def test_raising_build_hook_fails_the_build(hook):
    plugin = Exploding(hook)
    with pytest.raises(PluginError, match=f"'Exploding-0'.*{hook}") as exc:
        _tight_scheduler(plugin)
    assert (exc.value.plugin, exc.value.hook) == ("Exploding-0", hook)
    plugin.armed = False
    sched = _tight_scheduler(plugin)
    reqs = _workload()
    for req in reqs:
        sched.add_request(req)
    assert len(serve(sched, FakeRunner())) == len(reqs)
    assert_scheduler_consistent(sched, reqs)


def test_a_raising_backend_hook_refuses_the_structured_request_and_the_engine_goes_on(tmp_path):
    from schedkit.config import config_from_dict
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore
    from schedkit.errors import RequestError

    hook = "schedkit_create_structured_output_backend"
    plugin = Exploding(hook)
    engine = EngineCore(config_from_dict({}), extra_plugins=[plugin])

    def structured(rid):
        return Request(rid, [1, 2], SamplingParams(max_tokens=2, structured_outputs={"choice": ["a"]}), 0.0)

    with pytest.raises(RequestError, match=f"'Exploding-0' raised in hook {hook}: RuntimeError: boom"):
        engine.add_request(structured("s1"))
    engine.add_request(Request("plain", [1, 2], SamplingParams(max_tokens=2), 0.0))
    outs = []
    while engine.has_requests():
        outs += [o for g in engine.step().values() for o in g.outputs if o.finish_reason]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("plain", "length")]
    plugin.armed = False  # the next structured request tries the hook again
    with pytest.raises(RequestError, match="tokenizer"):  # now the built-in answers: no tokenizer here
        engine.add_request(structured("s2"))
    assert not engine.scheduler.requests


class FailOnSecondAdmission:
    """Admits the first request it sees in a step, then raises."""

    def __init__(self) -> None:
        self.armed = True
        self.seen = 0

    @hookimpl
    def schedkit_admit_request(self, request):
        self.seen += 1
        if self.armed and self.seen == 2:
            raise ValueError(f"cannot decide on {request.request_id}")
        return None


def test_admissions_of_a_failed_step_are_rolled_back():
    plugin = FailOnSecondAdmission()
    sched = make_scheduler(plugins=[plugin], block_size=4)
    reqs = [make_request(f"r{i}", [i + 1] * 9, max_tokens=3) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    with pytest.raises(PluginError, match="cannot decide on r1") as exc:
        sched.schedule()
    assert exc.value.hook == "schedkit_admit_request"
    # r0 had been admitted (blocks allocated) when r1's decision raised: undone.
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"]
    assert not sched.running and sched.kv_cache_manager.num_tracked_requests == 0
    assert all(r.num_computed_tokens == 0 for r in reqs)
    assert_scheduler_consistent(sched, reqs)
    plugin.armed = False
    runner = FakeRunner()
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1", "r2"]
    done = finished_in(sched.update_from_output(out, runner.execute(out)))
    done += serve(sched, runner)
    assert sorted(o.request_id for o in done) == ["r0", "r1", "r2"]
    assert_scheduler_consistent(sched, reqs)


class RejectAndExplodeOnFinish:
    """Rejects request "bad"; its finish observer raises while armed."""

    armed = True

    @hookimpl
    def schedkit_admit_request(self, request):
        return AdmissionDecision.REJECT if request.request_id == "bad" else None

    @hookimpl
    def schedkit_on_request_finished(self):
        if self.armed:
            raise RuntimeError("boom")


def test_observer_raising_for_a_rejected_request_does_not_lose_the_step():
    plugin = RejectAndExplodeOnFinish()
    sched = make_scheduler(plugins=[plugin])
    reqs = [make_request("good", [1] * 5, max_tokens=3), make_request("bad", [2] * 5)]
    for req in reqs:
        sched.add_request(req)
    runner = FakeRunner()
    out = sched.schedule()  # "good" admitted, "bad" rejected: the plan must reach the runner
    assert [n.req_id for n in out.scheduled_new_reqs] == ["good"]
    with pytest.raises(PluginError) as exc:
        sched.update_from_output(out, runner.execute(out))
    assert (exc.value.plugin, exc.value.hook) == ("RejectAndExplodeOnFinish-0",
                                                  "schedkit_on_request_finished")
    (rejected,) = finished_in(exc.value.outputs)
    assert (rejected.request_id, rejected.stop_reason) == ("bad", "rejected")
    assert_scheduler_consistent(sched, reqs)
    plugin.armed = False
    assert [o.request_id for o in serve(sched, runner)] == ["good"]
    assert_scheduler_consistent(sched, reqs)


# ------------------------------------------------------------- who gets the blame
class HugeBudget:
    @hookimpl
    def schedkit_step_token_budget(self):
        return 10**9


class NoOpinion:
    @hookimpl
    def schedkit_step_token_budget(self):
        return None


def test_bad_answer_is_a_plugin_error_naming_the_plugin():
    sched = make_scheduler(plugins=[HugeBudget()])
    sched.add_request(make_request("r", [1] * 4))
    with pytest.raises(PluginError, match="1000000000") as exc:
        sched.schedule()
    assert (exc.value.plugin, exc.value.hook) == ("HugeBudget-0", "schedkit_step_token_budget")
    assert_scheduler_consistent(sched, [sched.requests["r"]])


def test_bad_answer_blames_the_plugin_that_gave_it():
    sched = make_scheduler(plugins=[HugeBudget(), NoOpinion()])  # NoOpinion is asked first
    sched.add_request(make_request("r", [1] * 4))
    with pytest.raises(PluginError) as exc:
        sched.schedule()
    assert exc.value.plugin == "HugeBudget-0"


@pytest.mark.parametrize("answer", [Rejection(""), Rejection("   "), Rejection(42), Rejection("x" * 513),
                                    "reject", True])
def test_a_bad_admission_answer_is_a_plugin_error_and_nothing_is_lost(answer):
    class BadGate:
        @hookimpl
        def schedkit_admit_request(self, request):
            return answer if request.request_id == "bad" else None

    gate = BadGate()
    sched = make_scheduler(plugins=[gate])
    reqs = [make_request("bad", [1] * 4, max_tokens=2), make_request("ok", [2] * 4, max_tokens=2)]
    for req in reqs:
        sched.add_request(req)
    with pytest.raises(PluginError, match="AdmissionDecision or a Rejection|reason must be") as exc:
        sched.schedule()
    assert (exc.value.plugin, exc.value.hook) == ("BadGate-0", "schedkit_admit_request")
    assert reqs[0].rejected_by is None and reqs[0].rejection_reason is None
    assert_scheduler_consistent(sched, reqs)
    answer = None  # the plugin is fixed: both are served, nothing was lost
    assert sorted(r.request_id for r in serve(sched, FakeRunner())) == ["bad", "ok"]


class Observer:
    def __init__(self, explode: bool) -> None:
        self.explode = explode

    @hookimpl
    def schedkit_on_step_end(self):
        if self.explode:
            raise RuntimeError("boom")


def test_raising_instance_is_blamed_among_instances_of_one_class():
    sched = make_scheduler(plugins=[Observer(explode=True), Observer(explode=False)])
    sched.add_request(make_request("r", [1] * 4))
    with pytest.raises(PluginError) as exc:
        step(sched, FakeRunner())
    assert exc.value.plugin == "Observer-0"
