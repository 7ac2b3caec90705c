"""The cluster simulation: N replicas behind the router on one shared virtual clock."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from schedkit.cluster.router import Router
from schedkit.config import Config, config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.core.routing import RouteEventKind
from schedkit.engine.core import EngineCore
from schedkit.errors import ConfigError
from schedkit.hookspecs import hookimpl
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import WorkloadRequest, generate, repeat_workload, token_run

AZURE = {"format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv"}
MOONCAKE = {"format": "mooncake", "path": "data/mooncake/conversation_trace.jsonl"}


def trace_config(trace: dict, *, n: int, time_scale: float, count: int = 1, policy: str = "round-robin",
                 runner: str = "simulated", num_blocks: int = 1500, **scheduler) -> Config:
    return config_from_dict({
        "runner": {"kind": runner},
        "cache": {"block_size": 16, "num_blocks": num_blocks},
        "scheduler": {"max_num_batched_tokens": 1024, "max_num_seqs": 24, "max_model_len": 16384,
                      **scheduler},
        "workload": {"kind": "trace", "num_requests": n, "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
                     "tenants": [{"name": "a"}, {"name": "b"}],
                     "trace": {**trace, "time_scale": time_scale, "max_prompt_len": 6000}},
        "replicas": {"count": count}, "router": {"policy": policy},
    })


def shared_prefix_config(policy: str, *, count: int = 4, n: int = 200) -> Config:
    """Eight 512-token system prompts, every request starts with one; each replica's cache
    holds only a few of them."""
    return config_from_dict({
        "runner": {"kind": "fake", "step_time_ms": 10},
        "cache": {"block_size": 16, "num_blocks": 200},
        "scheduler": {"max_num_batched_tokens": 1024, "max_num_seqs": 16, "max_model_len": 2048},
        "workload": {"kind": "poisson", "rate": 40, "num_requests": n, "prompt_len": [16, 64],
                     "output_len": [4, 16], "seed": 3,
                     "shared_prefix": {"count": 8, "length": 512, "fraction": 1.0}},
        "replicas": {"count": count}, "router": {"policy": policy},
    })


def with_count(config: Config, count: int, policy: str | None = None) -> Config:
    update: dict = {"replicas": config.replicas.model_copy(update={"count": count})}
    if policy is not None:
        update["router"] = config.router.model_copy(update={"policy": policy})
    return config.model_copy(update=update)


# -- one replica is run_workload ---------------------------------------------------------------

@pytest.mark.parametrize("trace,time_scale,extra", [
    (AZURE, 0.02, {}),                                  # overloaded: queues, preemptions
    (AZURE, 0.02, {"async_scheduling": True}),          # two steps in flight
    (MOONCAKE, 0.05, {}),                               # shared prefixes, long prompts
])
def test_one_replica_equals_run_workload(trace, time_scale, extra):
    config = trace_config(trace, n=50 if trace is MOONCAKE else 150, time_scale=time_scale, **extra)
    workload = generate(config.workload, config.runner.vocab_size)
    # A request no replica can take (refused at arrival), and one arriving in an idle gap.
    last = workload[-1].arrival_time
    workload.insert(40, WorkloadRequest("too-long", workload[40].arrival_time, list(range(3, 17000)), 8))
    workload.append(WorkloadRequest("late", last + 30.0, token_run(7, 300, 32000), 20))
    single = run_workload(config, workload)
    cluster = run_cluster_workload(config, workload)
    assert cluster.metrics == single.metrics
    assert cluster.failed == single.failed and "too-long" in cluster.failed
    assert cluster.num_steps == single.num_steps
    assert set(cluster.replica_of.values()) == {0}
    s = summarize(single.metrics)
    assert s["preemptions"] > 0 or trace is MOONCAKE
    assert summarize_cluster(config, cluster)["overall"] == summarize(
        single.metrics, config.workload.slo, fairness=config.workload.fairness,
        shares=config.workload.tenant_shares)


# -- the cluster -------------------------------------------------------------------------------

def test_deterministic():
    config = trace_config(MOONCAKE, n=80, time_scale=0.02, count=4, policy="weighted", num_blocks=3000)
    workload = generate(config.workload, config.runner.vocab_size)
    a = run_cluster_workload(config, workload)
    b = run_cluster_workload(config, workload)
    assert a.metrics == b.metrics and a.replica_of == b.replica_of
    sa, sb = summarize_cluster(config, a), summarize_cluster(config, b)
    assert json.dumps(sa, sort_keys=True) == json.dumps(sb, sort_keys=True)


@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "prefix-affinity", "weighted"])
def test_every_request_ends_once_on_one_replica(policy):
    config = trace_config(AZURE, n=200, time_scale=0.005, count=3, policy=policy)
    workload = generate(config.workload, config.runner.vocab_size)
    run = run_cluster_workload(config, workload)
    ids = [w.request_id for w in workload]
    assert sorted(m.request_id for m in run.metrics) == sorted(ids)  # each exactly once
    assert all(m.served for m in run.metrics)
    assert set(run.replica_of) == set(ids)
    assert set(run.replica_of.values()) <= {0, 1, 2}
    per = Counter(run.replica_of.values())
    stats = run.router_stats
    assert [r["num_routed"] for r in stats["replicas"]] == [per[i] for i in range(3)]
    assert all(r["num_outstanding"] == 0 for r in stats["replicas"])  # router.finished for all
    summary = summarize_cluster(config, run)
    json.dumps(summary)
    assert sum(r["requests"] for r in summary["replicas"]) == len(ids)
    assert sum(r["output_tokens"] for r in summary["replicas"]) == summary["overall"]["output_tokens"]
    assert summary["load_imbalance"]["requests"] >= 1.0
    assert sum(run.replica_steps) == run.num_steps


def test_round_robin_spreads_requests_evenly():
    config = trace_config(AZURE, n=203, time_scale=0.005, count=4)
    run = run_cluster_workload(config)
    counts = Counter(run.replica_of.values())
    assert max(counts.values()) - min(counts.values()) <= 1 and len(counts) == 4
    assert summarize_cluster(config, run)["load_imbalance"]["requests"] == pytest.approx(51 / 50.75)


def test_prefix_affinity_beats_round_robin_on_shared_prefixes():
    rr_config, pa_config = shared_prefix_config("round-robin"), shared_prefix_config("prefix-affinity")
    workload = generate(rr_config.workload, rr_config.runner.vocab_size)
    rr = summarize_cluster(rr_config, run_cluster_workload(rr_config, workload))
    pa = summarize_cluster(pa_config, run_cluster_workload(pa_config, workload))
    # Round-robin sends every prefix everywhere (each cache thrashes); affinity keeps
    # each prefix where it is cached.
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.15
    assert pa["prefix_hit_rate"] > 1.3 * rr["prefix_hit_rate"]
    served = lambda s: sum(r["computed_tokens"] for r in s["replicas"])  # noqa: E731
    assert served(pa) < served(rr)  # fewer prompt tokens computed again
    # The per-replica rates are what the overall one is made of.
    for s in (rr, pa):
        prompt = sum(r["prompt_tokens"] for r in s["replicas"])
        hits = sum(r["prefix_hit_rate"] * r["prompt_tokens"] for r in s["replicas"])
        assert hits / prompt == pytest.approx(s["prefix_hit_rate"])


class RaisingRouter:
    """Raises from every router hook it implements (and answers nonsense once)."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def schedkit_router_filter(self, replicas):
        raise RuntimeError("filter broke")

    @hookimpl
    def schedkit_router_score(self, replicas):
        self.calls += 1
        if self.calls == 3:
            return [float("nan")] * len(replicas)
        raise RuntimeError("score broke")

    @hookimpl(tryfirst=True)
    def schedkit_router_pick(self, replicas, scores):
        raise RuntimeError("pick broke")

    @hookimpl
    def schedkit_on_route_event(self, event):
        raise RuntimeError("observer broke")


def test_a_raising_router_plugin_loses_no_request():
    config = shared_prefix_config("least-outstanding", count=3, n=90)
    workload = generate(config.workload, config.runner.vocab_size)
    run = run_cluster_workload(config, workload, router_extra_plugins=[RaisingRouter()])
    assert sorted(m.request_id for m in run.metrics) == sorted(w.request_id for w in workload)
    assert all(m.served for m in run.metrics) and not run.failed
    assert len(set(run.replica_of.values())) == 3  # the other plugins still decided
    errors = {h: n for _, h, n in run.router_stats["num_hook_errors"]}
    assert errors["schedkit_router_pick"] == 90 and errors["schedkit_router_score"] == 90
    assert summarize_cluster(config, run)["router"]["num_hook_errors"]


def test_request_ids_must_be_unique():
    config = shared_prefix_config("round-robin", n=4)
    workload = generate(config.workload, config.runner.vocab_size)
    with pytest.raises(ValueError, match="req-1"):
        run_cluster_workload(config, [*workload, workload[1]])


def test_needs_a_virtual_clock():
    config = config_from_dict({"runner": {"kind": "fake", "clock": "wall"}, "replicas": {"count": 2},
                               "workload": {"num_requests": 2}})
    with pytest.raises(ConfigError, match="virtual clock"):
        run_cluster_workload(config)


# -- the pieces --------------------------------------------------------------------------------

def test_add_request_at_keeps_the_true_arrival():
    config = config_from_dict({"runner": {"kind": "fake", "step_time_ms": 10}})
    engine = EngineCore(config)

    def req(rid: str) -> Request:
        return Request(rid, [5, 6, 7], SamplingParams(max_tokens=3), arrival_time=0.0)

    engine.add_request_at(early := req("a"), 0.0)
    engine.step()  # the clock is now 0.01
    engine.add_request_at(behind := req("b"), 0.004)  # arrived during that step
    assert behind.arrival_time == 0.004 and "b" in engine.scheduler.requests
    engine.add_request_at(ahead := req("c"), 5.0)  # held until then
    assert ahead.arrival_time == 5.0 and "c" not in engine.scheduler.requests
    assert engine.next_arrival_in() == pytest.approx(4.99)
    while engine.has_requests():
        engine.step()
    assert early.is_finished and behind.is_finished and ahead.is_finished
    assert engine.now() > 5.0


def _formula(key: int, n: int, vocab_size: int) -> list[int]:
    m = vocab_size - 3
    base = (key * 2654435761) % m
    step = 7919 % m or 1
    return [(base + step * i) % m + 3 for i in range(n)]


@pytest.mark.parametrize("vocab_size", [32000, 151936, 7922, 50, 5, 2])
def test_token_run_fast_path_is_the_formula(vocab_size):
    for key in (0, 1, 12345, -7, 2 ** 40 + 3, -(3 << 8) - 1):
        for n in (0, 1, 512, 3 * vocab_size + 7):
            assert token_run(key, n, vocab_size) == _formula(key, n, vocab_size)


def test_repeat_workload_tiles_with_fresh_prefixes():
    config = trace_config(MOONCAKE, n=40, time_scale=0.1)
    base = generate(config.workload, config.runner.vocab_size)
    tiled = repeat_workload(base, 100, vocab_size=config.runner.vocab_size)
    assert len(tiled) == 100 and len({w.request_id for w in tiled}) == 100
    assert tiled[:40] == base
    assert [w.arrival_time for w in tiled] == sorted(w.arrival_time for w in tiled)
    span = base[-1].arrival_time - base[0].arrival_time
    gap = span / 39
    assert tiled[40].arrival_time == pytest.approx(base[0].arrival_time + span + gap)
    assert tiled[80].arrival_time - tiled[40].arrival_time == pytest.approx(span + gap)

    def blocks(w: WorkloadRequest) -> list[tuple[int, ...]]:  # 512-token chained prefixes
        p = w.prompt_token_ids
        return [tuple(p[: k + 512]) for k in range(0, len(p) - 511, 512)]

    for k in (1, 2):
        copy = tiled[40 * k: 40 * k + 40]
        assert [len(w.prompt_token_ids) for w in copy] == [len(w.prompt_token_ids) for w in base[: len(copy)]]
        assert [w.max_tokens for w in copy] == [w.max_tokens for w in base[: len(copy)]]
        # The same sharing within the copy ...
        for i in range(len(copy)):
            for j in range(i):
                same = sum(a == b for a, b in zip(blocks(base[i]), blocks(base[j]), strict=False))
                again = sum(a == b for a, b in zip(blocks(copy[i]), blocks(copy[j]), strict=False))
                assert same == again
        # ... and none with the copies before.
        before = {b for w in tiled[: 40 * k] for b in blocks(w)}
        assert not any(b in before for w in copy for b in blocks(w))
    assert repeat_workload(base, 10) == base[:10]


def test_router_plugins_see_what_the_real_router_gives_them():
    """The simulated router hands plugins the same RouteRequest as the real one: block
    size and the prompt's block hashes as the engines compute them."""
    seen = []

    class Spy:
        @hookimpl
        def schedkit_on_route_event(self, event):
            if event.kind is not RouteEventKind.ROUTED:
                return
            r = event.request
            seen.append((r.block_size, len(r.block_hashes), r.num_prompt_tokens, list(r.block_hashes)))

    config = shared_prefix_config("prefix-affinity", count=2, n=20)
    workload = generate(config.workload, config.runner.vocab_size)
    run_cluster_workload(config, workload, router_extra_plugins=[Spy()])
    real = Router(config)
    assert len(seen) == 20
    for (block_size, n_hashes, n_tokens, hashes), w in zip(seen, workload, strict=True):
        assert block_size == 16 and n_hashes == n_tokens // 16
        assert hashes == real.make_request(w.request_id, w.prompt_token_ids).block_hashes
