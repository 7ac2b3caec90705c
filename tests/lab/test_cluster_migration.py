"""Live migration in the cluster simulation: running requests moved between replicas
at the cost model's transfer time, each ending once with all its tokens, its metrics
spanning both replicas, every block free at the end; ``rebalance`` evens out KV use."""

from __future__ import annotations

import random

from schedkit import Migration, hookimpl
from schedkit.config import Config, config_from_dict
from schedkit.lab.cluster_sim import summarize_cluster
from schedkit.lab.workloads import generate
from tests.lab.test_cluster_disagg import BS, profile, replay


class RandomMoves:
    def __init__(self, seed: int = 0, share: float = 0.2) -> None:
        self.rng = random.Random(seed)
        self.share = share

    @hookimpl
    def schedkit_router_migrate(self, replicas, requests):
        open_ = [r.index for r in replicas if r.healthy]
        return [Migration(q.request_id, self.rng.choice([i for i in open_ if i != index]), "random")
                for index, reqs in sorted(requests.items()) for q in reqs if self.rng.random() < self.share]


def config(*, count: int = 3, plugins=(), runner=None, num_blocks: int = 400, n: int = 150, rate: float = 30,
           interval: float = 0.05) -> Config:
    return config_from_dict({
        "runner": runner or {"kind": "fake", "step_time_ms": 10, "vocab_size": 1000},
        "cache": {"block_size": BS, "num_blocks": num_blocks},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 2048},
        "workload": {"kind": "poisson", "rate": rate, "num_requests": n, "prompt_len": [8, 400],
                     "output_len": [4, 200], "seed": 7},
        "replicas": {"count": count},
        "router": {"policy": "round-robin", "migration_interval_s": interval, "plugins": list(plugins)},
    })


def run_with(cfg: Config, *extra):
    from schedkit.lab.cluster_sim import _ClusterRun

    run = _ClusterRun(cfg, generate(cfg.workload, 1000), extra)
    run.result = run.run()  # type: ignore[attr-defined]
    return run


def test_moved_requests_end_once_with_all_their_tokens_and_every_block_is_freed():
    cfg = config()
    still = replay(cfg).result
    run = run_with(cfg, RandomMoves(seed=3))
    result = run.result
    assert len(result.moves) >= 20
    assert sorted(m.request_id for m in result.metrics) == sorted(m.request_id for m in still.metrics)
    assert not result.failed
    want = {m.request_id: m.num_output_tokens for m in still.metrics}
    assert {m.request_id: m.num_output_tokens for m in result.metrics} == want
    for e in run.engines:
        kv = e.scheduler.kv_cache_manager
        assert kv.usage == 0.0 and kv.num_tracked_requests == 0
    assert all(c.num_held_blocks == 0 for c in run.handoffs.connectors)
    assert not run.handoffs.in_flight
    assert all(r["num_outstanding"] == 0 for r in result.router_stats["replicas"])
    assert result.router_stats["num_migrated"] == len(result.moves)
    moved = {h.request_id for h in result.moves}
    for m in result.metrics:  # times span the replicas: arrival and first token from the first one
        assert m.ttft is not None and m.ttft >= 0 and m.e2e >= m.ttft
        if m.request_id in moved:
            assert result.replica_of[m.request_id] == [h for h in result.moves if h.request_id == m.request_id][-1].decode
    summary = summarize_cluster(cfg, result)
    assert summary["migration"]["num_migrated"] == len(result.moves)
    assert summary["migration"]["num_blocks_transferred"] > 0


def test_the_run_is_deterministic_and_moves_cost_the_profiles_transfer_time(tmp_path):
    slow = profile(tmp_path, "slow", latency_s=0.05, per_block_s=0.01)
    free = profile(tmp_path, "free", latency_s=0.0, per_block_s=0.0)
    runs = {name: run_with(config(runner=runner, n=80), RandomMoves(seed=4)).result
            for name, runner in (("slow", slow), ("slow-again", slow), ("free", free))}
    a, b = summarize_cluster(config(runner=slow, n=80), runs["slow"]), summarize_cluster(
        config(runner=slow, n=80), runs["slow-again"])
    assert a == b
    assert all(h.seconds == 0.05 + 0.01 * h.num_blocks for h in runs["slow"].moves)
    assert all(h.seconds == 0.0 for h in runs["free"].moves)
    e2e = {k: sum(m.e2e for m in r.metrics) / len(r.metrics) for k, r in runs.items()}
    assert e2e["slow"] > e2e["free"]


def test_rebalance_moves_requests_off_the_fullest_replica():
    # least-outstanding has no view of lengths: some replicas fill their KV with long
    # requests while others idle; rebalance moves requests to the emptiest
    cfg = config(count=4, num_blocks=120, n=200, rate=60,
                 plugins=[{"name": "rebalance", "settings": {"min_gap": 0.3, "max_moves": 2}}])
    run = run_with(cfg)
    result = run.result
    assert result.moves
    assert not result.failed and len(result.metrics) == 200
    summary = summarize_cluster(cfg, result)
    assert summary["migration"]["num_migrated"] == len(result.moves)
