"""The speculation benchmark's busiest load serves distinct requests: a copy of an
earlier request would hand suffix decoding's shared tree its whole output."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "speculation_bench.py"
spec = importlib.util.spec_from_file_location("speculation_bench", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("workload", ["code-edit", "chat", "json"])
def test_the_busiest_load_fills_two_rounds_of_slots_with_distinct_prompts(workload):
    prompts = bench.busy_prompts(workload, 32)
    assert len(prompts) == 32
    assert len(set(prompts)) == 32
    # the base prompts (batch 1, all at once) are among them, unchanged
    assert set(bench.workload_prompts(workload)) <= set(bench.busy_prompts(workload, 45))


def test_an_unknown_workload_is_refused():
    with pytest.raises(SystemExit, match="unknown workload 'poems'"):
        bench.busy_prompts("poems", 4)
