"""The front door's flow controller on its own: held while saturated, dispatched by band
then by the fairness plugin, refused past the timeout or the queue limit, and a flow
plugin that raises or answers nonsense never fails a request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schedkit import hookimpl
from schedkit.cluster.flow import FlowController
from schedkit.config import config_from_dict
from schedkit.core.routing import ReplicaState
from schedkit.errors import ConfigError, EngineBusyError, PluginError


class Gate:
    """A detector switched by the test: saturated while ``closed``."""

    def __init__(self) -> None:
        self.closed = True

    @hookimpl
    def schedkit_flow_saturated(self) -> bool:
        return self.closed


class VipFirst:
    """Tenant "vip" first whenever it holds a request; others: no opinion."""

    @hookimpl
    def schedkit_flow_pick_tenant(self, band, queues, now):
        return "vip" if any(q.tenant == "vip" for q in queues) else None


class MaxInFlight:
    """Saturated while ``limit`` requests are out at the engines, whatever they report."""

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit

    @hookimpl
    def schedkit_flow_saturated(self, replicas, num_outstanding, num_queued, max_num_seqs):
        return num_outstanding >= self.limit


def controller(gate: Gate | None = None, **flow: Any) -> FlowController:
    cfg = config_from_dict({"flow_control": {"enabled": True, **flow}})
    return FlowController(cfg, [ReplicaState(0)], extra_plugins=[gate] if gate else [])


async def held(ctl: FlowController, requests: list[tuple[str, str, int]]) -> tuple[list[str], list[asyncio.Task]]:
    """Enter each ``(id, tenant, band)`` in turn; returns the dispatch order list (filled as
    they go on) and their tasks."""
    order: list[str] = []

    async def one(rid: str, tenant: str, band: int) -> None:
        await ctl.enter(rid, tenant, band, 10)
        order.append(rid)

    tasks = []
    for r in requests:
        tasks.append(asyncio.create_task(one(*r)))
        await asyncio.sleep(0)
    return order, tasks


def test_requests_go_on_at_once_while_the_engines_have_room():
    async def run() -> FlowController:
        gate = Gate()
        gate.closed = False
        ctl = controller(gate)
        for i in range(5):
            await ctl.enter(f"r{i}", "a", 0, 10)
        return ctl

    ctl = asyncio.run(run())
    assert ctl.num_dispatched == 5 and ctl.num_held == 0 and ctl.num_outstanding == 5


def test_held_requests_go_by_band_then_round_robin_between_tenants():
    async def run() -> list[str]:
        gate = Gate()
        ctl = controller(gate)
        order, tasks = await held(ctl, [("a1", "a", 1), ("a2", "a", 1), ("a3", "a", 1), ("b1", "b", 1),
                                        ("urgent", "c", 0), ("b2", "b", 1)])
        assert ctl.num_queued == 6 and order == []
        gate.closed = False
        ctl.pump()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["urgent", "a1", "b1", "a2", "b2", "a3"]


def test_weighted_fairness_serves_tenants_by_weight_and_banks_no_credit():
    async def run() -> list[str]:
        gate = Gate()
        ctl = controller(gate, fairness="tenant-weighted",
                         plugins=[{"name": "tenant-weighted", "settings": {"weights": {"a": 3}}}])
        order, tasks = await held(ctl, [(f"a{i}", "a", 0) for i in range(8)] + [(f"b{i}", "b", 0) for i in range(4)])
        gate.closed = False
        ctl.pump()
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(run())
    assert sum(r.startswith("a") for r in order[:8]) == 6  # 3:1 while both hold requests


def test_a_request_held_past_the_timeout_is_refused_and_leaves_the_queue():
    async def run() -> FlowController:
        ctl = controller(Gate(), queue_timeout_s=0.05)
        with pytest.raises(EngineBusyError, match=r"held 0.05 s at the front door \(flow_control.queue_timeout_s\)"):
            await ctl.enter("r0", "a", 0, 10)
        return ctl

    ctl = asyncio.run(run())
    assert ctl.num_queued == 0 and ctl.num_refused == {"timeout": 1} and ctl.num_outstanding == 0


def test_past_max_queued_a_request_is_refused_at_once():
    async def run() -> FlowController:
        ctl = controller(Gate(), max_queued=2)
        _, tasks = await held(ctl, [("r0", "a", 0), ("r1", "b", 0)])
        with pytest.raises(EngineBusyError, match=r"holds 2 requests \(flow_control.max_queued\)"):
            await ctl.enter("r2", "b", 0, 10)  # nobody holds two more than b
        with pytest.raises(EngineBusyError, match=r"holds 2 requests"):
            await ctl.enter("r3", "a", 1, 10)  # a less urgent band displaces nobody
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return ctl

    ctl = asyncio.run(run())
    assert ctl.num_refused == {"full": 2} and ctl.num_queued == 0  # the cancelled ones left


def test_a_full_front_door_refuses_the_tenant_holding_the_most():
    """While ``max_queued`` are held, a newcomer of a tenant holding fewer displaces the
    newest request of the tenant holding the most (that one is refused, the newcomer
    waits); a request of a less urgent band is displaced by a more urgent one."""
    async def run() -> tuple[FlowController, list[str], list[Any]]:
        gate = Gate()
        ctl = controller(gate, max_queued=4)
        order, tasks = await held(ctl, [("f0", "flood", 1), ("f1", "flood", 1), ("f2", "flood", 0),
                                        ("f3", "flood", 0)])
        more, more_tasks = await held(ctl, [("a0", "a", 0), ("b0", "b", 0), ("c0", "c", 0)])
        with pytest.raises(EngineBusyError, match="holds 4 requests"):
            await ctl.enter("d0", "d", 0, 10)  # each tenant holds one: none holds two more than d
        gate.closed = False
        ctl.pump()
        results = await asyncio.gather(*tasks, *more_tasks, return_exceptions=True)
        return ctl, order + more, results

    ctl, order, results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, EngineBusyError)]
    # a0 displaced f1 (band 1, newest), b0 displaced f0 (band 1), c0 displaced f3 (flood
    # held 2 in band 0 against c's 0).
    assert sorted(e.request_id for e in refused) == ["f0", "f1", "f3"]
    assert all("displaced" in str(e) and "flow_control.max_queued" in str(e) for e in refused)
    assert sorted(order) == ["a0", "b0", "c0", "f2"]
    assert ctl.num_refused == {"full": 4} and ctl.num_queued == 0


class Broken:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @hookimpl
    def schedkit_flow_pick_tenant(self) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    @hookimpl
    def schedkit_flow_saturated(self) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer if isinstance(self.answer, bool) else "yes"


@pytest.mark.parametrize("answer", [RuntimeError("boom"), "nobody", 3])
def test_a_broken_flow_plugin_is_counted_and_the_built_ins_decide(answer):
    async def run() -> tuple[FlowController, list[str]]:
        gate = Gate()
        cfg = config_from_dict({"flow_control": {"enabled": True}})
        ctl = FlowController(cfg, [ReplicaState(0)], extra_plugins=[gate, Broken(answer)])
        order, tasks = await held(ctl, [("a1", "a", 0), ("b1", "b", 0), ("a2", "a", 0)])
        gate.closed = False
        ctl.pump()
        await asyncio.gather(*tasks)
        return ctl, order

    ctl, order = asyncio.run(run())
    assert order == ["a1", "b1", "a2"]  # the built-in round-robin (Gate decided saturation)
    assert ctl.errors[("Broken-1", "schedkit_flow_pick_tenant")] >= 1
    assert ctl.errors[("Broken-1", "schedkit_flow_saturated")] >= 1


def test_queue_depth_holds_a_burst_at_the_door():
    """No report yet: 2 seqs + 1 waiting per live replica, two replicas: 6 go on."""
    async def run() -> FlowController:
        cfg = config_from_dict({"scheduler": {"max_num_seqs": 2},
                                "flow_control": {"enabled": True, "plugins": [
                                    {"name": "queue-depth", "settings": {"max_waiting": 1}}]}})
        ctl = FlowController(cfg, [ReplicaState(0), ReplicaState(1), ReplicaState(2, healthy=False)])
        _, tasks = await held(ctl, [(f"r{i}", "a", 0) for i in range(10)])
        assert ctl.num_outstanding == 6 and ctl.num_queued == 4
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return ctl

    asyncio.run(run())


@pytest.mark.parametrize(("flow", "error", "words"), [
    ({"fairness": "nope"}, ConfigError, "flow plugin 'nope' is not installed"),
    ({"plugins": [{"name": "queue-depth", "settings": {"max_waiting": -1}}]}, PluginError, "max_waiting"),
    ({"plugins": [{"name": "tenant-weighted", "settings": {"weights": {"a": 0}}}]}, PluginError, "weights"),
    ({"fairness": "sjf"}, PluginError, "implements no flow-control hook"),
])
def test_bad_flow_plugins_fail_at_start_naming_them(flow, error, words):
    with pytest.raises(error, match=words):
        controller(**flow)


# ------------------------------------------------------------------ one test per hook
def test_hook_schedkit_flow_pick_tenant():
    async def run() -> list[str]:
        gate = Gate()
        cfg = config_from_dict({"flow_control": {"enabled": True}})
        ctl = FlowController(cfg, [ReplicaState(0)], extra_plugins=[gate, VipFirst()])
        order, tasks = await held(ctl, [("a1", "a", 0), ("v1", "vip", 0), ("a2", "a", 0), ("v2", "vip", 0),
                                        ("b1", "b", 0)])
        gate.closed = False
        ctl.pump()
        await asyncio.gather(*tasks)
        return order

    # vip's requests first, then the built-in round-robin between a and b
    assert asyncio.run(run()) == ["v1", "v2", "a1", "b1", "a2"]


def test_hook_schedkit_flow_saturated():
    async def run() -> tuple[FlowController, list[str]]:
        cfg = config_from_dict({"flow_control": {"enabled": True}})
        ctl = FlowController(cfg, [ReplicaState(0)], extra_plugins=[MaxInFlight(limit=2)])
        tickets = [await ctl.enter(f"r{i}", "a", 0, 10) for i in range(2)]
        order, tasks = await held(ctl, [("r2", "a", 0), ("r3", "a", 0)])
        assert ctl.num_queued == 2 and order == []
        ctl.leave(tickets[0])  # one finished: one held request goes on
        assert ctl.num_queued == 1
        while not order:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert order == ["r2"]
        ctl.leave(tickets[1])
        await asyncio.gather(*tasks)
        return ctl, order

    ctl, order = asyncio.run(run())
    assert order == ["r2", "r3"] and ctl.num_outstanding == 2 and ctl.num_held == 2


def test_the_fault_plugins_implement_every_flow_hook():
    from schedkit.hookspecs import FLOW_HOOK_NAMES

    assert all(hasattr(Broken, h) for h in FLOW_HOOK_NAMES)


@pytest.mark.parametrize("fairness", ["tenant-round-robin", "tenant-weighted"])
def test_ten_thousand_distinct_tenants_take_bounded_memory(fairness, monkeypatch):
    """Every request from a new tenant: the front door holds at most ``max_queued`` of
    them, refuses the rest, and what it remembers per tenant (service, the weighted
    policy's counters) stays bounded."""
    from schedkit.cluster import flow as flow_mod
    from schedkit.policies import flow as policy_mod

    monkeypatch.setattr(flow_mod, "MAX_TRACKED_TENANTS", 64)
    monkeypatch.setattr(policy_mod, "MAX_COUNTERS", 64)
    limit = MaxInFlight(limit=8)

    async def run() -> FlowController:
        cfg = config_from_dict({"flow_control": {"enabled": True, "fairness": fairness, "max_queued": 200}})
        ctl = FlowController(cfg, [ReplicaState(0)], extra_plugins=[limit])
        tickets: list[Any] = []
        refused = 0
        for i in range(10_000):
            try:
                tickets.append(ctl.submit(f"r{i}", f"tenant-{i}", 0, 10))
            except EngineBusyError:
                refused += 1
            if i % 3 == 2:  # a request finishes now and then: held ones go on
                out = [t for t in tickets if t.dispatched]
                if out:
                    ctl.leave(out[0])
                    tickets.remove(out[0])
        while ctl.num_outstanding:  # the rest finish: every held one goes on in turn
            tickets = [t for t in tickets if t.error is None]  # not displaced
            done = next(t for t in tickets if t.dispatched)
            ctl.leave(done)
            tickets.remove(done)
        assert refused > 0 and ctl.num_refused["full"] == refused
        return ctl

    ctl = asyncio.run(run())
    assert ctl.num_queued == 0 and ctl.num_outstanding == 0
    assert len(ctl._service) <= 64
    weighted = [p for p in ctl.plugin_manager.get_plugins() if isinstance(p, policy_mod.TenantWeighted)]
    assert len(weighted) == (fairness == "tenant-weighted")
    assert all(len(p._virtual) <= 64 for p in weighted)
    assert ctl.num_dispatched + ctl.num_refused["full"] == 10_000


@pytest.mark.parametrize("fairness", ["tenant-round-robin", "tenant-weighted"])
def test_ten_thousand_distinct_priorities_take_bounded_memory(fairness, monkeypatch):
    from schedkit.policies import flow as policy_mod

    monkeypatch.setattr(policy_mod, "MAX_COUNTERS", 64)

    async def run() -> FlowController:
        gate = Gate()
        ctl = controller(gate, fairness=fairness, max_queued=20_000)
        for i in range(10_000):
            ctl.submit(f"r{i}", "a" if i % 2 else "b", -i, 10)
        gate.closed = False
        ctl.pump()
        return ctl

    ctl = asyncio.run(run())
    assert ctl.num_dispatched == 10_000 and ctl.num_queued == 0
    remembered = [len(p._last) for p in ctl.plugin_manager.get_plugins() if isinstance(p, policy_mod.TenantRoundRobin)]
    remembered += [len(p._backlogged) for p in ctl.plugin_manager.get_plugins()
                   if isinstance(p, policy_mod.TenantWeighted)]
    assert remembered and max(remembered) == 64
