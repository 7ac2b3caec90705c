"""A workload's time 0 is the moment the engine is ready to serve.

On a wall clock, building the runner, initializing it (KV cache, warm-up, CUDA graphs)
and a slow first step take real time; none of it may shift a request's recorded arrival,
or policies compared on the same trace would see different arrivals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from schedkit.config import config_from_dict
from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import WorkloadRequest
from schedkit.runners.fake import FakeRunner

DELAY_S = 0.2


@dataclass
class SlowToStart(FakeRunner):
    """The fake runner on the wall clock, slow to initialize and slow on its first step
    (as a real runner's warm-up and lazily built kernels are)."""

    ready_at: float = 0.0
    num_executed: int = 0

    def initialize(self, num_blocks: int, block_size: int) -> int:
        time.sleep(DELAY_S)
        self.ready_at = time.monotonic()
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens and not self.num_executed:
            time.sleep(DELAY_S)
        self.num_executed += bool(scheduler_output.total_num_scheduled_tokens)
        return super().execute(scheduler_output)


def test_slow_start_does_not_delay_the_first_arrival():
    config = config_from_dict({"runner": {"kind": "fake", "clock": "wall", "step_time_ms": 1.0},
                               "cache": {"num_blocks": 64, "block_size": 16}})
    runner = SlowToStart(vocab_size=1000, step_time_s=0.001, is_virtual_clock=False)
    workload = [WorkloadRequest(f"r{i}", t, [1 + i] * 8, 2) for i, t in enumerate((0.0, 0.05, 0.1))]
    run = run_workload(config, workload, runner=runner)
    assert run.start_time >= runner.ready_at  # time 0 is after the runner got ready
    by_id = {m.request_id: m for m in run.metrics}
    assert [by_id[w.request_id].arrival_time for w in workload] == pytest.approx([0.0, 0.05, 0.1], abs=1e-9)
    # The slow first step is the first request's wait, not a later arrival.
    first = by_id["r0"]
    assert first.first_token_time is not None and first.ttft >= DELAY_S
    assert all(m.served for m in run.metrics)
