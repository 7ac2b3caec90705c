"""The front door's cost per request: flow control off vs on, and one routing decision.

    pytest benchmarks/test_flow_control.py --benchmark-only

Method: each round sends 1,300 requests through a :class:`FlowController` with the
built-in plugins (``queue-depth`` as the detector, ``tenant-round-robin`` or
``tenant-weighted`` for fairness) in front of one replica state, from four tenants, one
of which sends ten of every thirteen. extra_info holds ``us_per_request``: the median
round's time over its 1,300 requests.

- not saturated: one coroutine on an event loop awaits ``enter`` for each request in
  turn (it goes on at once) and leaves: the controller's own work, the detector's call
  included. ``off`` is the same loop without a controller.
- saturated (``max_num_seqs`` 4, ``max_waiting`` 0): every request is a task on one
  event loop that enters, yields once and leaves; four go on, the others wait at the
  door and each leave lets the next one go (the fairness plugin picks it). ``off`` is
  the same tasks without the door, so the difference is what holding costs: the
  waiting future, its timeout, one dispatch and one pick per request.
- routing: ``Router.make_request`` + ``route`` + ``finished`` for a 256-token prompt
  over four replicas with the default router (prefix-cache hashes included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from schedkit.cluster.flow import FlowController
from schedkit.cluster.router import Router
from schedkit.config import config_from_dict
from schedkit.core.routing import ReplicaState

NUM_REQUESTS = 1300
TENANTS = ["heavy"] * 10 + ["a", "b", "c"]
"""The tenant of request ``i`` is ``TENANTS[i % 13]``: heavy sends ten times each other's share."""
FAIRNESS = ["tenant-round-robin", "tenant-weighted"]


def controller(fairness: str, max_num_seqs: int = 64) -> FlowController:
    cfg = config_from_dict({
        "scheduler": {"max_num_seqs": max_num_seqs},
        "flow_control": {"enabled": True, "fairness": fairness,
                         "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}})
    return FlowController(cfg, [ReplicaState(0)])


def requests() -> Iterator[tuple[str, str]]:
    return ((f"r{i}", TENANTS[i % len(TENANTS)]) for i in range(NUM_REQUESTS))


def per_request(benchmark: Any) -> None:
    benchmark.extra_info["us_per_request"] = benchmark.stats["median"] / NUM_REQUESTS * 1e6


@pytest.mark.parametrize("door", ["off", *FAIRNESS])
def test_front_door_not_saturated(benchmark, door):
    loop = asyncio.new_event_loop()

    async def through(ctl: FlowController | None) -> None:
        for rid, tenant in requests():
            if ctl is not None:
                ticket = await ctl.enter(rid, tenant, 0, 300)
                assert ticket.dispatched  # the engines have room: never held
                ctl.leave(ticket)

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        return ((controller(door) if door != "off" else None),), {}

    try:
        benchmark.pedantic(lambda ctl: loop.run_until_complete(through(ctl)), setup=setup, rounds=30,
                           warmup_rounds=2)
    finally:
        loop.close()
    per_request(benchmark)
    benchmark.extra_info.update(door=door, saturated=False)


@pytest.mark.parametrize("door", ["off", *FAIRNESS])
def test_front_door_saturated(benchmark, door):
    loop = asyncio.new_event_loop()
    held: list[int] = []

    async def through(ctl: FlowController | None) -> None:
        async def one(rid: str, tenant: str) -> None:
            ticket = await ctl.enter(rid, tenant, 0, 300) if ctl is not None else None
            await asyncio.sleep(0)  # at the engines
            if ticket is not None:
                ctl.leave(ticket)  # type: ignore[union-attr]

        await asyncio.gather(*(one(rid, tenant) for rid, tenant in requests()))
        if ctl is not None:
            held.append(ctl.num_held)

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        return ((controller(door, max_num_seqs=4) if door != "off" else None),), {}

    try:
        benchmark.pedantic(lambda ctl: loop.run_until_complete(through(ctl)), setup=setup, rounds=20,
                           warmup_rounds=2)
    finally:
        loop.close()
    per_request(benchmark)
    benchmark.extra_info.update(door=door, saturated=True)
    if door != "off":
        assert min(held) >= NUM_REQUESTS - 4  # all but the first four waited at the door


def test_routing_decision(benchmark):
    cfg = config_from_dict({"replicas": {"count": 4}, "cache": {"enable_prefix_caching": True}})
    router = Router(cfg)
    prompts = [[(i * 7 + j) % 30000 + 3 for j in range(256)] for i in range(NUM_REQUESTS)]

    def run() -> None:
        for i, prompt in enumerate(prompts):
            req = router.make_request(f"r{i}", prompt, tenant=TENANTS[i % len(TENANTS)], max_tokens=64)
            router.route(req)
            router.finished(req.request_id)

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    per_request(benchmark)
    benchmark.extra_info.update(replicas=4, prompt_tokens=256)
