"""Live migration in the router: the ``schedkit_router_migrate`` hook's answers are
checked move by move, a move updates the router's books and tells the observers, and
the bundled ``rebalance`` and ``drain`` plugins choose as documented."""

from __future__ import annotations

import pytest

from schedkit import Migration, hookimpl
from schedkit.cluster.router import Router
from schedkit.config import config_from_dict
from schedkit.core.routing import RouteEventKind


def make_router(n: int = 3, plugins=(), extra=(), **replicas) -> Router:
    cfg = {"replicas": {"count": n, **replicas},
           "router": {"policy": "round-robin", "plugins": list(plugins)}}
    return Router(config_from_dict(cfg), extra_plugins=extra)


def route(r: Router, rid: str, n: int = 20) -> int:
    return r.route(r.make_request(rid, list(range(1, n + 1)))).index


class Moves:
    def __init__(self, *moves: Migration):
        self.moves = list(moves)
        self.seen: dict[int, list[str]] = {}

    @hookimpl
    def schedkit_router_migrate(self, replicas, requests):
        self.seen = {i: [q.request_id for q in qs] for i, qs in requests.items()}
        return self.moves


class Events:
    def __init__(self):
        self.events = []

    @hookimpl
    def schedkit_on_route_event(self, event):
        self.events.append(event)


def test_hook_schedkit_router_migrate():
    plugin, events = Moves(Migration("a", 2, "why")), Events()
    r = make_router(extra=[plugin, events])
    assert [route(r, x) for x in "abc"] == [0, 1, 2]
    assert r.migrates
    [(req, source, target, reason)] = r.plan_migrations()
    assert (req.request_id, source, target, reason) == ("a", 0, 2, "why")
    assert plugin.seen == {0: ["a"], 1: ["b"], 2: ["c"]}
    r.migrated("a", 2)
    assert [x.num_outstanding for x in r.replicas] == [0, 1, 2]
    assert r.replica_of("a") == 2 and r.num_migrated == 1
    last = events.events[-1]
    assert last.kind is RouteEventKind.MIGRATED and last.replica.index == 0 and last.target.index == 2
    r.finished("a")
    assert [x.num_outstanding for x in r.replicas] == [0, 1, 1]
    assert r.plan_migrations(moving={"b"}) == [] and plugin.seen == {0: [], 1: [], 2: ["c"]}


@pytest.mark.parametrize("move,why", [
    (Migration("zz", 1), "not an outstanding request it was offered"),
    (Migration("a", 0), "not another replica's index"),
    (Migration("a", 7), "not another replica's index"),
    (Migration("a", True), "not another replica's index"),
    (Migration("a", 1), "which is unhealthy"),
    (Migration("a", 2), "which is draining"),
])
def test_bad_moves_are_dropped_one_by_one(move, why, caplog):
    plugin = Moves(move, Migration("c", 0))
    r = make_router(extra=[plugin])
    for x in "abc":
        route(r, x)
    r.replica_died(1)
    r.drain(2)
    plans = r.plan_migrations()
    assert [(q.request_id, s, t) for q, s, t, _ in plans] == [("c", 2, 0)]  # the valid one goes ahead
    assert r.errors[("Moves-0", "schedkit_router_migrate")] == 1
    assert why in caplog.text


def test_a_request_named_twice_moves_once():
    r = make_router(extra=[Moves(Migration("a", 1), Migration("a", 2))])
    route(r, "a")
    assert [(q.request_id, t) for q, _, t, _ in r.plan_migrations()] == [("a", 1)]
    assert sum(r.errors.values()) == 1


def test_prefill_replicas_take_no_moved_request_and_prefilling_ones_are_not_offered():
    plugin = Moves(Migration("x", 0))
    r = make_router(3, roles={"prefill": 1, "decode": 2}, extra=[plugin],
                    plugins=[{"name": "selective-pd", "settings": {"threshold": 0}}])
    p = r.place(r.make_request("x", list(range(40))))
    assert p.prefill is not None and p.prefill.index == 0
    assert r.plan_migrations() == [] and plugin.seen[p.replica.index] == []  # still prefilling
    r.prefill_done("x")
    assert r.plan_migrations() == [] and plugin.seen[p.replica.index] == ["x"]
    assert r.errors[("Moves-0", "schedkit_router_migrate")] == 2  # not offered, then a prefill replica
    plugin.moves = [Migration("x", 3 - p.replica.index)]  # the other decode replica
    assert [(q.request_id, t) for q, _, t, _ in r.plan_migrations()] == [("x", 3 - p.replica.index)]


def test_a_draining_replica_takes_no_new_request():
    r = make_router(3)
    r.drain(1)
    assert [route(r, f"q{i}") for i in range(4)] == [0, 2, 0, 2]


def test_rebalance_moves_the_shortest_prompt_from_the_fullest_to_the_emptiest():
    r = make_router(3, plugins=[{"name": "rebalance", "settings": {"min_gap": 0.3, "max_moves": 2}}])
    for i, n in enumerate([50, 10, 30, 5]):
        r.route(r.make_request(f"q{i}", list(range(1, n + 1))))  # round-robin: 0, 1, 2, 0
    for x, usage in zip(r.replicas, [0.9, 0.5, 0.4], strict=True):
        x.kv_cache_usage = usage
    plans = r.plan_migrations()
    assert [(q.request_id, s, t) for q, s, t, _ in plans] == [("q3", 0, 2), ("q0", 0, 2)]
    assert "KV usage 0.90 vs 0.40" in plans[0][3]
    r.replicas[0].kv_cache_usage = 0.6
    assert r.plan_migrations() == []  # within min_gap


def test_drain_spreads_a_draining_replicas_requests_over_the_least_loaded():
    r = make_router(3, plugins=[{"name": "drain"}])
    for i in range(6):
        route(r, f"q{i}")
    assert r.plan_migrations() == []
    r.drain(0)
    plans = r.plan_migrations()
    assert [(q.request_id, s, t) for q, s, t, _ in plans] == [("q0", 0, 1), ("q3", 0, 2)]
    assert all(why == "drain replica-0" for *_, why in plans)


@pytest.mark.parametrize("settings,match", [
    ({"min_gap": -1}, "min_gap must be >= 0"), ({"max_moves": 0}, "max_moves must be >= 1"),
])
def test_bad_rebalance_settings_name_the_setting(settings, match):
    from schedkit import PluginError

    with pytest.raises(PluginError, match=match):
        make_router(plugins=[{"name": "rebalance", "settings": settings}])


class UrgentToQuietest:
    """Move urgent requests (priority < 0) off a replica with more than ``busy``
    outstanding to the least loaded replica that decodes."""

    def __init__(self, busy: int) -> None:
        self.busy = busy

    @hookimpl
    def schedkit_router_migrate(self, replicas, requests):
        open_ = [r for r in replicas if r.healthy and not r.draining and r.role.can_decode]
        quietest = min(open_, key=lambda r: r.num_outstanding)
        return [Migration(q.request_id, quietest.index, "urgent")
                for r in open_ if r is not quietest and r.num_outstanding > self.busy
                for q in requests[r.index] if q.priority < 0]


def test_a_plugin_moves_urgent_requests_to_the_quietest_replica():
    r = make_router(3, extra=[UrgentToQuietest(busy=1)])
    for i in range(5):  # round-robin: 0 1 2 0 1
        r.route(r.make_request(f"q{i}", [1, 2, 3], priority=-1 if i == 3 else 0))
    [(req, source, target, reason)] = r.plan_migrations()
    assert (req.request_id, source, target, reason) == ("q3", 0, 2, "urgent")
