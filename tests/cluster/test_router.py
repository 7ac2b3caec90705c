"""The router hooks and the built-in router plugins, each on constructed cases."""

from __future__ import annotations

import math

import pytest

from schedkit import ConfigError, Migration, PluginError, hookimpl
from schedkit.cluster.router import Router, replica_config
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.core.routing import RouteEventKind
from schedkit.engine.core import EngineCore
from schedkit.errors import EngineDeadError
from schedkit.hookspecs import ROUTER_HOOK_NAMES
from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def make_router(policy: str = "weighted", n: int = 3, *, plugins=(), weights=None, extra=(),
                **cache) -> Router:
    cfg = {"replicas": {"count": n}, "router": {"policy": policy, "plugins": list(plugins)},
           "cache": {"block_size": BS, **cache}}
    if weights is not None:
        cfg["router"]["weights"] = weights
    return Router(config_from_dict(cfg), extra_plugins=extra)


def route(router: Router, rid: str, prompt=None, **kw) -> int:
    return router.route(router.make_request(rid, prompt or [7] * 10, **kw)).index


def hold(router: Router, index: int, prompt: list[int]) -> None:
    """Replica ``index`` reports that its prefix cache holds every full block of ``prompt``."""
    hashes = router.make_request("probe", prompt).block_hashes
    router.apply_kv_events(index, [BlockStored(hashes, None, prompt[:len(hashes) * BS], BS)])


def load(router: Router, outstanding: list[int]) -> None:
    """Give each replica that many outstanding requests (routed there, not finished)."""
    k = 0
    for replica, n in zip(router.replicas, outstanding, strict=True):
        for _ in range(n):
            router._placed[f"load-{k}"] = (router.make_request(f"load-{k}", [1]), replica.index)
            replica.num_outstanding += 1
            k += 1


class RouteLog:
    """Record every routing outcome: what happened, to which request, where."""

    def __init__(self) -> None:
        self.events = []

    @hookimpl
    def schedkit_on_route_event(self, event):
        self.events.append((event.kind, event.request.request_id, event.replica.index))


class AvoidLongQueues:
    """Keep requests off replicas whose reported waiting queue is longer than a limit."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting

    @hookimpl
    def schedkit_router_filter(self, replicas):
        return [r for r in replicas if r.num_waiting <= self.max_waiting]


class FewestRunning:
    """Score replicas by the running requests each last reported (fewest scores 1)."""

    @hookimpl
    def schedkit_router_score(self, replicas):
        most = max(r.num_running for r in replicas) or 1
        return [1 - r.num_running / most for r in replicas]


class PinHighPriority:
    """Requests of priority < 0 go to replica 0 when it is a candidate; others: no opinion."""

    @hookimpl
    def schedkit_router_pick(self, request, replicas, scores):
        if request.priority < 0 and replicas[0].index == 0:
            return replicas[0]
        return None


def report(router: Router, index: int, *, waiting: int = 0, running: int = 0) -> None:
    router.update_load(index, num_waiting=waiting, num_running=running, kv_cache_usage=0.0)


# ------------------------------------------------------------------ one test per hook
def test_hook_schedkit_router_filter():
    r = make_router("round-robin", 3, extra=[AvoidLongQueues(max_waiting=4)])
    report(r, 1, waiting=9)
    assert [route(r, f"a{i}") for i in range(4)] == [0, 2, 0, 2]
    for i in range(3):
        report(r, i, waiting=9)  # every replica over the limit: the filter is ignored
    assert route(r, "b") in (0, 1, 2)
    assert r.errors == {("AvoidLongQueues-0", "schedkit_router_filter"): 1}


def test_hook_schedkit_router_score():
    scored = make_router("least-outstanding", 3, extra=[FewestRunning()])
    rr = make_router("round-robin", 3, extra=[FewestRunning()])
    for r in (scored, rr):
        for i, running in enumerate([5, 1, 3]):
            report(r, i, running=running)
    assert route(scored, "x") == 1  # equal outstanding (1 each); fewest running decides
    assert route(scored, "y") == 2  # 1 has one outstanding now: totals 1.0, 0.8, 1.4
    assert route(rr, "x") == 0  # round-robin's picker ignores scores


def test_hook_schedkit_router_pick():
    r = make_router("least-outstanding", 3, extra=[PinHighPriority()])
    assert [route(r, f"hi{i}", priority=-1) for i in range(3)] == [0, 0, 0]
    assert route(r, "normal") == 1  # no opinion: the default picks the least loaded
    r.replica_died(0)
    assert route(r, "hi3", priority=-1) in (1, 2)


def test_hook_schedkit_on_route_event():
    rec = RouteLog()
    r = make_router("round-robin", 2, extra=[rec])
    route(r, "a")
    r.finished("a")
    assert rec.events == [(RouteEventKind.ROUTED, "a", 0), (RouteEventKind.FINISHED, "a", 0)]


# ------------------------------------------------------------------ the built-ins
def test_round_robin_cycles_and_skips_dead_replicas():
    r = make_router("round-robin", 3)
    assert [route(r, f"a{i}") for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.replica_died(1)
    assert [route(r, f"b{i}") for i in range(4)] == [2, 0, 2, 0]
    counts = [x.num_routed for x in r.replicas]
    assert counts == [5, 2, 4]


def test_round_robin_ignores_load():
    r = make_router("round-robin", 2)
    load(r, [10, 0])
    assert [route(r, f"a{i}") for i in range(4)] == [0, 1, 0, 1]


def test_least_outstanding_picks_the_least_loaded_and_counts_finishes():
    r = make_router("least-outstanding", 3)
    load(r, [3, 1, 5])
    assert route(r, "x") == 1  # 1 -> 2 outstanding
    assert route(r, "y") == 1  # still the least (2 < 3)
    assert route(r, "z") == 0  # 0 and 1 tie at 3; after the last pick (1) comes 2 (5), then 0
    r.finished("load-0")
    r.finished("load-1")
    assert r.replicas[0].num_outstanding == 2
    assert route(r, "w") == 0


def test_least_outstanding_ties_rotate():
    r = make_router("least-outstanding", 3)
    picks = [route(r, f"a{i}") for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]  # every request adds one where it goes: a tie each time


def test_kv_usage_prefers_free_kv():
    r = make_router("kv-usage", 3)
    for i, usage in enumerate([0.9, 0.2, 0.5]):
        r.update_load(i, num_waiting=0, num_running=0, kv_cache_usage=usage)
    assert route(r, "x") == 1
    r.update_load(1, num_waiting=0, num_running=0, kv_cache_usage=0.95)
    assert route(r, "y") == 2


def test_prefix_affinity_follows_the_longest_cached_prefix():
    r = make_router("prefix-affinity", 3)
    prompt = list(range(100, 113))  # 3 full blocks of 4
    hold(r, 0, prompt[:4])
    hold(r, 2, prompt[:8])
    assert route(r, "x", prompt) == 2
    assert route(r, "y", prompt[:8] + [0] * 5) == 2  # shares 2 blocks, only 2 holds both
    assert route(r, "z", [5] * 12) in (0, 1)  # nothing cached anywhere: the rotation


def test_prefix_affinity_tracks_removals_and_clears():
    r = make_router("prefix-affinity", 2)
    prompt = list(range(8))
    hold(r, 1, prompt)
    hashes = r.make_request("p", prompt).block_hashes
    assert r.replicas[1].cached_blocks.num_matched_blocks(hashes) == 2
    r.apply_kv_events(1, [BlockRemoved([hashes[1]])])
    assert r.replicas[1].cached_blocks.num_matched_blocks(hashes) == 1
    r.apply_kv_events(1, [AllBlocksCleared()])
    assert r.replicas[1].cached_blocks.num_matched_blocks(hashes) == 0


def test_prefix_affinity_filter_keeps_one_replica_from_being_buried():
    r = make_router("prefix-affinity", 3, plugins=[{"name": "prefix-affinity", "settings": {"max_imbalance": 2}}])
    prompt = list(range(12))
    hold(r, 0, prompt)
    load(r, [3, 0, 1])  # 0 holds the prefix but has 3 > 0 + 2 outstanding
    assert route(r, "x", prompt) != 0
    r.finished("load-0")  # now 2 <= 0 + 2
    assert route(r, "y", prompt) == 0


def test_prefix_affinity_salt_and_disabled_caching():
    r = make_router("prefix-affinity", 2)
    prompt = list(range(8))
    hashes = r.make_request("p", prompt, cache_salt="tenant-a").block_hashes
    r.apply_kv_events(1, [BlockStored(hashes, None, prompt, BS)])
    assert route(r, "x", prompt, cache_salt="tenant-a") == 1
    # An unsalted request with the same tokens shares nothing with the salted blocks.
    assert r.make_request("y", prompt).block_hashes[0] != hashes[0]
    off = make_router("prefix-affinity", 2, enable_prefix_caching=False)
    assert off.make_request("z", prompt).block_hashes == []


def test_prefix_affinity_reads_what_a_real_engine_cached():
    """The router's block hashes are the engine's: a prompt one engine computed routes
    there, from that engine's own KV events (no guess from earlier routing)."""
    cfg = config_from_dict({"replicas": {"count": 2}, "router": {"policy": "prefix-affinity"},
                            "cache": {"block_size": BS, "num_blocks": 64}, "scheduler": {"max_model_len": 128},
                            "runner": {"kind": "fake"}})
    engine = EngineCore(replica_config(cfg))
    prompt = list(range(1, 18))  # 4 full blocks
    engine.add_request(Request("warm", prompt, SamplingParams(max_tokens=2), arrival_time=0.0))
    while engine.has_requests():
        engine.step()
    events = engine.scheduler.kv_cache_manager.take_events()
    assert any(isinstance(e, BlockStored) for e in events)
    r = Router(cfg)
    r.apply_kv_events(1, events)
    req = r.make_request("x", prompt[:16] + [99])
    assert r.replicas[1].cached_blocks.num_matched_blocks(req.block_hashes) == 4
    assert r.route(req).index == 1


def test_session_affinity_sticks_and_moves_when_its_replica_dies():
    r = make_router("session-affinity", 3)
    first = route(r, "a0", session_id="s1")
    route(r, "b0", session_id="s2")
    assert [route(r, f"a{i}", session_id="s1") for i in range(1, 4)] == [first] * 3
    r.replica_died(first)
    moved = route(r, "a4", session_id="s1")
    assert moved != first
    assert route(r, "a5", session_id="s1") == moved


def test_session_affinity_by_tenant():
    r = make_router("session-affinity", 3, plugins=[{"name": "session-affinity", "settings": {"key": "tenant"}}])
    home = route(r, "x0", tenant="acme")
    assert {route(r, f"x{i}", tenant="acme") for i in range(1, 5)} == {home}


def test_session_affinity_forgets_the_oldest_sessions():
    r = make_router("session-affinity", 2,
                    plugins=[{"name": "session-affinity", "settings": {"max_entries": 2}}])
    plugin = r.plugin_manager.get_plugin("session-affinity")
    for s in ("s1", "s2", "s3"):
        route(r, f"r-{s}", session_id=s)
    assert list(plugin.home) == ["s2", "s3"]


def test_weighted_trades_queue_depth_against_prefix_hits():
    prompt = list(range(12))
    r = make_router("weighted", 3)
    hold(r, 0, prompt)
    load(r, [2, 0, 4])  # queue scores 0.5, 1, 0; prefix 1, 0, 0
    assert route(r, "x", prompt) == 0
    light = make_router("weighted", 3, plugins=[{"name": "weighted", "settings": {"prefix_weight": 0.25}}])
    hold(light, 0, prompt)
    load(light, [2, 0, 4])  # 0: (0.5 + 0.25) / 1.25 = 0.6 < 1: 1 wins
    assert route(light, "x", prompt) == 1


def test_yaml_weights_combine_scorers():
    prompt = list(range(12))
    plugins = [{"name": "prefix-affinity", "settings": {"max_imbalance": 0}}]
    heavy_prefix = make_router("least-outstanding", 2, plugins=plugins,
                               weights={"least-outstanding": 1, "prefix-affinity": 3})
    light_prefix = make_router("least-outstanding", 2, plugins=plugins,
                               weights={"least-outstanding": 1, "prefix-affinity": 0.5})
    for r in (heavy_prefix, light_prefix):
        hold(r, 1, prompt)
        load(r, [0, 3])
    assert route(heavy_prefix, "x", prompt) == 1  # 0 + 3 > 1 + 0
    assert route(light_prefix, "x", prompt) == 0  # 0 + 0.5 < 1 + 0


def test_observer_sees_routed_finished_failed_and_rerouted():
    rec = RouteLog()
    r = make_router("round-robin", 2, extra=[rec])
    route(r, "a")
    route(r, "b")
    r.finished("a")
    assert r.replica_died(1)[0].request_id == "b"
    assert r.reroute("b").index == 0
    r.finished("b", failed=True)
    assert rec.events == [
        (RouteEventKind.ROUTED, "a", 0), (RouteEventKind.ROUTED, "b", 1),
        (RouteEventKind.FINISHED, "a", 0), (RouteEventKind.REROUTED, "b", 1),
        (RouteEventKind.ROUTED, "b", 0), (RouteEventKind.FAILED, "b", 0)]
    assert [x.num_outstanding for x in r.replicas] == [0, 0]
    assert r.num_rerouted == 1
    r.finished("never-routed")  # ignored


def test_no_healthy_replica_is_engine_dead_error():
    r = make_router("weighted", 2)
    r.replica_died(0)
    r.replica_died(1)
    with pytest.raises(EngineDeadError, match="all 2 died"):
        route(r, "x")


def test_dead_replica_events_are_ignored():
    r = make_router("prefix-affinity", 2)
    r.replica_died(0)
    hold(r, 0, list(range(8)))
    assert len(r.replicas[0].cached_blocks) == 0


# ------------------------------------------------------------------ plugin failures
class RaisingEverywhere:
    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        raise RuntimeError("disaggregation bug")

    @hookimpl
    def schedkit_router_migrate(self, replicas):
        raise RuntimeError("migration bug")

    @hookimpl
    def schedkit_router_admit(self, request):
        raise RuntimeError("admission bug")

    @hookimpl
    def schedkit_router_filter(self, replicas):
        raise RuntimeError("filter bug")

    @hookimpl
    def schedkit_router_score(self, replicas):
        raise ValueError("score bug")

    @hookimpl(tryfirst=True)
    def schedkit_router_pick(self, replicas):
        raise KeyError("pick bug")

    @hookimpl
    def schedkit_on_route_event(self, event):
        raise RuntimeError("observer bug")


class Nonsense:
    def __init__(self, foreign):
        self.foreign = foreign

    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        return "maybe"

    @hookimpl
    def schedkit_router_migrate(self, requests):
        return [Migration("no-such-request", 1), "a move"]

    @hookimpl
    def schedkit_router_admit(self, request):
        return "refuse"

    @hookimpl
    def schedkit_router_filter(self, replicas):
        return []

    @hookimpl
    def schedkit_router_score(self, replicas):
        return [math.nan] * len(replicas)

    @hookimpl(tryfirst=True)
    def schedkit_router_pick(self, replicas):
        return self.foreign


class WrongLength:
    @hookimpl
    def schedkit_router_score(self, replicas):
        return [1.0]

    @hookimpl
    def schedkit_router_migrate(self, requests):
        return [Migration(q.request_id, 99) for reqs in requests.values() for q in reqs]  # no such replica

    @hookimpl
    def schedkit_router_filter(self, replicas):
        return [object()]


class BadRepr:
    def __repr__(self):
        raise RuntimeError("repr bug")

    def __iter__(self):
        raise RuntimeError("iter bug")


class LazyBugs:
    """Answers whose own code raises only when the router reads them."""

    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        return BadRepr()

    @hookimpl
    def schedkit_router_migrate(self, requests):
        return (1 / 0 for _ in requests)

    @hookimpl
    def schedkit_router_admit(self, request):
        return BadRepr()

    @hookimpl
    def schedkit_router_filter(self, replicas):
        return (r for r in replicas if r.no_such_attribute)

    @hookimpl
    def schedkit_router_score(self, replicas):
        return (1 / 0 for r in replicas)

    @hookimpl(tryfirst=True)
    def schedkit_router_pick(self, replicas):
        return BadRepr()


@pytest.mark.parametrize("make_plugin", [lambda: RaisingEverywhere(), lambda: Nonsense(object()),
                                         lambda: WrongLength(), lambda: LazyBugs()],
                         ids=["raising", "nonsense", "wrong-shape", "lazy"])
def test_a_misbehaving_router_plugin_never_loses_a_request(make_plugin, caplog):
    plugin = make_plugin()
    r = make_router("least-outstanding", 3, extra=[plugin])
    picks = [route(r, f"a{i}") for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]  # the built-ins decided
    assert sum(x.num_outstanding for x in r.replicas) == 6
    assert r.plan_migrations() == []  # no move made of a bad answer
    assert r.errors and all(p == type(plugin).__name__ + "-0" for p, _ in r.errors)
    assert any("router plugin" in m for m in caplog.messages)
    assert r.stats()["num_hook_errors"]


def test_the_fault_plugins_implement_every_router_hook():
    """Each hook a router plugin may implement is exercised by the misbehaving plugins
    (the one that raises everywhere, and the ones answering nonsense); the
    disaggregation decision is reached with replica roles, in
    tests/cluster/test_disaggregation.py."""
    assert all(hasattr(RaisingEverywhere, h) for h in ROUTER_HOOK_NAMES)
    covered = {h for cls in (Nonsense, WrongLength, LazyBugs) for h in ROUTER_HOOK_NAMES if hasattr(cls, h)}
    assert covered == set(ROUTER_HOOK_NAMES) - {"schedkit_on_route_event"}


def test_a_plugin_filter_narrows_and_a_plugin_picker_decides():
    class OnlyOdd:
        @hookimpl
        def schedkit_router_filter(self, replicas):
            return [x for x in replicas if x.index % 2]

    class Last:
        @hookimpl
        def schedkit_router_pick(self, replicas, scores):
            return replicas[-1]

    r = make_router("round-robin", 4, extra=[OnlyOdd()])
    assert {route(r, f"a{i}") for i in range(6)} == {1, 3}
    r2 = make_router("least-outstanding", 4, extra=[Last()])
    assert [route(r2, f"a{i}") for i in range(3)] == [3, 3, 3]


# ------------------------------------------------------------------ config
def test_unknown_router_policy_names_it_and_the_builtins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas: {count: 2}\nrouter:\n  policy: nearest-moon\n")
    from schedkit.config import load_config
    with pytest.raises(ConfigError, match=r"c.yaml:3: router plugin 'nearest-moon' is not installed.*round-robin"):
        Router(load_config(path))


def test_an_engine_policy_is_not_a_router():
    with pytest.raises(PluginError, match="'sjf' implements no router hook"):
        make_router("sjf")


def test_bad_router_settings_name_the_plugin():
    with pytest.raises(PluginError, match="'prefix-affinity'.*max_imbalance must be >= 0"):
        make_router("prefix-affinity", plugins=[{"name": "prefix-affinity", "settings": {"max_imbalance": -1}}])
    with pytest.raises(PluginError, match="key must be 'session' or 'tenant'"):
        make_router("session-affinity", plugins=[{"name": "session-affinity", "settings": {"key": "ip"}}])


def test_weights_must_name_switched_on_plugins():
    with pytest.raises(ConfigError, match=r"router.weights names \['kv-usage'\]"):
        config_from_dict({"router": {"policy": "weighted", "weights": {"kv-usage": 2}}})
    with pytest.raises(ConfigError, match="finite and non-negative"):
        config_from_dict({"router": {"policy": "weighted", "weights": {"weighted": -1}}})


def test_misspelt_router_hook_is_named():
    class Typo:
        def schedkit_router_scroe(self, replicas):
            return None

    with pytest.raises(PluginError, match="did you mean 'schedkit_router_score'"):
        make_router("weighted", extra=[Typo()])


def test_replicas_config_is_checked():
    with pytest.raises(ConfigError, match="backend"):
        config_from_dict({"replicas": {"count": 2, "backend": "kubernetes"}})
    with pytest.raises(ConfigError, match="count"):
        config_from_dict({"replicas": {"count": 0}})
    with pytest.raises(ConfigError, match="non-negative"):
        config_from_dict({"replicas": {"resources": {"TPU": -1}}})


def test_disabled_router_plugins_are_refused_not_skipped(monkeypatch):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "weighted")
    with pytest.raises(ConfigError, match="router.policy: 'weighted' is switched on here but disabled"):
        make_router("weighted")
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "session-affinity")
    with pytest.raises(ConfigError, match="router.plugins: 'session-affinity'"):
        make_router("weighted", plugins=[{"name": "session-affinity"}])
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "RouteLog-0")
    r = make_router("round-robin", extra=[RouteLog()])  # an object passed in code: blocked
    assert r.plugin_manager.get_plugin("RouteLog-0") is None
    route(r, "x")


def test_mistyped_or_misplaced_cluster_keys_are_refused():
    with pytest.raises(ConfigError, match="replicas.num_gpus only apply with backend: ray"):
        config_from_dict({"replicas": {"count": 2, "num_gpus": 1}})
    with pytest.raises(ConfigError, match="replicas.ray_address, replicas.resources only apply"):
        config_from_dict({"replicas": {"count": 2, "ray_address": "auto", "resources": {"x": 1}}})
    with pytest.raises(ConfigError, match=r"\['GPU'\] are Ray's own resources"):
        config_from_dict({"replicas": {"count": 2, "backend": "ray", "resources": {"GPU": 1}}})
    config_from_dict({"replicas": {"count": 2, "backend": "ray", "num_gpus": 1, "resources": {"x": 1}}})
    with pytest.raises(ConfigError, match=r"router.weights: \['round-robin'\] implement no scorer"):
        make_router("round-robin", weights={"round-robin": 5})
