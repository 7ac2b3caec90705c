"""``LLM.generate(arrival_offsets=...)`` with replicas: each request is routed when it
arrives, with the replicas' load at that moment, not all of them when the call starts."""

from __future__ import annotations

from schedkit.core.request import SamplingParams
from schedkit.llm import LLM
from tests.cluster.replica_runs import fake_config


def test_requests_are_routed_at_their_arrival():
    cfg = fake_config("local").model_copy(update={
        "router": fake_config("local").router.model_copy(update={"policy": "least-outstanding"})})
    with LLM(cfg) as llm:
        # "long" runs 200 steps (about 1 s) on the replica it lands on; the short ones
        # arrive 0.2 s apart and each finishes in a few steps, so when each arrives the
        # least loaded replica is the other one, every time. Routed at once instead,
        # they would alternate (long, short-0 | short-1, short-2 on the long's replica).
        prompts = [[1, 2, 3, i] for i in range(4)]
        params = [SamplingParams(max_tokens=200)] + [SamplingParams(max_tokens=2)] * 3
        outs = llm.generate(prompts, params, arrival_offsets=[0.0, 0.2, 0.4, 0.6], use_tqdm=False)
        assert [len(o.output_token_ids) for o in outs] == [200, 2, 2, 2]
        routed = sorted(r["num_routed"] for r in llm.call_utility("stats")["router"]["replicas"])
    assert routed == [1, 3]
