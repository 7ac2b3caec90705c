"""What a cluster simulation produced (:class:`ClusterRunResult`) and its summary
(:func:`summarize_cluster`): per replica, per role, load imbalance, prefix hits, KV
hand-offs of disaggregated requests, the router's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schedkit.cluster.transfer import Handoff
from schedkit.config import Config
from schedkit.lab.metrics import RequestMetrics, percentile, summarize
from schedkit.lab.simulate import RunResult

__all__ = ["ClusterRunResult", "summarize_cluster"]

_INF = float("inf")


@dataclass(slots=True)
class ClusterRunResult(RunResult):
    """A :class:`~schedkit.lab.simulate.RunResult` (``metrics`` of every request, sorted
    by arrival; ``failed``; ``num_steps``, the replicas' total; ``wall_s``) plus where
    each request went and what each replica did."""

    num_replicas: int = 1
    replica_of: dict[str, int] = field(default_factory=dict)
    """request_id -> the replica the router chose (every request the router routed, those
    the engine refused too, not those a router admission plugin refused); for a
    disaggregated request, its decode replica."""
    replica_steps: list[int] = field(default_factory=list)
    """Steps each replica ran."""
    replica_busy_s: list[float] = field(default_factory=list)
    """Engine-clock seconds each replica spent in steps (the sum of its step durations)."""
    engine_prefix_cache: list[dict[str, int]] = field(default_factory=list)
    """Each replica's own prefix-cache counters (``queries``, ``hits``: tokens looked up
    and found at admission, re-admissions after preemption included)."""
    router_stats: dict[str, Any] = field(default_factory=dict)
    """:meth:`Router.stats` at the end of the run."""
    replica_roles: list[str] = field(default_factory=list)
    """Each replica's role (``prefill``, ``decode``, ``both``)."""
    replica_queue_depth: list[float] = field(default_factory=list)
    """Each replica's waiting-queue length after its steps, averaged over its busy time
    (weighted by step duration)."""
    prefill_of: dict[str, int] = field(default_factory=dict)
    """request_id -> its prefill replica, for the disaggregated requests."""
    handoffs: list[Handoff] = field(default_factory=list)
    moves: list[Handoff] = field(default_factory=list)
    """The KV hand-off of every running request moved to another replica, in order."""
    """Every KV hand-off from a prefill replica to a decode replica, in the order the
    prefills ended."""
    replica_max_waiting: list[int] = field(default_factory=list)
    """Each replica's longest waiting queue after a step."""
    flow_stats: dict[str, Any] | None = None
    """The front door's :meth:`~schedkit.cluster.flow.FlowController.stats` at the end of
    the run (None without ``flow_control.enabled``)."""

    def replica_metrics(self, index: int) -> list[RequestMetrics]:
        """The metrics of the requests routed to replica ``index`` (served whole or
        decoded there)."""
        where = self.replica_of
        return [m for m in self.metrics if where.get(m.request_id) == index]


def _imbalance(values: list[float]) -> float:
    """max / mean (1.0 = perfectly even; 0 for no load at all)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def _replica_summary(metrics: list[RequestMetrics], steps: int, busy_s: float,
                     engine_prefix: dict[str, int]) -> dict[str, Any]:
    served = [m for m in metrics if not m.rejected]
    prompt = sum(m.num_prompt_tokens for m in served)
    output = sum(m.num_output_tokens for m in metrics)
    cached = sum(m.num_cached_tokens for m in served)
    computed = (prompt - cached + output + sum(m.num_recomputed_tokens for m in served))
    ttfts = [m.ttft if m.ttft is not None else _INF for m in metrics]
    tpots = [v for m in metrics if (v := m.tpot) is not None]
    return {
        "requests": len(metrics),
        "rejected": len(metrics) - len(served),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "tokens": prompt + output,
        "computed_tokens": computed,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "preemptions": sum(m.num_preemptions for m in metrics),
        "steps": steps,
        "busy_s": busy_s,
        "engine_prefix_cache": dict(engine_prefix),
    }


def _disaggregation_summary(run: ClusterRunResult, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The hand-offs, and per role: its replicas' requests, prefills, busy time and
    queue depth."""
    handoffs = run.handoffs
    seconds = sum(h.seconds for h in handoffs)
    roles: dict[str, dict[str, Any]] = {}
    for i, role in enumerate(run.replica_roles):
        r = replicas[i]
        entry = roles.setdefault(role, {"replicas": 0, "requests": 0, "prefills": 0, "steps": 0,
                                        "busy_s": 0.0, "queue_depth_mean": 0.0})
        entry["replicas"] += 1
        for key in ("requests", "prefills", "steps", "busy_s"):
            entry[key] += r[key]
        entry["queue_depth_mean"] += r["queue_depth_mean"]
    for entry in roles.values():
        entry["busy_s_mean"] = entry["busy_s"] / entry["replicas"]
        entry["queue_depth_mean"] /= entry["replicas"]
    return {
        "num_disaggregated": len(run.prefill_of),
        "num_handoffs": len(handoffs),
        "num_blocks_transferred": sum(h.num_blocks for h in handoffs),
        "num_tokens_transferred": sum(h.num_tokens for h in handoffs),
        "num_blocks_held": sum(h.num_blocks_held for h in handoffs),
        "transfer_s_total": seconds,
        "transfer_s_mean": seconds / len(handoffs) if handoffs else 0.0,
        "roles": roles,
    }


def summarize_cluster(config: Config, run: ClusterRunResult) -> dict[str, Any]:
    """The cluster's summary: JSON-serialisable and deterministic (no wall time in it).

    Keys: ``overall`` (:func:`~schedkit.lab.metrics.summarize` of every request, under
    the workload's SLO, fairness weights and tenant shares), ``replicas`` (one entry each:
    requests, rejected, prompt / output / computed tokens, prefix hit rate, TTFT p50 and
    p99, TPOT p50, preemptions, steps, busy seconds, the engine's own prefix-cache
    counters), ``load_imbalance`` (max over replicas / mean of: ``requests``, ``tokens``
    (prompt + output tokens served), ``computed_tokens`` (tokens the replica computed:
    prompt minus prefix-cache hits, plus outputs and recomputed tokens) and ``busy_s``),
    ``prefix_hit_rate`` (prefix-cache hit tokens / prompt tokens of the requests served,
    from each request's ``num_cached_tokens``; the same as ``overall``'s),
    ``router`` (policy, ``num_rerouted``, ``num_failed_by_death``, ``num_hook_errors``,
    requests routed to each replica, and by SLO class the requests an admission plugin
    refused, ``num_refused``, or routed best effort, ``num_downgraded``) and
    ``num_replicas``, ``num_steps``. A refused request counts in ``overall`` (rejected)
    but in no replica's entry.

    With ``replicas.roles``, besides: each ``replicas`` entry has its ``role``,
    ``prefills`` (disaggregated requests it prefilled) and ``queue_depth_mean``; a
    disaggregated request counts in its decode replica's entry, its ``num_cached_tokens``
    being its prefill replica's prefix-cache hit. ``disaggregation`` has
    ``num_disaggregated``, ``num_handoffs``, ``num_blocks_transferred``,
    ``num_tokens_transferred``, ``num_blocks_held`` (full prompt blocks the decode
    replica held already, not sent), ``transfer_s_total``, ``transfer_s_mean`` and
    ``roles`` (per role: replicas, requests, prefills, steps, busy_s, busy_s_mean,
    queue_depth_mean); ``router`` has ``num_disaggregated``.

    With moves of running requests (``schedkit_router_migrate``), ``migration`` has
    ``num_migrated``, ``num_blocks_transferred``, ``num_blocks_held`` and
    ``transfer_s_total``; a moved request counts in the entry of the replica it ended on.

    With ``flow_control.enabled``, ``flow_control`` has the front door's
    ``num_dispatched``, ``num_held`` (requests that waited there), ``num_refused`` (by
    reason: ``timeout``, ``full``), ``num_hook_errors`` and ``max_engine_waiting`` (the
    longest waiting queue any replica had after a step); a request refused at the front
    door counts in ``overall`` only.
    """
    wl = config.workload
    overall = summarize(run.metrics, wl.slo, fairness=wl.fairness, shares=wl.tenant_shares)
    per: list[list[RequestMetrics]] = [[] for _ in range(run.num_replicas)]
    where = run.replica_of
    for m in run.metrics:
        index = where.get(m.request_id)
        if index is not None:  # None: refused at the front door or by the router's admission
            per[index].append(m)
    replicas = [_replica_summary(ms, run.replica_steps[i], run.replica_busy_s[i],
                                 run.engine_prefix_cache[i]) for i, ms in enumerate(per)]
    has_roles = config.replicas.roles is not None
    if has_roles:
        prefills = [0] * run.num_replicas
        for i in run.prefill_of.values():
            prefills[i] += 1
        for i, r in enumerate(replicas):
            r.update(role=run.replica_roles[i], prefills=prefills[i],
                     queue_depth_mean=run.replica_queue_depth[i])
    stats = run.router_stats
    summary = {
        "num_replicas": run.num_replicas,
        "num_steps": run.num_steps,
        "overall": overall,
        "prefix_hit_rate": overall["prefix_hit_rate"],
        "load_imbalance": {k: _imbalance([float(r[k]) for r in replicas])
                           for k in ("requests", "tokens", "computed_tokens", "busy_s")},
        "replicas": replicas,
        "router": {
            "policy": stats.get("policy"),
            "num_rerouted": stats.get("num_rerouted", 0),
            "num_failed_by_death": stats.get("num_failed_by_death", 0),
            "num_hook_errors": stats.get("num_hook_errors", []),
            "num_routed": [r["num_routed"] for r in stats.get("replicas", [])],
            "num_refused": stats.get("num_refused", {}),
            "num_downgraded": stats.get("num_downgraded", {}),
        },
    }
    if has_roles:
        summary["router"]["num_disaggregated"] = stats.get("num_disaggregated", 0)
        summary["disaggregation"] = _disaggregation_summary(run, replicas)
    if run.flow_stats is not None:
        flow = run.flow_stats
        summary["flow_control"] = {
            "num_dispatched": flow["num_dispatched"], "num_held": flow["num_held"],
            "num_refused": flow["num_refused"], "num_hook_errors": flow["num_hook_errors"],
            "max_engine_waiting": max(run.replica_max_waiting, default=0),
        }
    if run.moves:
        moves = run.moves
        summary["migration"] = {
            "num_migrated": len(moves),
            "num_blocks_transferred": sum(h.num_blocks for h in moves),
            "num_blocks_held": sum(h.num_blocks_held for h in moves),
            "transfer_s_total": sum(h.seconds for h in moves),
        }
    return summary
