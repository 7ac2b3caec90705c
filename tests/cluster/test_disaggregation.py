"""Prefill/decode disaggregation in the router: replica roles, the decision hook, and
each stage placed through the filters, scorers and picker."""

from __future__ import annotations

import pytest

from schedkit import ConfigError, PluginError, hookimpl
from schedkit.cluster.router import Router
from schedkit.config import config_from_dict, load_config
from schedkit.core.routing import ReplicaRole, RouteEventKind, RouteStage
from schedkit.kv.events import BlockStored
from tests.cluster.test_router import LazyBugs, Nonsense, RaisingEverywhere

BS = 4


def make_router(policy: str = "round-robin", n: int = 5, *, roles=None, threshold=None, plugins=(),
                extra=(), **cache) -> Router:
    router = {"policy": policy, "plugins": list(plugins)}
    if threshold is not None:
        router["plugins"].append({"name": "selective-pd", "settings": {"threshold": threshold}})
    replicas = {"count": n}
    if roles is not None:
        replicas["roles"] = roles
    cfg = {"replicas": replicas, "router": router, "cache": {"block_size": BS, **cache}}
    return Router(config_from_dict(cfg), extra_plugins=extra)


def place(router: Router, rid: str, num_tokens: int = 40, *, first: int = 1, **kw) -> tuple[int | None, int]:
    """(prefill replica or None, decode / whole replica) of a prompt of ``num_tokens``."""
    p = router.place(router.make_request(rid, list(range(first, first + num_tokens)), **kw))
    return (p.prefill.index if p.prefill is not None else None), p.replica.index


def hold(router: Router, index: int, prompt: list[int]) -> None:
    hashes = router.make_request("probe", prompt).block_hashes
    router.apply_kv_events(index, [BlockStored(hashes, None, prompt[:len(hashes) * BS], BS)])


class DisaggregateHighPriority:
    """Disaggregate requests of priority < 0 (latency-sensitive: their decode must not
    share steps with long prefills); no opinion on the others."""

    @hookimpl
    def schedkit_router_disaggregate(self, request, prefill_replicas, decode_replicas):
        return True if request.priority < 0 else None


class LastPrefillReplica:
    """Prefill stages go to the highest-numbered candidate; other stages: no opinion."""

    @hookimpl
    def schedkit_router_pick(self, request, replicas, scores):
        return replicas[-1] if request.stage is RouteStage.PREFILL else None


class DecodeOnOdd:
    """Decode stages only on odd-numbered replicas."""

    @hookimpl
    def schedkit_router_filter(self, request, replicas):
        if request.stage is not RouteStage.DECODE:
            return None
        return [r for r in replicas if r.index % 2]


class StageLog:
    def __init__(self) -> None:
        self.events = []

    @hookimpl
    def schedkit_on_route_event(self, event):
        self.events.append((event.kind, event.stage, event.request.request_id, event.replica.index))


# ------------------------------------------------------------------ config
def test_roles_are_given_out_in_index_order():
    r = make_router(n=6, roles={"prefill": 2, "decode": 3}, threshold=0)
    assert [x.role for x in r.replicas] == [ReplicaRole.PREFILL] * 2 + [ReplicaRole.DECODE] * 3 + [ReplicaRole.BOTH]
    assert r.stats()["replicas"][0]["role"] == "prefill"
    assert all(x.role is ReplicaRole.BOTH for x in make_router(n=3).replicas)


@pytest.mark.parametrize("roles,match", [
    ({"prefill": 3, "decode": 3}, r"prefill \(3\) \+ decode \(3\) replicas exceed replicas.count \(5\)"),
    ({"prefill": 5}, "all 5 replicas prefill, so a prefilled request has nowhere to decode"),
    ({"decode": 2}, "at least one replica must prefill"),
    ({"prefill": -1}, "greater than or equal to 0"),
    ({"prefill": 1, "dekode": 2}, "dekode"),
])
def test_bad_roles_are_refused_naming_the_key(roles, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"replicas": {"count": 5, "roles": roles}})


def test_roles_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  count: 2\n  roles:\n    prefill: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml:4: replicas.roles.prefill = 2: all 2 replicas prefill"):
        load_config(path)


def test_selective_pd_needs_roles_and_checks_its_threshold():
    with pytest.raises(ConfigError, match="'selective-pd' decides which requests are disaggregated, which "
                                          "needs replicas.roles"):
        make_router(n=3, threshold=10)
    with pytest.raises(PluginError, match="'selective-pd'.*threshold must be >= 0"):
        make_router(roles={"prefill": 1}, threshold=-1)


# ------------------------------------------------------------------ the decision
def test_hook_schedkit_router_disaggregate():
    r = make_router(n=4, roles={"prefill": 1, "decode": 3}, threshold=float("inf"),
                    extra=[DisaggregateHighPriority()])
    assert place(r, "urgent", priority=-1) == (0, 1)
    assert place(r, "normal") == (None, 2)  # no opinion: selective-pd, which never disaggregates
    assert r.num_disaggregated == 1 and r.stats()["num_disaggregated"] == 1


def test_selective_pd_disaggregates_long_uncached_prompts():
    r = make_router(n=3, roles={"prefill": 1, "decode": 2}, threshold=16)
    assert place(r, "long", 40) == (0, 1)
    assert place(r, "short", 16) == (None, 2)  # 16 uncached tokens: not more than the threshold
    assert place(r, "long2", 17)[0] == 0


def test_selective_pd_judges_from_the_best_decode_candidates_cache():
    r = make_router(n=3, roles={"prefill": 1, "decode": 2}, threshold=16)
    prompt = list(range(1, 41))
    hold(r, 0, prompt)  # the prefill replica's cache does not count
    assert place(r, "a", 40)[0] == 0
    hold(r, 2, prompt[:28])  # 7 of its 10 blocks cached on a decode replica: 12 tokens uncached
    assert place(r, "b", 40)[0] is None


def test_selective_pd_counts_only_the_cached_prefix():
    r = make_router(n=2, roles={"prefill": 1}, threshold=16)
    prompt = list(range(1, 41))
    hashes = r.make_request("probe", prompt).block_hashes
    gap = hashes[:3] + hashes[4:]  # every block but the fourth: a 3-block prefix hit
    r.apply_kv_events(1, [BlockStored(gap, None, prompt[:len(gap) * BS], BS)])
    assert place(r, "a", 40) == (0, 1)  # 28 tokens uncached


def test_without_prefix_caching_the_whole_prompt_is_uncached():
    r = make_router(n=2, roles={"prefill": 1}, threshold=16, enable_prefix_caching=False)
    assert place(r, "a", 17) == (0, 1)
    assert place(r, "b", 16) == (None, 1)


def test_without_roles_nothing_is_disaggregated_and_the_hook_is_not_called():
    calls = []

    class Spy:
        @hookimpl
        def schedkit_router_disaggregate(self, request):
            calls.append(request.request_id)
            return True

    r = make_router(n=3, extra=[Spy()])
    assert [place(r, f"a{i}") for i in range(4)] == [(None, 0), (None, 1), (None, 2), (None, 0)]
    assert calls == [] and r.num_disaggregated == 0


# ------------------------------------------------------------------ the two stages
def test_each_stage_rotates_among_its_own_replicas():
    r = make_router(n=5, roles={"prefill": 2, "decode": 3}, threshold=0)
    assert [place(r, f"a{i}") for i in range(4)] == [(0, 2), (1, 3), (0, 4), (1, 2)]
    assert place(r, "tiny", 1, first=9) == (0, 3)  # one uncached token is more than 0


def test_whole_requests_never_go_to_prefill_replicas():
    r = make_router(n=4, roles={"prefill": 2, "decode": 1}, threshold=float("inf"))
    assert {place(r, f"a{i}")[1] for i in range(6)} == {2, 3}
    assert {r.route(r.make_request(f"b{i}", [1, 2])).index for i in range(4)} == {2, 3}


def test_a_plugin_picks_the_prefill_replica_and_another_filters_the_decode_one():
    r = make_router("least-outstanding", n=6, roles={"prefill": 3, "decode": 3}, threshold=0,
                    extra=[LastPrefillReplica(), DecodeOnOdd()])
    placed = [place(r, f"a{i}") for i in range(4)]
    assert {p for p, _ in placed} == {2}
    assert {d for _, d in placed} == {3, 5}


def test_a_both_replica_never_prefills_what_it_must_decode():
    r = make_router(n=2, roles={"prefill": 1}, threshold=0)  # replica 1: both
    assert [place(r, f"a{i}") for i in range(3)] == [(0, 1)] * 3
    r2 = make_router(n=3, roles={"prefill": 1}, threshold=0)  # replicas 1 and 2: both
    assert all(p != d and d in (1, 2) for p, d in (place(r2, f"a{i}") for i in range(6)))


def test_outstanding_counts_and_events_follow_each_stage():
    log = StageLog()
    r = make_router(n=2, roles={"prefill": 1, "decode": 1}, threshold=0, extra=[log])
    assert place(r, "a") == (0, 1)
    assert [x.num_outstanding for x in r.replicas] == [1, 1]
    r.prefill_done("a")
    assert [x.num_outstanding for x in r.replicas] == [0, 1]
    r.finished("a")
    assert [x.num_outstanding for x in r.replicas] == [0, 0]
    assert log.events == [(RouteEventKind.ROUTED, RouteStage.PREFILL, "a", 0),
                          (RouteEventKind.ROUTED, RouteStage.DECODE, "a", 1),
                          (RouteEventKind.FINISHED, RouteStage.PREFILL, "a", 0),
                          (RouteEventKind.FINISHED, RouteStage.DECODE, "a", 1)]
    r.prefill_done("a")  # unknown by now: ignored
    assert r.replicas[0].num_outstanding == 0


def test_session_affinity_keeps_a_home_per_stage():
    r = make_router("session-affinity", n=4, roles={"prefill": 2, "decode": 2}, threshold=0)
    first = place(r, "a", session_id="s")
    assert [place(r, f"b{i}", session_id="s") for i in range(3)] == [first] * 3


# ------------------------------------------------------------------ plugin failures
class RaisingDecider:
    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        raise RuntimeError("decision bug")


class NotABool:
    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        return "yes"


@pytest.mark.parametrize("plugin", [RaisingDecider(), NotABool()], ids=["raising", "not-a-bool"])
def test_a_misbehaving_decision_is_ignored_and_counted(plugin, caplog):
    r = make_router(n=3, roles={"prefill": 1, "decode": 2}, threshold=16, extra=[plugin])
    assert place(r, "long", 40) == (0, 1)  # selective-pd decided
    assert place(r, "short", 8) == (None, 2)
    name = f"{type(plugin).__name__}-0"
    assert r.errors == {(name, "schedkit_router_disaggregate"): 2}
    assert any("schedkit_router_disaggregate" in m for m in caplog.messages)
    assert r.stats()["num_hook_errors"] == [[name, "schedkit_router_disaggregate", 2]]


@pytest.mark.parametrize("make_plugin", [lambda: RaisingEverywhere(), lambda: Nonsense(object()),
                                         lambda: LazyBugs()], ids=["raising", "nonsense", "lazy"])
def test_misbehaving_router_plugins_lose_no_disaggregated_request(make_plugin):
    plugin = make_plugin()
    r = make_router("least-outstanding", n=4, roles={"prefill": 1, "decode": 3}, threshold=16, extra=[plugin])
    placed = [place(r, f"a{i}", 40 if i % 2 else 8) for i in range(6)]
    assert placed == [(None, 1), (0, 2), (None, 3), (0, 1), (None, 2), (0, 3)]  # the built-ins decided
    assert sum(x.num_outstanding for x in r.replicas) == 9
    hooks = {h for _, h in r.errors}
    assert {"schedkit_router_disaggregate", "schedkit_router_filter", "schedkit_router_pick"} <= hooks
