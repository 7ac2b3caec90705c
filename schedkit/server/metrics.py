"""Prometheus metrics of the server: vLLM's set under a ``schedkit:`` prefix, plus the
policy's view.

Names, types, units and histogram buckets follow vLLM 0.32's ``vllm:`` metrics (a vLLM
dashboard works after renaming the prefix); every series has vLLM's ``model_name``
label. Per-request series (tokens, successes, latencies) are recorded by the server as
requests end; latencies are measured where the client sees them (from the HTTP
request's arrival), except the queue time, which is the engine's. Engine-wide series
(running, waiting, KV usage, prefix cache, preemptions) and the policy's (rejections and
hook errors by plugin) are read from the engine's ``stats`` when ``/metrics`` is scraped,
and so, with ``flow_control.enabled``, are the front door's (``flow_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schedkit.config.workload import SLOTargets
from schedkit.server.flow_metrics import FlowSeries

PREFIX = "schedkit:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets (seconds) for TTFT, inter-token latency (and time per output token), and
the per-request phase times (E2E, queue, prefill, decode, inference)."""


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


_ENGINE_SERIES: tuple[tuple[Any, str, str, str], ...] = (
    (GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
     "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
     "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     "kv_cache_usage"),
    (CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in terms of number of "
     "queried tokens.", "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
     "tokens.", "prefix_cache_hits"),
    (CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions from the engine.",
     "num_preemptions"),
    (CounterMetricFamily, "engine_steps", "Engine steps run (schedule, execute, update).",
     "num_steps"),
    (GaugeMetricFamily, "num_requests_waiting_for_grammar", "Structured requests waiting for "
     "their grammar to compile (WAITING_FOR_FSM).", "num_waiting_for_grammar"),
    (CounterMetricFamily, "structured_output_grammars_compiled", "Structured-output grammars "
     "compiled (cache misses).", "grammars_compiled"),
    (CounterMetricFamily, "structured_output_compile_failures", "Structured-output grammars that "
     "failed to compile.", "grammar_compile_failures"),
    (CounterMetricFamily, "structured_output_grammar_cache_hits", "Structured requests whose "
     "grammar was already compiled.", "grammar_cache_hits"),
    (CounterMetricFamily, "structured_output_compile_timeouts", "Grammar compiles stopped at "
     "structured_outputs.compile_timeout_s.", "grammar_compile_timeouts"),
    (CounterMetricFamily, "structured_output_compiles_cancelled", "Grammar compiles cancelled "
     "because every request waiting for them left.", "grammar_compiles_cancelled"),
    (CounterMetricFamily, "structured_output_refusals", "Constraints refused before compiling "
     "(over a size limit, or the compile queue full).", "grammar_refusals"),
    (CounterMetricFamily, "structured_output_step_budget_failures", "Structured requests failed "
     "for exceeding structured_outputs.step_budget_ms.", "grammar_step_budget_failures"),
    (CounterMetricFamily, "structured_output_jump_forward_tokens", "Output tokens appended by "
     "jump-forward decoding instead of being sampled.", "jump_forward_tokens"),
    (CounterMetricFamily, "engine_refused_connections", "Connections to the engine's sockets "
     "refused at the handshake (no key, or not this launch's).", "num_refused_connections"),
)
"""``(family, name, help, engine stats key)`` of the engine-wide series with only the
``model_name`` label."""


_REPLICA_SERIES: tuple[tuple[Any, str, str, str], ...] = (
    (GaugeMetricFamily, "replica_num_requests_running", "Requests in model execution batches, "
     "per replica.", "num_running"),
    (GaugeMetricFamily, "replica_num_requests_waiting", "Requests waiting to be processed, per "
     "replica.", "num_waiting"),
    (GaugeMetricFamily, "replica_kv_cache_usage_perc", "KV-cache usage per replica (1 means 100 "
     "percent).", "kv_cache_usage"),
    (CounterMetricFamily, "replica_prefix_cache_queries", "Prefix cache queries per replica, in "
     "queried tokens.", "prefix_cache_queries"),
    (CounterMetricFamily, "replica_prefix_cache_hits", "Prefix cache hits per replica, in cached "
     "tokens.", "prefix_cache_hits"),
    (CounterMetricFamily, "replica_num_preemptions", "Preemptions per replica.", "num_preemptions"),
    (CounterMetricFamily, "replica_engine_steps", "Engine steps run per replica.", "num_steps"),
)
"""With ``replicas.count`` > 1: ``(family, name, help, stats key)`` of the per-replica
series (labels ``model_name``, ``replica``); the series above are then cluster totals
(``kv_cache_usage_perc`` the mean over live replicas)."""


class EngineStatsCollector(Collector):
    """Engine-wide series from the last ``stats`` snapshot the server fetched."""

    def __init__(self, model_name: str, policy: str, plugins: Sequence[tuple[str, Sequence[str]]]) -> None:
        self.model_name = model_name
        self.policy = policy
        self.plugins = [(name, list(hooks)) for name, hooks in plugins]
        self.stats: dict[str, Any] = {}
        self._last_replica: dict[int, dict[str, Any]] = {}
        self.flow: FlowSeries | None = None
        """The front door's series, read from ``stats["flow_control"]`` when it is there."""

    def collect(self) -> Iterable[Metric]:
        m, st = self.model_name, self.stats
        labels = ["model_name"]

        dead = bool(st.get("dead"))
        for family, name, doc, key in _ENGINE_SERIES:
            metric = family(PREFIX + name, doc, labels=labels)
            # a dead engine runs nothing and holds no KV: its gauges read 0, not the last
            # snapshot (counters keep their totals)
            metric.add_metric([m], 0 if dead and family is GaugeMetricFamily else st.get(key, 0))
            yield metric
        info = GaugeMetricFamily(PREFIX + "policy_info", "The scheduling policy and the plugins "
                                 "switched on (value 1).", labels=["model_name", "policy", "plugins"])
        info.add_metric([m, self.policy, ",".join(n for n, _ in self.plugins)], 1)
        yield info
        plugin = GaugeMetricFamily(PREFIX + "plugin_info", "A plugin switched on and the hooks it "
                                   "implements (value 1).", labels=["model_name", "plugin", "hooks"])
        for name, hooks in self.plugins:
            plugin.add_metric([m, name, ",".join(hooks)], 1)
        yield plugin
        # Every plugin's series exist from the start (at 0), so a dashboard shows 0, not
        # "no data", until something is rejected or fails.
        rejected = {name: 0 for name, hooks in self.plugins if "schedkit_admit_request" in hooks}
        rejected |= st.get("num_rejected_by_plugin", {})
        rej = CounterMetricFamily(PREFIX + "admission_rejections", "Requests an admission plugin "
                                  "rejected.", labels=["model_name", "plugin"])
        for name, n in sorted(rejected.items()):
            rej.add_metric([m, name], n)
        yield rej
        errors = {(name, hook): 0 for name, hooks in self.plugins for hook in hooks}
        errors |= {(name, hook): n for name, hook, n in st.get("num_hook_errors", [])}
        err = CounterMetricFamily(PREFIX + "hook_errors", "Hook calls that raised or answered "
                                  "something impossible, by plugin and hook.",
                                  labels=["model_name", "plugin", "hook"])
        for (name, hook), n in sorted(errors.items()):
            err.add_metric([m, name, hook], n)
        yield err
        healthy = GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine process "
                                    "answers, 0 once it is gone.", labels=labels)
        healthy.add_metric([m], 0.0 if st.get("dead") else 1.0)
        yield healthy
        if "replicas" in st:
            yield from self._replica_series(st["replicas"])
        if "router" in st:
            yield from self._router_series(st["router"])
        if "kv_transfer" in st:
            yield from self._transfer_series(st["kv_transfer"], st.get("router", {}), st.get("replicas", []))
        if "migration" in st:
            yield from self._handoff_counters(st["migration"], "migration_kv", _MIGRATION_SERIES,
                                              "Moved requests whose target computed their KV itself, by why "
                                              "(prefill_died: the source died).")
        if "flow_control" in st and self.flow is not None:
            yield from self.flow.collect(st["flow_control"])

    def _replica_series(self, replicas: list[dict[str, Any]]) -> Iterable[Metric]:
        m = self.model_name
        for rep in replicas:  # a dead replica keeps its last counts
            if rep.get("healthy"):
                self._last_replica[rep["index"]] = rep
        labels = ["model_name", "replica"]
        for family, name, doc, key in _REPLICA_SERIES:
            metric = family(PREFIX + name, doc, labels=labels)
            for rep in replicas:
                last = self._last_replica.get(rep["index"], {})
                value = last.get(key, 0) if (rep.get("healthy") or family is CounterMetricFamily) else 0
                metric.add_metric([m, str(rep["index"])], value)
            yield metric
        healthy = GaugeMetricFamily(PREFIX + "replica_healthy", "1 while the replica answers, 0 "
                                    "once it died.", labels=labels)
        for rep in replicas:
            healthy.add_metric([m, str(rep["index"])], 1.0 if rep.get("healthy") else 0.0)
        yield healthy

    def _router_series(self, router: dict[str, Any]) -> Iterable[Metric]:
        m = self.model_name
        info = GaugeMetricFamily(PREFIX + "router_info", "The router policy and the router plugins "
                                 "switched on (value 1).", labels=["model_name", "policy", "plugins"])
        info.add_metric([m, str(router.get("policy", "")), ",".join(router.get("plugins", []))], 1)
        yield info
        labels = ["model_name", "replica"]
        routed = CounterMetricFamily(PREFIX + "router_requests_routed", "Requests the router sent "
                                     "to each replica.", labels=labels)
        outstanding = GaugeMetricFamily(PREFIX + "router_requests_outstanding", "Requests routed to "
                                        "each replica and not finished.", labels=labels)
        cached = GaugeMetricFamily(PREFIX + "router_cached_blocks", "Prefix-cache blocks the router "
                                   "knows each replica holds (from its KV events).", labels=labels)
        for rep in router.get("replicas", []):
            key = [m, str(rep["index"])]
            routed.add_metric(key, rep.get("num_routed", 0))
            outstanding.add_metric(key, rep.get("num_outstanding", 0))
            cached.add_metric(key, rep.get("num_cached_blocks", 0))
        yield from (routed, outstanding, cached)
        rerouted = CounterMetricFamily(PREFIX + "router_rerouted", "Requests sent to another replica "
                                       "because theirs died before they produced a token.",
                                       labels=["model_name"])
        rerouted.add_metric([m], router.get("num_rerouted", 0))
        yield rerouted
        migrated = CounterMetricFamily(PREFIX + "router_migrations", "Running requests moved to "
                                       "another replica (schedkit_router_migrate).", labels=["model_name"])
        migrated.add_metric([m], router.get("num_migrated", 0))
        yield migrated
        lost = CounterMetricFamily(PREFIX + "router_failed_by_replica_death", "Requests failed "
                                   "because their replica died after they produced tokens.",
                                   labels=["model_name"])
        lost.add_metric([m], router.get("num_failed_by_death", 0))
        yield lost
        errors = {(p, h): 0 for p, hooks in router.get("plugin_hooks", []) for h in hooks}
        errors |= {(p, h): n for p, h, n in router.get("num_hook_errors", [])}
        err = CounterMetricFamily(PREFIX + "router_hook_errors", "Router-hook calls that raised or "
                                  "answered something impossible, by plugin and hook.",
                                  labels=["model_name", "plugin", "hook"])
        for (p, h), n in sorted(errors.items()):
            err.add_metric([m, p, h], n)
        yield err


    def _handoff_counters(self, kv: dict[str, Any], prefix: str, series: tuple[tuple[str, str, str], ...],
                          fallback_doc: str) -> Iterable[Metric]:
        """The counters of a :class:`~schedkit.cluster.handoff.HandoffStats` (its
        ``as_dict``), named ``prefix_*``."""
        m = self.model_name
        for name, key, doc in series:
            metric = CounterMetricFamily(f"{PREFIX}{prefix}_{name}", doc, labels=["model_name"])
            metric.add_metric([m], kv.get(key, 0))
            yield metric
        fallbacks = CounterMetricFamily(f"{PREFIX}{prefix}_fallbacks", fallback_doc, labels=["model_name", "reason"])
        for reason in FALLBACK_REASONS:
            fallbacks.add_metric([m, reason], kv.get("fallbacks", {}).get(reason, 0))
        yield fallbacks

    def _transfer_series(self, kv: dict[str, Any], router: dict[str, Any],
                         replicas: list[dict[str, Any]]) -> Iterable[Metric]:
        """With ``replicas.roles``: the KV hand-offs, and queue depths per role."""
        m = self.model_name
        yield from self._handoff_counters(kv, "kv_transfer", _TRANSFER_SERIES, "Disaggregated requests "
                                          "whose decode replica computed the prompt itself, by why.")
        roles = {r["index"]: r.get("role", "both") for r in router.get("replicas", [])}
        depth = {role: [0, 0] for role in ("prefill", "decode", "both")}
        for rep in replicas:
            if rep.get("healthy"):
                d = depth[roles.get(rep["index"], "both")]
                d[0] += rep.get("num_waiting", 0)
                d[1] += rep.get("num_running", 0)
        waiting = GaugeMetricFamily(PREFIX + "role_num_requests_waiting", "Requests waiting on the "
                                    "live replicas of each role.", labels=["model_name", "role"])
        running = GaugeMetricFamily(PREFIX + "role_num_requests_running", "Requests running on the "
                                    "live replicas of each role.", labels=["model_name", "role"])
        for role, (w, r) in depth.items():
            waiting.add_metric([m, role], w)
            running.add_metric([m, role], r)
        yield from (waiting, running)


_TRANSFER_SERIES = (
    ("handoffs", "num_handoffs", "KV hand-offs from a prefill to a decode replica."),
    ("blocks", "num_blocks", "KV blocks sent from prefill to decode replicas."),
    ("blocks_held", "num_blocks_held", "Prompt blocks a decode replica held already (not sent)."),
    ("bytes", "num_bytes", "KV bytes sent from prefill to decode replicas."),
    ("seconds", "seconds", "Seconds from prefills' ends to their decode replicas holding the KV, summed."),
    ("room_waits", "num_room_waits", "Times a decode replica had no room for a hand-off yet (the "
     "prefill replica kept its blocks)."),
)
"""``(name after kv_transfer_, stats key, help)`` of the hand-off counters."""
_MIGRATION_SERIES = (
    ("handoffs", "num_handoffs", "Moved requests whose KV reached their target replica."),
    ("blocks", "num_blocks", "KV blocks sent with moved requests."),
    ("blocks_held", "num_blocks_held", "Blocks of moved requests their target held already (not sent)."),
    ("bytes", "num_bytes", "KV bytes sent with moved requests."),
    ("seconds", "seconds", "Seconds from moved requests' stop to their target holding the KV, summed."),
    ("room_waits", "num_room_waits", "Times a migration target had no room yet (the source kept the blocks)."),
)
"""``(name after migration_kv_, migration stats key, help)``."""
FALLBACK_REASONS = ("prefill_died", "prefill_failed", "timeout", "transfer_error")


class ServerMetrics:
    """The server's Prometheus registry and the per-request series it records.

    Args:
        model_name: The served model name (the ``model_name`` label).
        policy: ``scheduler.policy``.
        plugins: ``(plugin, hooks)`` switched on.
        max_tenant_labels: Tenants with a label of their own; later ones count as "other".
        slo_classes: The config's SLO classes: each gets its attainment series (the only
            ``slo_class`` label values, since the server refuses other names).
    """

    def __init__(self, model_name: str, policy: str, plugins: Sequence[tuple[str, Sequence[str]]],
                 max_tenant_labels: int = 64, max_model_len: int = 2048,
                 slo_classes: Mapping[str, SLOTargets] | None = None) -> None:
        disable_created_metrics()  # vLLM's series have no _created twins either
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = EngineStatsCollector(model_name, policy, plugins)
        self.registry.register(self.engine)
        r, lb = self.registry, ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.",
                                     lb, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens "
                                         "processed.", lb, registry=r).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed "
                                       "requests.", ["model_name", "finished_reason"], registry=r)
        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(PREFIX + name, doc, lb, buckets=buckets, registry=r).labels(model_name)

        tokens = token_count_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in "
                         "seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in "
                        "seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in "
                        "seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Histogram of time spent in WAITING "
                               "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens "
                                      "processed.", tokens)
        self.req_generation_tokens = hist("request_generation_tokens", "Number of generation "
                                          "tokens processed.", tokens)
        self.req_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens "
                                   "request parameter.", tokens)
        self.req_max_generation = hist("request_max_num_generation_tokens", "Histogram of maximum "
                                       "number of requested generation tokens.", tokens)
        self.req_n = hist("request_params_n", "Histogram of the n request parameter.",
                          (1, 2, 5, 10, 20))
        self.tpot = hist("request_time_per_output_token_seconds", "Histogram of "
                         "time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "Histogram of time spent in "
                                 "PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "Histogram of time spent in DECODE "
                                "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "Histogram of time spent in "
                                   "RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.tenant_prompt = Counter(PREFIX + "tenant_prompt_tokens", "Prompt tokens served per "
                                     "tenant (the request's user field).", ["model_name", "tenant"],
                                     registry=r)
        self.tenant_generation = Counter(PREFIX + "tenant_generation_tokens", "Output tokens served "
                                         "per tenant.", ["model_name", "tenant"], registry=r)
        self.request_errors = Counter(PREFIX + "http_request_errors", "HTTP requests answered "
                                      "with an error, by status.", ["model_name", "status"], registry=r)
        self.max_tenant_labels = max_tenant_labels
        self._tenants: set[str] = set()
        self.engine.flow = FlowSeries(model_name, self.tenant_label, self._tenants, max_tenant_labels)
        self.slo_classes = dict(slo_classes or {})
        labels = ["model_name", "slo_class"]
        self.slo_requests = Counter(PREFIX + "slo_class_requests", "Requests of each SLO class that "
                                    "finished.", labels, registry=r)
        self.slo_met = Counter(PREFIX + "slo_class_slo_met", "Requests of each SLO class that met "
                               "every target of their class (TTFT, TPOT, end-to-end).", labels, registry=r)
        for name in self.slo_classes:  # every class's series from the start, at 0
            self.slo_requests.labels(model_name, name)
            self.slo_met.labels(model_name, name)

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` while fewer than ``max_tenant_labels`` tenants have a label; else "other"."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenant_labels:
            self._tenants.add(tenant)
            return tenant
        return "other"

    def request_finished(self, *, finish_reason: str, tenant: str, num_prompt_tokens: int,
                         num_output_tokens: int, ttft: float | None, e2e: float,
                         queue_time: float | None, max_tokens: int, n: int,
                         engine: Any = None, slo_class: str | None = None) -> None:
        """Record one engine request (one choice) that ended; ``engine`` is its
        :class:`~schedkit.core.outputs.RequestMetricsData` (phase times) when it has one."""
        m = self.model_name
        self.req_prompt_tokens.observe(num_prompt_tokens)
        self.req_generation_tokens.observe(num_output_tokens)
        self.req_max_tokens.observe(max_tokens)
        self.req_max_generation.observe(max_tokens)
        self.req_n.observe(n)
        if ttft is not None and num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))
        if engine is not None and engine.first_scheduled_time is not None:
            start = engine.first_scheduled_time
            if engine.first_token_time is not None:
                self.prefill_time.observe(max(engine.first_token_time - start, 0.0))
                if engine.finish_time is not None:
                    self.decode_time.observe(max(engine.finish_time - engine.first_token_time, 0.0))
            if engine.finish_time is not None:
                self.inference_time.observe(max(engine.finish_time - start, 0.0))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.request_success.labels(m, finish_reason).inc()
        label = self.tenant_label(tenant)
        self.tenant_prompt.labels(m, label).inc(num_prompt_tokens)
        self.tenant_generation.labels(m, label).inc(num_output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        targets = self.slo_classes.get(slo_class) if slo_class is not None else None
        if targets is not None:
            self.slo_requests.labels(m, slo_class).inc()
            tpot = (e2e - ttft) / (num_output_tokens - 1) if ttft is not None and num_output_tokens > 1 else None
            if targets.met_by(ttft, tpot, e2e):
                self.slo_met.labels(m, slo_class).inc()

    def http_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
