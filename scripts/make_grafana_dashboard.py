"""Writes docs/grafana/schedkit-dashboard.json: a Grafana dashboard for every metric of
``schedkit serve``, with a "Replicas and router" row for a server with ``replicas.count`` > 1,
a "Disaggregation" row for one with ``replicas.roles``, a "Live migration" row for one with a
migration plugin and a "Flow control" row for one with ``flow_control.enabled``
(tests/server/test_dashboard.py checks, against a server of each kind, that each panel's
series exist and that every exposed series has a panel).

    python scripts/make_grafana_dashboard.py
"""
import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name="$model_name"'
RI = "[$__rate_interval]"

_ids = iter(range(1, 1000))


def target(expr, legend="__auto", ref="A", instant=False, fmt=None):
    t = {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend,
         "range": not instant, "instant": instant, "refId": ref}
    if fmt:
        t["format"] = fmt
    return t


def targets(*pairs, **kw):
    return [target(e, leg, chr(ord("A") + i), **kw) for i, (e, leg) in enumerate(pairs)]


def timeseries(title, desc, pos, tgts, unit="short", min_=0, max_=None, stack=False, overrides=()):
    defaults = {"color": {"mode": "palette-classic"}, "unit": unit, "min": min_,
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                           "showPoints": "never", "spanNulls": False,
                           "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
    if max_ is not None:
        defaults["max"] = max_
    return {"id": next(_ids), "type": "timeseries", "title": title, "description": desc,
            "datasource": DS, "gridPos": pos,
            "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": tgts}


def quantile(metric, q):
    return f"histogram_quantile({q}, sum by (le) (rate(schedkit:{metric}_bucket{{{M}}}{RI})))"


def quantiles(metric, qs):
    return [(quantile(metric, q), f"p{int(q * 100)}") for q in qs]


def gp(x, y, w, h):
    return {"x": x, "y": y, "w": w, "h": h}


def health_stat(title, desc, pos, tgts, text_mode="value"):
    return {
        "id": next(_ids), "type": "stat", "title": title, "description": desc, "datasource": DS,
        "gridPos": pos,
        "fieldConfig": {"defaults": {
            "mappings": [{"type": "value", "options": {
                "0": {"text": "DOWN", "color": "red", "index": 0},
                "1": {"text": "UP", "color": "green", "index": 1}}}],
            "thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                          {"color": "green", "value": 1}]},
            "unit": "none"}, "overrides": []},
        "options": {"colorMode": "background", "graphMode": "none", "justifyMode": "center",
                    "textMode": text_mode, "reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                             "values": False}},
        "targets": tgts}


def row(title, y):
    """A Grafana row: the panels below it, up to the next row, are its own."""
    return {"id": next(_ids), "type": "row", "title": title, "collapsed": False,
            "gridPos": gp(0, y, 24, 1), "panels": []}


panels = []
# --- health and the active policy (y 0..5) ---------------------------------------------
panels.append(health_stat(
    "Engine healthy", "schedkit:engine_healthy: 1 while the engine process answers the server, 0 "
    "once it is gone (the server then answers 503 on /health). With replicas: 1 while one "
    "replica lives.", gp(0, 0, 4, 6), targets((f"min(schedkit:engine_healthy{{{M}}})", "healthy"))))


def info_table(title, desc, pos, expr, columns):
    return {
        "id": next(_ids), "type": "table", "title": title, "description": desc, "datasource": DS,
        "gridPos": pos, "fieldConfig": {"defaults": {"custom": {"align": "left"}}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True,
                              "model_name": True},
            "indexByName": {c: i for i, c in enumerate(columns)}}}],
        "targets": [target(expr, "", "A", instant=True, fmt="table")]}


panels.append(info_table(
    "Active policy", "schedkit:policy_info: scheduler.policy and every plugin switched on "
    "(the policy's own plugin and the defaults included), per scraped server.",
    gp(4, 0, 8, 6), f"max by (instance, policy, plugins) (schedkit:policy_info{{{M}}})",
    ["instance", "policy", "plugins"]))
panels.append(info_table(
    "Plugins and their hooks", "schedkit:plugin_info: one row per plugin switched on, with the "
    "hooks it implements.", gp(12, 0, 12, 6),
    f"max by (plugin, hooks) (schedkit:plugin_info{{{M}}})", ["plugin", "hooks"]))

# --- load (y 6) ------------------------------------------------------------------------
panels.append(timeseries(
    "Requests running / waiting", "schedkit:num_requests_running (in the step's batch) and "
    "schedkit:num_requests_waiting (in the policy's waiting queue); with replicas, the cluster's "
    "totals.", gp(0, 6, 8, 8),
    targets((f"sum(schedkit:num_requests_running{{{M}}})", "running"),
            (f"sum(schedkit:num_requests_waiting{{{M}}})", "waiting"))))
panels.append(timeseries(
    "KV cache usage", "schedkit:kv_cache_usage_perc: fraction of KV-cache blocks in use (1 = full); "
    "with replicas, the mean over the live ones.", gp(8, 6, 8, 8), targets((f"max(schedkit:kv_cache_usage_perc{{{M}}})", "KV cache used")),
    unit="percentunit", max_=1))
panels.append(timeseries(
    "Preemptions", "rate(schedkit:num_preemptions_total): requests preempted per second (the "
    "policy's victim choice, when KV blocks run out).", gp(16, 6, 8, 8),
    targets((f"sum(rate(schedkit:num_preemptions_total{{{M}}}{RI}))", "preemptions/s"))))

# --- latency (y 14, 22) ---------------------------------------------------------------
panels.append(timeseries(
    "Time to first token", "histogram_quantile over rate(schedkit:time_to_first_token_seconds_bucket), "
    "measured from the HTTP request's arrival.", gp(0, 14, 12, 8),
    targets(*quantiles("time_to_first_token_seconds", (0.5, 0.9, 0.99))), unit="s"))
panels.append(timeseries(
    "Inter-token latency", "histogram_quantile over rate(schedkit:inter_token_latency_seconds_bucket): "
    "time between successive output deltas of a request.", gp(12, 14, 12, 8),
    targets(*quantiles("inter_token_latency_seconds", (0.5, 0.99))), unit="s"))
panels.append(timeseries(
    "End-to-end request latency", "histogram_quantile over "
    "rate(schedkit:e2e_request_latency_seconds_bucket), from the HTTP request's arrival to its "
    "last token.", gp(0, 22, 12, 8),
    targets(*quantiles("e2e_request_latency_seconds", (0.5, 0.99))), unit="s"))
panels.append(timeseries(
    "Queue time", "histogram_quantile over rate(schedkit:request_queue_time_seconds_bucket): time a "
    "request spent WAITING in the engine before it was first scheduled (the policy's ordering "
    "and admission show up here first).", gp(12, 22, 12, 8),
    targets(*quantiles("request_queue_time_seconds", (0.5, 0.99))), unit="s"))

# --- throughput (y 30) ----------------------------------------------------------------
panels.append(timeseries(
    "Token throughput", "rate(schedkit:prompt_tokens_total) and rate(schedkit:generation_tokens_total) "
    "for requests that ended.", gp(0, 30, 8, 8),
    targets((f"sum(rate(schedkit:prompt_tokens_total{{{M}}}{RI}))", "prompt tokens/s"),
            (f"sum(rate(schedkit:generation_tokens_total{{{M}}}{RI}))", "generation tokens/s"))))
panels.append(timeseries(
    "Finished requests by reason", "rate(schedkit:request_success_total) by finished_reason "
    "(stop, length, ...).", gp(8, 30, 8, 8),
    targets((f"sum by (finished_reason) (rate(schedkit:request_success_total{{{M}}}{RI}))",
             "{{finished_reason}}")), unit="reqps", stack=True))
panels.append(timeseries(
    "Prefix cache hit rate", "rate(schedkit:prefix_cache_hits_total) / "
    "rate(schedkit:prefix_cache_queries_total): the fraction of queried prompt tokens found "
    "cached (no data while nothing is queried).", gp(16, 30, 8, 8),
    targets((f"sum(rate(schedkit:prefix_cache_hits_total{{{M}}}{RI})) / "
             f"(sum(rate(schedkit:prefix_cache_queries_total{{{M}}}{RI})) > 0)", "hit rate")),
    unit="percentunit", max_=1))

# --- the policy's view (y 38, 46) -----------------------------------------------------
panels.append(timeseries(
    "Admission rejections by plugin", "rate(schedkit:admission_rejections_total) by plugin: "
    "requests an admission hook (schedkit_admit_request) refused; the client got 429.",
    gp(0, 38, 8, 8),
    targets((f"sum by (plugin) (rate(schedkit:admission_rejections_total{{{M}}}{RI}))",
             "{{plugin}}")), unit="reqps", stack=True))
panels.append(timeseries(
    "Hook errors by plugin and hook", "rate(schedkit:hook_errors_total) by plugin and hook: hook "
    "calls that raised or answered something impossible.", gp(8, 38, 8, 8),
    targets((f"sum by (plugin, hook) (rate(schedkit:hook_errors_total{{{M}}}{RI}))",
             "{{plugin}} / {{hook}}")), unit="ops", stack=True))
panels.append(timeseries(
    "HTTP errors by status", "rate(schedkit:http_request_errors_total) by status: requests answered "
    "with an error (400, 401, 404, 413, 429, 500, 503, ...).", gp(16, 38, 8, 8),
    targets((f"sum by (status) (rate(schedkit:http_request_errors_total{{{M}}}{RI}))",
             "{{status}}")), unit="reqps", stack=True))
panels.append(timeseries(
    "Tokens served per tenant", "rate(schedkit:tenant_prompt_tokens_total) and "
    "rate(schedkit:tenant_generation_tokens_total) by tenant (the request's user field; tenants "
    "past server.max_tenant_labels count as \"other\").", gp(0, 46, 16, 8),
    targets((f"sum by (tenant) (rate(schedkit:tenant_prompt_tokens_total{{{M}}}{RI}))",
             "{{tenant}} prompt"),
            (f"sum by (tenant) (rate(schedkit:tenant_generation_tokens_total{{{M}}}{RI}))",
             "{{tenant}} generation"))))
panels.append({
    "id": next(_ids), "type": "bargauge", "title": "Generation tokens per tenant (time range)",
    "description": "increase(schedkit:tenant_generation_tokens_total) over the dashboard's time "
                   "range, by tenant: each tenant's share of the output tokens served.",
    "datasource": DS, "gridPos": gp(16, 46, 8, 8),
    "fieldConfig": {"defaults": {"unit": "short", "min": 0, "color": {"mode": "palette-classic"}},
                    "overrides": []},
    "options": {"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    "targets": [target(f"sort_desc(sum by (tenant) (increase(schedkit:tenant_generation_tokens_total"
                       f"{{{M}}}[$__range])))", "{{tenant}}", "A", instant=True)]})

# --- per-request detail (y 54, 62): vLLM's request histograms ---------------------------
panels.append(timeseries(
    "Time per output token", "histogram_quantile over "
    "rate(schedkit:request_time_per_output_token_seconds_bucket): (E2E - TTFT) / (outputs - 1) "
    "per request.", gp(0, 54, 8, 8),
    targets(*quantiles("request_time_per_output_token_seconds", (0.5, 0.99))), unit="s"))
panels.append(timeseries(
    "Request phases (p50)", "histogram_quantile(0.5) of schedkit:request_prefill_time_seconds "
    "(first scheduled to first token), request_decode_time_seconds (first token to the end) and "
    "request_inference_time_seconds (first scheduled to the end), on the engine's clock.",
    gp(8, 54, 8, 8),
    targets(*[(quantile(f"request_{name}_time_seconds", 0.5), name)
              for name in ("prefill", "decode", "inference")]), unit="s"))
panels.append(timeseries(
    "Tokens per request (p50)", "histogram_quantile(0.5) of schedkit:request_prompt_tokens and "
    "schedkit:request_generation_tokens.", gp(16, 54, 8, 8),
    targets((quantile("request_prompt_tokens", 0.5), "prompt"),
            (quantile("request_generation_tokens", 0.5), "generation"))))
panels.append(timeseries(
    "Request parameters (p50)", "histogram_quantile(0.5) of schedkit:request_params_max_tokens, "
    "schedkit:request_max_num_generation_tokens and schedkit:request_params_n.", gp(0, 62, 12, 8),
    targets(*[(quantile(name, 0.5), label) for name, label in (
        ("request_params_max_tokens", "max_tokens"),
        ("request_max_num_generation_tokens", "max generation tokens"),
        ("request_params_n", "n"))])))
panels.append(timeseries(
    "Engine steps", "rate(schedkit:engine_steps_total): engine steps (schedule, execute, update) "
    "per second.", gp(12, 62, 6, 8),
    targets((f"sum(rate(schedkit:engine_steps_total{{{M}}}{RI}))", "steps/s")), unit="ops"))
panels.append(timeseries(
    "Refused engine connections", "increase(schedkit:engine_refused_connections_total): handshakes "
    "the engine's sockets refused (a process without this launch's key tried to reach the engine "
    "directly; docs/serving.md, Who can reach the engine). Anything above 0 is worth a look.",
    gp(18, 62, 6, 8),
    targets((f"sum(increase(schedkit:engine_refused_connections_total{{{M}}}{RI}))", "refused"))))

# --- replicas and the router (y 70..108): only a server with replicas.count > 1 has these
# series (labelled by replica); the panels above then show the cluster's totals -----------
panels.append(row("Replicas and router", 70))
panels.append(health_stat(
    "Replicas healthy", "schedkit:replica_healthy by replica: 1 while the replica answers, 0 once it "
    "died (it is out of rotation; /health stays 200 while one replica lives).", gp(0, 71, 8, 6),
    targets((f"min by (replica) (schedkit:replica_healthy{{{M}}})", "replica {{replica}}")),
    text_mode="value_and_name"))
panels.append(info_table(
    "Router policy", "schedkit:router_info: router.policy and every router plugin switched on, per "
    "scraped server.", gp(8, 71, 16, 6),
    f"max by (instance, policy, plugins) (schedkit:router_info{{{M}}})",
    ["instance", "policy", "plugins"]))
panels.append(timeseries(
    "Requests running / waiting per replica", "schedkit:replica_num_requests_running and "
    "schedkit:replica_num_requests_waiting by replica (0 for a dead one).", gp(0, 77, 8, 8),
    targets((f"sum by (replica) (schedkit:replica_num_requests_running{{{M}}})",
             "replica {{replica}} running"),
            (f"sum by (replica) (schedkit:replica_num_requests_waiting{{{M}}})",
             "replica {{replica}} waiting"))))
panels.append(timeseries(
    "KV cache usage per replica", "schedkit:replica_kv_cache_usage_perc by replica: fraction of "
    "the replica's KV-cache blocks in use (1 = full).", gp(8, 77, 8, 8),
    targets((f"max by (replica) (schedkit:replica_kv_cache_usage_perc{{{M}}})",
             "replica {{replica}}")), unit="percentunit", max_=1))
panels.append(timeseries(
    "Prefix cache hit rate per replica", "rate(schedkit:replica_prefix_cache_hits_total) / "
    "rate(schedkit:replica_prefix_cache_queries_total) by replica: how much of what the router "
    "sent each replica was cached there (no data while nothing is queried).", gp(16, 77, 8, 8),
    targets((f"sum by (replica) (rate(schedkit:replica_prefix_cache_hits_total{{{M}}}{RI})) / "
             f"(sum by (replica) (rate(schedkit:replica_prefix_cache_queries_total{{{M}}}{RI})) > 0)",
             "replica {{replica}}")), unit="percentunit", max_=1))
panels.append(timeseries(
    "Engine steps per replica", "rate(schedkit:replica_engine_steps_total) by replica: engine steps "
    "per second (a replica that stops stepping while others step is stuck or dead).",
    gp(0, 85, 12, 8),
    targets((f"sum by (replica) (rate(schedkit:replica_engine_steps_total{{{M}}}{RI}))",
             "replica {{replica}}")), unit="ops"))
panels.append(timeseries(
    "Preemptions per replica", "rate(schedkit:replica_num_preemptions_total) by replica: requests "
    "preempted per second on each replica.", gp(12, 85, 12, 8),
    targets((f"sum by (replica) (rate(schedkit:replica_num_preemptions_total{{{M}}}{RI}))",
             "replica {{replica}}"))))
panels.append(timeseries(
    "Requests routed by replica", "rate(schedkit:router_requests_routed_total) by replica: the "
    "router's decisions per second (re-routed requests count again on their new replica).",
    gp(0, 93, 8, 8),
    targets((f"sum by (replica) (rate(schedkit:router_requests_routed_total{{{M}}}{RI}))",
             "replica {{replica}}")), unit="reqps", stack=True))
panels.append(timeseries(
    "Outstanding requests by replica", "schedkit:router_requests_outstanding by replica: requests "
    "routed there and not finished, the router's own count.", gp(8, 93, 8, 8),
    targets((f"sum by (replica) (schedkit:router_requests_outstanding{{{M}}})",
             "replica {{replica}}")), stack=True))
panels.append(timeseries(
    "Cached blocks by replica", "schedkit:router_cached_blocks by replica: the prefix-cache blocks "
    "the router knows each replica holds, from the replica's KV cache events.", gp(16, 93, 8, 8),
    targets((f"sum by (replica) (schedkit:router_cached_blocks{{{M}}})", "replica {{replica}}"))))
panels.append(timeseries(
    "Re-routed, failed and migrated", "rate(schedkit:router_rerouted_total): requests sent "
    "again to another replica because theirs died before their first token (the client sees "
    "nothing); rate(schedkit:router_failed_by_replica_death_total): requests that had produced "
    "tokens and failed with their replica; rate(schedkit:router_migrations_total): running "
    "requests moved to another replica by a migration plugin.", gp(0, 101, 12, 8),
    targets((f"sum(rate(schedkit:router_rerouted_total{{{M}}}{RI}))", "re-routed"),
            (f"sum(rate(schedkit:router_failed_by_replica_death_total{{{M}}}{RI}))",
             "failed by replica death"),
            (f"sum(rate(schedkit:router_migrations_total{{{M}}}{RI}))", "migrated (moved running)")),
    unit="reqps"))
panels.append(timeseries(
    "Router hook errors by plugin and hook", "rate(schedkit:router_hook_errors_total) by plugin and "
    "hook: router-hook calls that raised or answered something impossible (the answer is dropped "
    "for that decision; the request is still routed).", gp(12, 101, 12, 8),
    targets((f"sum by (plugin, hook) (rate(schedkit:router_hook_errors_total{{{M}}}{RI}))",
             "{{plugin}} / {{hook}}")), unit="ops", stack=True))

# --- structured outputs (y 109..118) -----------------------------------------------------
panels.append(row("Structured outputs", 109))
panels.append(timeseries(
    "Grammars", "rate(schedkit:structured_output_grammars_compiled_total): grammars compiled "
    "(cache misses); rate(schedkit:structured_output_grammar_cache_hits_total): structured requests "
    "whose grammar was already compiled; rate(schedkit:structured_output_compile_failures_total): "
    "constraints that failed to compile.", gp(0, 110, 6, 8),
    targets((f"sum(rate(schedkit:structured_output_grammars_compiled_total{{{M}}}{RI}))", "compiled"),
            (f"sum(rate(schedkit:structured_output_grammar_cache_hits_total{{{M}}}{RI}))", "cache hits"),
            (f"sum(rate(schedkit:structured_output_compile_failures_total{{{M}}}{RI}))", "failed")),
    unit="ops"))
panels.append(timeseries(
    "Waiting for a grammar", "schedkit:num_requests_waiting_for_grammar: structured requests "
    "whose grammar is compiling (WAITING_FOR_FSM); they are passed over, not blocking the queue.",
    gp(6, 110, 6, 8),
    targets((f"sum(schedkit:num_requests_waiting_for_grammar{{{M}}})", "waiting for a grammar"))))
panels.append(timeseries(
    "Jump-forward tokens", "rate(schedkit:structured_output_jump_forward_tokens_total): output tokens "
    "appended by jump-forward decoding (structured_outputs.jump_forward) instead of being sampled.",
    gp(12, 110, 6, 8),
    targets((f"sum(rate(schedkit:structured_output_jump_forward_tokens_total{{{M}}}{RI}))",
             "tokens/s")), unit="ops"))
panels.append(timeseries(
    "Grammar limits", "rate(schedkit:structured_output_compile_timeouts_total): compiles stopped at "
    "structured_outputs.compile_timeout_s; rate(schedkit:structured_output_compiles_cancelled_total): "
    "compiles cancelled because their requests left; rate(schedkit:structured_output_refusals_total): "
    "constraints refused before compiling (size limits, full compile queue); "
    "rate(schedkit:structured_output_step_budget_failures_total): requests failed for exceeding "
    "structured_outputs.step_budget_ms.", gp(18, 110, 6, 8),
    targets((f"sum(rate(schedkit:structured_output_compile_timeouts_total{{{M}}}{RI}))", "timed out"),
            (f"sum(rate(schedkit:structured_output_compiles_cancelled_total{{{M}}}{RI}))", "cancelled"),
            (f"sum(rate(schedkit:structured_output_refusals_total{{{M}}}{RI}))", "refused"),
            (f"sum(rate(schedkit:structured_output_step_budget_failures_total{{{M}}}{RI}))",
             "over step budget")), unit="ops"))

def handoff_panels(m: str, y: int, words: dict[str, str]) -> list[dict]:
    """Three panels over the counters of KV hand-offs named ``schedkit:<m>_*``: the
    hand-offs and their fallbacks, the bytes, the blocks sent and held with the waits for
    room. ``words`` names what moves in each description."""
    def s(name: str) -> str:
        return f"sum(rate(schedkit:{m}_{name}_total{{{M}}}{RI}))"

    return [
        timeseries(words["title"], f"rate(schedkit:{m}_handoffs_total): {words['handoff']}; "
                   f"rate(schedkit:{m}_fallbacks_total) by reason: {words['fallback']}.", gp(0, y, 6, 8),
                   targets((s("handoffs"), words["handoffs"]),
                           (f"sum by (reason) (rate(schedkit:{m}_fallbacks_total{{{M}}}{RI}))",
                            "fallback: {{reason}}")), unit="ops"),
        timeseries(words["bytes_title"], f"rate(schedkit:{m}_bytes_total): {words['bytes']}.", gp(6, y, 6, 8),
                   targets((s("bytes"), "bytes/s")), unit="Bps"),
        timeseries(words["blocks_title"], f"rate(schedkit:{m}_blocks_total): KV blocks sent; "
                   f"rate(schedkit:{m}_blocks_held_total): {words['held']} (not sent); "
                   f"rate(schedkit:{m}_room_waits_total): {words['room']}.", gp(12, y, 6, 8),
                   targets((s("blocks"), "sent"), (s("blocks_held"), "held already"),
                           (s("room_waits"), "waits for room")), unit="ops"),
    ]


# --- disaggregation (y 119..128): only with replicas.roles ---------------------------------
panels.append(row("Disaggregation", 119))
panels.extend(handoff_panels("kv_transfer", 120, {
    "title": "KV hand-offs", "handoffs": "hand-offs",
    "handoff": "prefills whose KV reached their decode replica",
    "fallback": "split requests whose decode replica computed the prompt itself (prefill died, failed "
                "or stalled, transfer refused)",
    "bytes_title": "KV transferred", "bytes": "bytes per second from prefill to decode replicas",
    "blocks_title": "Blocks sent and held", "held": "prompt blocks the decode replica held already",
    "room": "times a decode replica had no room yet, the prefill replica keeping its blocks (backpressure)"}))
panels.append(timeseries(
    "Hand-off time and queues per role", "rate(schedkit:kv_transfer_seconds_total) / "
    "rate(schedkit:kv_transfer_handoffs_total): mean seconds from a prefill's end to its decode "
    "replica holding the KV; schedkit:role_num_requests_waiting and _running: the live replicas' "
    "queues by role.", gp(18, 120, 6, 8),
    targets((f"sum(rate(schedkit:kv_transfer_seconds_total{{{M}}}{RI})) / "
             f"sum(rate(schedkit:kv_transfer_handoffs_total{{{M}}}{RI}))", "mean hand-off (s)"),
            (f"sum by (role) (schedkit:role_num_requests_waiting{{{M}}})", "waiting: {{role}}"),
            (f"sum by (role) (schedkit:role_num_requests_running{{{M}}})", "running: {{role}}"))))

# --- live migration (y 128..137): only with a schedkit_router_migrate plugin ------------------
panels.append(row("Live migration", 128))
panels.extend(handoff_panels("migration_kv", 129, {
    "title": "KV moved with requests", "handoffs": "moved with KV",
    "handoff": "moved requests whose KV reached their target replica",
    "fallback": "moved requests whose target computed the KV itself (the source died, a call stalled or "
                "was refused)",
    "bytes_title": "Migration bytes", "bytes": "KV bytes per second sent with moved requests",
    "blocks_title": "Migration blocks", "held": "blocks their targets held already",
    "room": "times a target had no room yet"}))
panels.append(timeseries(
    "Move time", "rate(schedkit:migration_kv_seconds_total) / rate(schedkit:migration_kv_handoffs_total): "
    "mean seconds from a moved request's stop on its replica to its target holding the KV.",
    gp(18, 129, 6, 8),
    targets((f"sum(rate(schedkit:migration_kv_seconds_total{{{M}}}{RI})) / "
             f"sum(rate(schedkit:migration_kv_handoffs_total{{{M}}}{RI}))", "mean move (s)")), unit="s"))

# --- SLO classes (y 138..146): only with slo_classes in the config -------------------------
panels.append(row("SLO classes", 138))
panels.append(timeseries(
    "SLO attainment by class", "rate(schedkit:slo_class_slo_met_total) / "
    "rate(schedkit:slo_class_requests_total) by slo_class: the share of each class's finished "
    "requests that met every target of the class (TTFT, TPOT, end-to-end; slo_classes in the "
    "config).", gp(0, 139, 12, 8),
    targets((f"sum by (slo_class) (rate(schedkit:slo_class_slo_met_total{{{M}}}{RI})) / "
             f"sum by (slo_class) (rate(schedkit:slo_class_requests_total{{{M}}}{RI}))", "{{slo_class}}")),
    unit="percentunit", max_=1))
panels.append(timeseries(
    "Requests by SLO class", "rate(schedkit:slo_class_requests_total) by slo_class: finished "
    "requests of each class per second.", gp(12, 139, 12, 8),
    targets((f"sum by (slo_class) (rate(schedkit:slo_class_requests_total{{{M}}}{RI}))", "{{slo_class}}")),
    unit="reqps", stack=True))

# --- flow control (y 147..164): only with flow_control.enabled ----------------------------
panels.append(row("Flow control", 147))
panels.append(timeseries(
    "Requests held at the front door", "schedkit:flow_num_requests_held by band: requests waiting at "
    "the front door for the engines to have room (band: the request's priority); "
    "schedkit:flow_num_requests_outstanding: requests it sent on that have not finished.",
    gp(0, 148, 8, 8),
    targets((f"sum by (band) (schedkit:flow_num_requests_held{{{M}}})", "held: band {{band}}"),
            (f"sum(schedkit:flow_num_requests_outstanding{{{M}}})", "sent on, not finished"))))
panels.append(timeseries(
    "Held per tenant", "schedkit:flow_tenant_num_requests_held by tenant: who is waiting at the front "
    "door now (tenants past server.max_tenant_labels count as \"other\"). A tenant sending more than "
    "its share shows up here, not in the others' latency.", gp(8, 148, 8, 8),
    targets((f"sum by (tenant) (schedkit:flow_tenant_num_requests_held{{{M}}})", "{{tenant}}")),
    stack=True))
panels.append(timeseries(
    "Dispatched, held and refused", "rate(schedkit:flow_requests_dispatched_total): requests sent on to "
    "the engines; rate(schedkit:flow_requests_held_total): requests that had to wait first; "
    "rate(schedkit:flow_requests_refused_total) by reason: refused with a 429 (timeout: held past "
    "flow_control.queue_timeout_s; full: flow_control.max_queued held).", gp(16, 148, 8, 8),
    targets((f"sum(rate(schedkit:flow_requests_dispatched_total{{{M}}}{RI}))", "dispatched"),
            (f"sum(rate(schedkit:flow_requests_held_total{{{M}}}{RI}))", "held first"),
            (f"sum by (reason) (rate(schedkit:flow_requests_refused_total{{{M}}}{RI}))", "refused: {{reason}}")),
    unit="reqps"))
panels.append(timeseries(
    "Engines saturated", "schedkit:flow_saturated: the saturation detector's (flow_control.saturation) "
    "last answer, 1 when the engines are full and new requests are held. It is asked when a request "
    "arrives and while held ones wait: with nothing held it keeps its last answer until the next request.",
    gp(0, 156, 8, 8),
    targets((f"max(schedkit:flow_saturated{{{M}}})", "saturated")), max_=1))
panels.append(info_table(
    "Flow-control plugins", "schedkit:flow_info: flow_control.fairness, flow_control.saturation and "
    "every flow plugin switched on, per scraped server.", gp(8, 156, 8, 8),
    f"max by (instance, fairness, saturation, plugins) (schedkit:flow_info{{{M}}})",
    ["instance", "fairness", "saturation", "plugins"]))
panels.append(timeseries(
    "Flow hook errors by plugin and hook", "rate(schedkit:flow_hook_errors_total) by plugin and hook: "
    "flow-hook calls that raised or answered something impossible (the answer is dropped and the next "
    "plugin decides; the request is never failed for it).", gp(16, 156, 8, 8),
    targets((f"sum by (plugin, hook) (rate(schedkit:flow_hook_errors_total{{{M}}}{RI}))",
             "{{plugin}} / {{hook}}")), unit="ops", stack=True))

dashboard = {
    "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "The Prometheus "
                  "that scrapes schedkit serve's /metrics", "type": "datasource",
                  "pluginId": "prometheus", "pluginName": "Prometheus"}],
    "__requires": [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
        {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
        {"type": "panel", "id": "table", "name": "Table", "version": ""},
        {"type": "panel", "id": "bargauge", "name": "Bar gauge", "version": ""}],
    "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                              "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                              "name": "Annotations & Alerts", "type": "dashboard"}]},
    "description": "schedkit serve: vLLM-style serving metrics, the scheduling policy's view "
                   "(policy, plugins, admission rejections, hook errors, tenants), with "
                   "replicas each replica and the router, with roles the KV hand-offs, "
                   "with a migration plugin the moved requests' KV.",
    "editable": True,
    "fiscalYearStartMonth": 0,
    "graphTooltip": 1,
    "id": None,
    "links": [],
    "liveNow": False,
    "panels": panels,
    "refresh": "10s",
    "schemaVersion": 39,
    "tags": ["schedkit", "llm-serving"],
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"selected": False, "text": "${DS_PROMETHEUS}", "value": "${DS_PROMETHEUS}"},
         "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": "",
         "skipUrlSync": False},
        {"name": "model_name", "label": "Model", "type": "query", "datasource": DS,
         "definition": "label_values(schedkit:num_requests_running, model_name)",
         "query": {"query": "label_values(schedkit:num_requests_running, model_name)",
                   "refId": "StandardVariableQuery"},
         "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [],
         "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1}]},
    "time": {"from": "now-30m", "to": "now"},
    "timepicker": {},
    "timezone": "",
    "title": "schedkit",
    "uid": "schedkit-serve",
    "version": 1,
    "weekStart": "",
}

with open(Path(__file__).resolve().parents[1] / "docs" / "grafana" / "schedkit-dashboard.json", "w") as f:
    json.dump(dashboard, f, indent=2)
    f.write("\n")
print(len(panels), "panels")
