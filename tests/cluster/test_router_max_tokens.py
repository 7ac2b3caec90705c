"""Router hooks see the output length a request asks for (``RouteRequest.max_tokens``),
so a size-aware router can keep long jobs apart from short ones."""

from __future__ import annotations

from schedkit import hookimpl
from schedkit.cluster.router import Router
from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.engine.messages import WireRequest, sampling_to_wire, wire_max_tokens
from schedkit.lab.cluster_sim import run_cluster_workload
from schedkit.lab.workloads import generate

LONG = 64
"""Requests asking for more output tokens than this are long jobs."""


class LongJobsApart:
    """Long jobs on replica 0, short ones on the others (the scores then decide)."""

    def __init__(self) -> None:
        self.seen: dict[str, int | None] = {}

    @hookimpl
    def schedkit_router_filter(self, request, replicas):
        self.seen[request.request_id] = request.max_tokens
        if request.max_tokens is None:
            return None
        keep = [r for r in replicas if (r.index == 0) == (request.max_tokens > LONG)]
        return keep or None


def test_a_router_plugin_routes_on_max_tokens():
    plugin = LongJobsApart()
    router = Router(config_from_dict({"replicas": {"count": 3}, "router": {"policy": "round-robin"}}),
                    extra_plugins=[plugin])
    picks = {n: router.route(router.make_request(f"r{n}", [7] * 10, max_tokens=n)).index
             for n in (8, 500, 16, 1000, 32)}
    assert picks[500] == picks[1000] == 0 and {picks[8], picks[16], picks[32]} <= {1, 2}
    assert plugin.seen == {f"r{n}": n for n in picks}
    assert router.make_request("x", [1]).max_tokens is None  # unknown unless given


def test_the_cluster_simulation_routes_every_request_with_its_max_tokens():
    config = config_from_dict({
        "runner": {"kind": "fake", "step_time_ms": 10},
        "cache": {"block_size": 16, "num_blocks": 400},
        "scheduler": {"max_num_batched_tokens": 1024, "max_num_seqs": 16, "max_model_len": 2048},
        "workload": {"kind": "poisson", "rate": 40, "num_requests": 60, "prompt_len": [16, 64],
                     "output_len": [4, 200], "seed": 5},
        "replicas": {"count": 3}, "router": {"policy": "least-outstanding"},
    })
    workload = generate(config.workload, config.runner.vocab_size)
    plugin = LongJobsApart()
    run = run_cluster_workload(config, workload, router_extra_plugins=[plugin])
    assert plugin.seen == {w.request_id: w.max_tokens for w in workload}
    for w in workload:
        assert (run.replica_of[w.request_id] == 0) == (w.max_tokens > LONG), w
    assert all(m.served for m in run.metrics)


def test_the_front_end_reads_max_tokens_from_the_wire():
    def wire(**sampling) -> WireRequest:
        return WireRequest("r", [1, 2], sampling)

    assert wire_max_tokens(wire(**sampling_to_wire(SamplingParams(max_tokens=300)))) == 300
    assert wire_max_tokens(wire()) == SamplingParams().max_tokens  # the default is not sent
    assert wire_max_tokens(wire(max_tokens="many")) is None  # the engine refuses it
