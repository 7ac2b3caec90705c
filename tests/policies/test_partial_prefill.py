"""partial-prefill-cap: at most ``max_partial_prefills`` requests compute their prompt at
once, at most ``max_long_partial_prefills`` of them long, and short prompts go ahead of
long ones while the long cap is full. Real scheduler, fake runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from schedkit.config import config_from_dict
from schedkit.core.hooks import AdmissionDecision
from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import RequestStatus
from schedkit.core.scheduler import Scheduler
from schedkit.errors import PluginError
from schedkit.hookspecs import hookimpl
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import get_plugin_manager
from schedkit.policies.partial_prefill import PartialPrefillCap

from ._harness import Run, req, run

THRESHOLD = 256
SCHED = {"max_num_batched_tokens": 384, "long_prefill_token_threshold": 128, "max_num_seqs": 16}


@dataclass
class Prefills:
    """Per step, the requests computing their prompt: those running with prompt tokens
    left when the step began, and those it admitted."""

    threshold: int
    steps: list[tuple[set[str], set[str]]] = field(default_factory=list)
    """(partial prefills, long ones) of each step."""
    _left: dict[str, int] = field(default_factory=dict)

    def before(self, res: Run) -> None:
        self._left = {r.request_id: r.num_prompt_tokens - r.num_computed_tokens
                      for r in res.sched.running if r.num_computed_tokens < r.num_prompt_tokens}

    def after(self, res: Run, out: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]) -> None:
        left = dict(self._left)
        for new in out.scheduled_new_reqs:
            left[new.req_id] = res.requests[new.req_id].num_prompt_tokens - new.num_computed_tokens
        self.steps.append((set(left), {r for r, n in left.items() if n > self.threshold}))

    def most(self) -> tuple[int, int]:
        return max(len(p) for p, _ in self.steps), max(len(lg) for _, lg in self.steps)


def mixed() -> list:
    """Three long prompts at once, then a short one every step."""
    longs = [req(f"long{i}", 1000, t=0.0, max_tokens=4) for i in range(3)]
    return longs + [req(f"short{i}", 32, t=0.01 * i, max_tokens=4) for i in range(30)]


def serve(plugins: list, **kwargs) -> tuple[Run, Prefills]:
    seen = Prefills(THRESHOLD)
    res = run(mixed(), plugins, before_step=seen.before, on_step=seen.after, check=True,
              **{**SCHED, **kwargs})
    return res, seen


def test_one_long_prefill_at_a_time_while_short_requests_go_ahead():
    cap = PartialPrefillCap(max_partial_prefills=4, max_long_partial_prefills=1, long_threshold=THRESHOLD)
    res, seen = serve([cap])
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in res.requests.values())
    num, num_long = seen.most()
    assert num_long == 1 and num <= 4
    # The second and third long prompts wait for the first; the shorts arriving meanwhile
    # are admitted before them although they queued later (FCFS).
    first = {rid: res.admitted.index(rid) for rid in res.admitted}
    passed = [s for s in first if s.startswith("short") and first[s] < first["long1"]]
    assert len(passed) >= 3
    assert first["long0"] < first["long1"] < first["long2"]  # the longs keep their order
    assert cap.num_skipped > 0

    alone, seen_alone = serve([])  # without the cap the three longs prefill together
    assert seen_alone.most()[1] == 3
    assert alone.mean_ttft([f"short{i}" for i in range(10)]) > res.mean_ttft([f"short{i}" for i in range(10)])


def test_the_total_cap_counts_short_prefills_too():
    cap = PartialPrefillCap(max_partial_prefills=2, max_long_partial_prefills=1, long_threshold=THRESHOLD)
    res, seen = serve([cap])
    assert seen.most() == (2, 1)
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in res.requests.values())


def test_a_cap_that_never_binds_changes_nothing():
    def plan(plugins: list) -> list[tuple]:
        log: list[tuple] = []
        run(mixed(), plugins, on_step=lambda res, out, _: log.append(
            (sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids))), **SCHED)
        return log

    loose = PartialPrefillCap(max_partial_prefills=16, max_long_partial_prefills=16, long_threshold=THRESHOLD)
    assert plan([loose]) == plan([])
    assert loose.num_skipped == 0


def test_a_mostly_cached_long_prompt_counts_as_short():
    prefix = [7] * 992  # 62 blocks of 16
    warm = req("warm", 1000, t=0.0, max_tokens=1, prefix=prefix)
    later = [req("long", 1000, t=0.3), req("long2", 1000, t=0.3),
             req("cached", 1008, t=0.3, prefix=prefix)]
    cap = PartialPrefillCap(max_partial_prefills=4, max_long_partial_prefills=1, long_threshold=THRESHOLD)
    res = run([warm, *later], [cap], enable_prefix_caching=True, check=True, **SCHED)
    assert res.admitted == ["warm", "long", "cached", "long2"]
    assert res.requests["cached"].num_cached_tokens == 992


class AlwaysAdmit:
    """An admission plugin that answers ADMIT itself (registered last, so asked first
    among the plugins that are not ``tryfirst``)."""

    @hookimpl
    def schedkit_admit_request(self) -> AdmissionDecision:
        return AdmissionDecision.ADMIT


def test_another_plugin_s_admit_does_not_pass_the_cap():
    cap = PartialPrefillCap(max_partial_prefills=4, max_long_partial_prefills=1, long_threshold=THRESHOLD)
    _, seen = serve([cap, AlwaysAdmit()])
    assert seen.most()[1] == 1


def test_composes_with_an_ordering_policy_from_yaml():
    config = config_from_dict({
        "scheduler": {"policy": "priority", **SCHED},
        "plugins": [{"name": "partial-prefill-cap",
                     "settings": {"max_partial_prefills": 3, "max_long_partial_prefills": 1,
                                  "long_threshold": THRESHOLD}}]})
    pm = get_plugin_manager(config)
    sched = Scheduler(config.scheduler, config.cache, HookFacade(pm))
    assert isinstance(pm.get_plugin("partial-prefill-cap"), PartialPrefillCap)
    assert isinstance(sched.waiting.policy_queue, KeyedQueue)  # priority still orders the queue

    # The long prompts go in priority order, one at a time; the short ones of the least
    # important class are admitted while the more important long ones wait.
    reqs = [req("l-low", 1000, priority=2), req("l-mid", 1000, t=0.01, priority=1),
            req("l-top", 1000, t=0.01, priority=0), req("s-least", 32, t=0.01, priority=3)]
    res = run(reqs, policy="priority", plugin_settings={"partial-prefill-cap": {
        "max_partial_prefills": 3, "max_long_partial_prefills": 1, "long_threshold": THRESHOLD}}, **SCHED)
    assert res.admitted == ["l-low", "s-least", "l-top", "l-mid"]


def test_not_listed_it_is_not_there():
    pm = get_plugin_manager(config_from_dict({"scheduler": {"policy": "priority"}}))
    assert not any(isinstance(p, PartialPrefillCap) for p in pm.get_plugins())


@pytest.mark.parametrize("kwargs, name", [
    ({"max_partial_prefills": 0}, "max_partial_prefills"),
    ({"max_partial_prefills": 2.5}, "max_partial_prefills"),
    ({"max_partial_prefills": True}, "max_partial_prefills"),
    ({"max_long_partial_prefills": 0}, "max_long_partial_prefills"),
    ({"max_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills"),
    ({"long_threshold": 0}, "long_threshold"),
    ({"long_threshold": "long"}, "long_threshold"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name) as exc:
        PartialPrefillCap(**kwargs)
    assert repr(kwargs[name]) in str(exc.value)


def test_bad_yaml_settings_fail_at_start_up_naming_the_plugin_and_setting():
    config = config_from_dict({"plugins": [{"name": "partial-prefill-cap",
                                            "settings": {"max_long_partial_prefills": 9}}]})
    with pytest.raises(PluginError, match=r"partial-prefill-cap.*max_long_partial_prefills.*9") as exc:
        get_plugin_manager(config)
    assert exc.value.plugin == "partial-prefill-cap"
