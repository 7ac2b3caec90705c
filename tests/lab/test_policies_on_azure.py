"""Policy properties on a real trace: the Azure 2023 conversation trace, replayed ~17x
faster than recorded on the simulator (configs/compare-azure-conv.yaml)."""

from __future__ import annotations

import pytest

from schedkit.config import load_config
from schedkit.lab.compare import compare

pytestmark = pytest.mark.slow  # 2,000-request trace replays


def test_sjf_lowers_mean_ttft_and_aging_bounds_max_wait():
    config = load_config("configs/compare-azure-conv.yaml")
    profiles = [p for p in config.compare.profiles if p.name in ("fcfs", "sjf", "sjf+aging")]
    config = config.model_copy(update={"compare": config.compare.model_copy(update={"profiles": profiles})})
    s = compare(config).summaries
    assert s["sjf"]["ttft_s"]["mean"] < 0.95 * s["fcfs"]["ttft_s"]["mean"]
    assert s["sjf"]["ttft_s"]["p50"] < s["fcfs"]["ttft_s"]["p50"]
    # plain SJF lets long prompts wait; the wrapper caps the wait near max_wait_s (2 s)
    assert s["sjf"]["max_wait_s"] > 3.0
    assert s["sjf+aging"]["max_wait_s"] < 2.2
