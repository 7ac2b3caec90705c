"""Two policy figures on the simulator, printed as one JSON line: preemptive mlfq against
FCFS on heavy-tailed outputs with room in the KV cache, and preemption by swap
(``cpu-offload``) against recompute under KV pressure.

Method: the workloads of ``benchmarks/scenarios.py`` (the ones
``tests/policies/test_preemptive.py`` and ``tests/kv/test_cpu_offload.py`` assert on),
seeds 0-2, on the simulated runner's virtual clock, so the figures are exact and the
machine only sets how long the script takes.

    .venv/bin/python scripts/bench_policies.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ of this checkout

from benchmarks.scenarios import heavy_tailed, kv_pressure, short_mean_e2e
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import run_workload

SEEDS = (0, 1, 2)


def main() -> None:
    fcfs = [run_workload(heavy_tailed("fcfs", s)).metrics for s in SEEDS]
    mlfq = [run_workload(heavy_tailed("mlfq", s)).metrics for s in SEEDS]
    recompute = [summarize(run_workload(kv_pressure(s, [])).metrics) for s in SEEDS]
    swap = [summarize(run_workload(kv_pressure(s, [{"name": "cpu-offload"}])).metrics) for s in SEEDS]
    print(json.dumps({
        "seeds": list(SEEDS),
        "short_mean_e2e_s": {"fcfs": [short_mean_e2e(m) for m in fcfs],
                             "mlfq": [short_mean_e2e(m) for m in mlfq]},
        "recomputed_tokens": {"recompute": [r["recomputed_tokens"] for r in recompute],
                              "swap": [r["recomputed_tokens"] for r in swap]},
        "preemptions": {"recompute": [r["preemptions"] for r in recompute],
                        "swap": [r["preemptions"] for r in swap]},
    }))


if __name__ == "__main__":
    main()
