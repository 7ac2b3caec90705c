"""Helpers shared by the plugin tests: drive a scheduler, check its invariants."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from schedkit.core.outputs import EngineCoreOutput, EngineCoreOutputs
from schedkit.core.request import Request, RequestStatus
from schedkit.core.scheduler import Scheduler
from schedkit.runners.fake import FakeRunner


def step(sched: Scheduler, runner: FakeRunner) -> dict[int, EngineCoreOutputs]:
    """One engine step: schedule, execute, update."""
    out = sched.schedule()
    return sched.update_from_output(out, runner.execute(out))


def finished_in(outputs: dict[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    return [o for group in outputs.values() for o in group.outputs if o.finished]


def serve(sched: Scheduler, runner: FakeRunner, *, max_steps: int = 1000) -> list[EngineCoreOutput]:
    """Step until the scheduler has nothing left; return the finishing outputs in order."""
    done: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not sched.has_requests():
            return done
        done += finished_in(step(sched, runner))
    raise AssertionError(f"not done after {max_steps} steps")


def assert_consistent(sched: Scheduler, requests: Iterable[Request]) -> None:
    """Every request is in exactly one of running / waiting / finished, and the KV pool's
    reference counts match the block tables of the requests."""
    requests = list(requests)
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    finished = [r.request_id for r in requests if r.is_finished]
    every = running + waiting + finished
    assert sorted(every) == sorted(r.request_id for r in requests), (running, waiting, finished)
    assert set(sched.requests) == set(running) | set(waiting)
    for req in requests:
        if req.request_id in running:
            assert req.status is RequestStatus.RUNNING, req
        elif req.request_id in waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req

    kv = sched.kv_cache_manager
    pool = kv.block_pool
    tables = {r.request_id: kv.get_block_ids(r.request_id) for r in requests}
    for req in requests:
        if req.status is not RequestStatus.RUNNING:
            assert tables[req.request_id] == [], (
                f"{req.request_id} holds blocks while {req.status.name}")
    holders = Counter(b for table in tables.values() for b in table)
    assert 0 not in holders, "the null block is in a block table"
    for b in range(1, kv.num_blocks):
        assert pool.ref_cnt(b) == holders[b], (
            f"block {b}: ref_cnt {pool.ref_cnt(b)}, held by {holders[b]} tables")
    num_used = sum(1 for b in range(1, kv.num_blocks) if pool.ref_cnt(b) > 0)
    assert pool.num_free_blocks + num_used == kv.num_blocks - 1
    assert kv.num_tracked_requests == sum(1 for t in tables.values() if t)
