"""Scheduler overhead per step: schedule() + update_from_output(), fake outputs.

    pytest benchmarks/test_scheduler_step.py --benchmark-only

Method: the scheduler is brought to a steady decode state (prompt 512, block 16,
prefix caching on); each benchmark round is one full step. The mixed benchmark replays a
2,000-request chunked-prefill trace with shared prefixes and heavy preemption and reports
the scheduler's own time per step in extra_info (``scheduler_ms_per_step``).
"""

from __future__ import annotations

import pytest

from benchmarks.inline_hooks import InlineFCFSHooks
from benchmarks.workloads import decode_state, mixed_trace, replay


def _step(sched, out):
    so = sched.schedule()
    sched.update_from_output(so, out)


@pytest.mark.parametrize("num_reqs", [256, 1024])
@pytest.mark.parametrize("hooks", ["plugins", "inline"])
def test_decode_step(benchmark, num_reqs, hooks):
    sched, out = decode_state(num_reqs, hooks=InlineFCFSHooks() if hooks == "inline" else None)
    benchmark.extra_info.update(num_running=num_reqs, hooks=hooks)
    benchmark.pedantic(_step, args=(sched, out), rounds=300 if num_reqs == 256 else 100,
                       warmup_rounds=5)
    assert len(sched.running) == num_reqs


@pytest.mark.parametrize("hooks", ["plugins", "inline"])
def test_mixed_preemption_trace(benchmark, hooks):
    cfg, reqs = mixed_trace()
    result = {}

    def run():
        result["steps"], result["preemptions"], result["in_sched"] = replay(
            cfg, reqs, hooks=InlineFCFSHooks() if hooks == "inline" else None)

    benchmark.pedantic(run, rounds=3, iterations=1)
    # Whole-replay time includes building requests and outputs; the scheduler's own
    # share (schedule + update_from_output) of the last round is reported separately.
    benchmark.extra_info.update(hooks=hooks, steps=result["steps"],
                                preemptions=result["preemptions"],
                                scheduler_ms_per_step=result["in_sched"] * 1e3 / result["steps"])
    assert result["preemptions"] > 0
