"""SLO-aware routing: the latency predictor on hand-built replica states against costs
computed by hand, the ``slo-headroom`` router plugin, the admission hook (refuse,
downgrade) and what a failing plugin does to it."""

from __future__ import annotations

import json

import pytest

from schedkit import ConfigError, PluginError, hookimpl
from schedkit.cluster.latency import LatencyPredictor, prefill_work
from schedkit.cluster.router import Router
from schedkit.config import SchedulerConfig, config_from_dict
from schedkit.core.hints import RequestHints
from schedkit.core.request import Request, SamplingParams
from schedkit.core.routing import ReplicaState, RouteAdmission, RouteVerdict
from schedkit.engine.core import EngineCore
from schedkit.engine.load import load_figures
from schedkit.engine.messages import LoadReport, engine_decoder, engine_encoder
from schedkit.errors import RouteRefusedError
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.workloads import WorkloadRequest
from schedkit.runners.cost_model import CostModel

BASE, PER_TOKEN = 0.01, 0.001
"""The hand-set cost model: every step costs BASE plus PER_TOKEN per token computed."""
CLASSES = {"interactive": {"ttft_s": 0.2}, "chat": {"ttft_s": 0.5, "tpot_s": 0.015}, "batch": {"ttft_s": 30.0}}


def linear(budget: int = 100, max_seqs: int = 8, chunk: int = 0, **coefficients: float) -> LatencyPredictor:
    coef = {"base_s": BASE, "per_token_s": PER_TOKEN, **coefficients}
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                            long_prefill_token_threshold=chunk)
    return LatencyPredictor(CostModel.from_coefficients(coef), sched)


def step(tokens: float) -> float:
    return BASE + PER_TOKEN * tokens


def make_router(tmp_path, policy: str = "slo-headroom", n: int = 3, *, settings=None, extra=(),
                budget: int = 100) -> Router:
    profile = tmp_path / "linear.json"
    profile.write_text(json.dumps({"name": "linear", "coefficients": {
        "base_s": BASE, "per_token_s": PER_TOKEN, "per_request_s": 0, "per_context_token_s": 0,
        "per_prefill_attention_s": 0}}))
    plugins = [{"name": policy, "settings": settings}] if settings else []
    cfg = config_from_dict({"replicas": {"count": n}, "slo_classes": CLASSES,
                            "scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": 8},
                            "router": {"policy": policy, "plugins": plugins, "latency_profile": str(profile)}})
    return Router(cfg, extra_plugins=extra)


def queue(router: Router, index: int, tokens: int, *, requests: int = 1, now: float = 0.0) -> None:
    """Replica ``index`` reports ``requests`` waiting requests of ``tokens`` prompt tokens in all."""
    router.update_load(index, num_waiting=requests, num_running=0, kv_cache_usage=0.0,
                       num_prefill_tokens=tokens, num_prefill_requests=requests,
                       prefill_attention=tokens * tokens / requests / 2, now=now)


def outstanding(router: Router, index: int, n: int) -> None:
    """``n`` requests routed to replica ``index`` (and reported by it: they run there)."""
    r = router.replicas[index]
    for k in range(n):
        rid = f"load-{index}-{k}"
        router._placed[rid] = (router.make_request(rid, [1]), index)
    r.num_outstanding += n
    r.num_running += n


def send(router: Router, rid: str, n: int = 40, slo_class: str | None = "interactive", now: float = 0.0) -> int:
    hints = RequestHints(slo_class=slo_class) if slo_class else RequestHints()
    return router.route(router.make_request(rid, list(range(1, n + 1)), hints=hints), now=now).index


# ------------------------------------------------------------------ the predictor
def test_idle_replica_prefills_in_budget_sized_steps():
    est = linear().predict(ReplicaState(0), 250, 0, now=5.0)
    assert est.ttft_s == pytest.approx(step(100) + step(100) + step(50))
    assert est.tpot_s == pytest.approx(step(1))


def test_queue_ahead_and_decodes_share_the_budget():
    # 2 decoding requests, one 150-token prompt waiting; the report is fresh (now).
    r = ReplicaState(0, num_waiting=1, num_running=2, num_prefill_tokens=150, num_prefill_requests=1,
                     prefill_attention=150 * 75, num_context_tokens=100, reported_at=1.0)
    est = linear().predict(r, 40, 0, now=1.0)
    # step 1: 2 decodes + 98 of the queued prompt; step 2: 2 decodes, its last 52, our 40
    assert est.ttft_s == pytest.approx(step(100) + step(2 + 52 + 40))
    assert est.tpot_s == pytest.approx(step(4))  # both decodes, the queued one, ours


def test_step_in_progress_ends_before_the_request_starts():
    # 4 decoding requests; their step began when the report came, 5 ms ago.
    r = ReplicaState(0, num_running=4, num_context_tokens=400, reported_at=0.995)
    est = linear().predict(r, 50, 0, now=1.0)
    assert est.ttft_s == pytest.approx(step(4) - 0.005 + step(4 + 50))


def test_cached_prefix_chunk_cap_and_attention():
    # 20 of 100 prompt tokens cached; at most 30 tokens of a prompt per step, unless alone.
    est = linear(chunk=30).predict(ReplicaState(0, num_running=1), 100, 20, now=0.0)
    assert est.ttft_s == pytest.approx(step(1 + 30) + step(1 + 30) + step(1 + 20))
    assert linear(chunk=30).predict(ReplicaState(0), 100, 20, now=0.0).ttft_s == pytest.approx(step(80))
    att = 1e-6
    est = linear(per_prefill_attention_s=att).predict(ReplicaState(0), 250, 0, now=0.0)
    chunks = 100 * 50 + 100 * 150 + 50 * 225  # n * (computed + n / 2) per step: 250**2 / 2
    assert est.ttft_s == pytest.approx(step(250) + 2 * BASE + att * chunks)
    assert prefill_work(100, 100)[:2] == (1, 99)  # a whole-prompt hit recomputes its last token


def test_requests_routed_since_the_report_count_ahead(tmp_path):
    router = make_router(tmp_path, "least-outstanding", n=1)
    router.update_load(0, num_waiting=0, num_running=0, kv_cache_usage=0.0, now=0.0)
    alone = router.estimate(router.make_request("probe", [1] * 40), 0, now=0.0).ttft_s
    assert alone == pytest.approx(step(40))
    for i in range(2):
        send(router, f"r{i}", 80, slo_class=None)
    # the router asked for predictions only through a plugin that takes them
    assert not router.predicts
    router2 = make_router(tmp_path, n=1)
    router2.update_load(0, num_waiting=0, num_running=0, kv_cache_usage=0.0, now=0.0)
    for i in range(2):
        send(router2, f"r{i}", 80, slo_class=None)
    est = router2.estimate(router2.make_request("probe", [1] * 40), 0, now=0.0)
    # 160 unreported tokens, then ours: step 1, 80 + 20; step 2, the first one's decode,
    # the second's last 60 and 39 of ours; step 3, two decodes and our last token
    assert est.ttft_s == pytest.approx(step(100) + step(1 + 60 + 39) + step(3))
    router2.update_load(0, num_waiting=2, num_running=0, kv_cache_usage=0.0, num_prefill_tokens=160,
                        num_prefill_requests=2, prefill_attention=2 * 80 * 40, now=0.0)
    assert router2.estimate(router2.make_request("probe", [1] * 40), 0, now=0.0) == est  # now reported


def test_engine_load_figures():
    cfg = config_from_dict({"runner": {"kind": "fake"}, "scheduler": {"max_num_batched_tokens": 64},
                            "cache": {"enable_prefix_caching": False}})
    engine = EngineCore(cfg)
    for i, n in enumerate((40, 50, 30)):
        engine.add_request(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=5),
                                   arrival_time=engine.now()))
    f = load_figures(engine.scheduler)
    assert (f.num_waiting, f.num_running, f.num_prefill_tokens, f.num_prefill_requests) == (3, 0, 120, 3)
    assert f.prefill_attention == 40 * 20 + 50 * 25 + 30 * 15
    engine.step()  # 40 of r0, then 24 of r1
    f = load_figures(engine.scheduler)
    assert (f.num_waiting, f.num_running, f.num_prefill_tokens, f.num_prefill_requests) == (1, 2, 56, 2)
    assert f.prefill_attention == 26 * (24 + 13) + 30 * 15
    assert f.num_context_tokens == 40  # r0 decodes
    assert f.decode_tokens_left == (4,)  # r0 has 4 of its 5 tokens to make
    assert f.prefill_queue == ((26, 24, 5), (30, 0, 5))  # r1 running, then r2 waiting
    assert load_figures(engine.scheduler, detail=False)[3:] == (0, 0, 0.0, 0, (), ())


# ------------------------------------------------------------------ admission
class RefusePastDeadline:
    """Refuse a request whose first token no replica is predicted to give within its
    deadline (``hints.deadline_s``); no opinion on the others."""

    @hookimpl
    def schedkit_router_admit(self, request, replicas, latency):
        deadline = request.hints.deadline_s
        if deadline is None or latency is None:
            return None
        best = min(latency.estimate(request, r).ttft_s for r in replicas)
        if best <= deadline:
            return None
        return RouteAdmission(RouteVerdict.REFUSE, f"first token predicted in {best:.2f} s, "
                                                   f"past the {deadline:g} s deadline")


def test_hook_schedkit_router_admit(tmp_path):
    router = make_router(tmp_path, "least-outstanding", extra=[RefusePastDeadline()])
    assert router.predicts
    for i in range(3):
        queue(router, i, 300 * (i + 1))  # 0.33 s, 0.66 s, 0.99 s of prefill queued
    soon = router.make_request("soon", [1] * 40, hints=RequestHints(deadline_s=0.5))
    assert router.route(soon, now=0.0).index == 0
    late = router.make_request("late", [1] * 40, hints=RequestHints(deadline_s=0.1))
    with pytest.raises(RouteRefusedError, match=r"refused by router plugin 'RefusePastDeadline-0': "
                                                r"first token predicted in 0.38 s, past the 0.1 s deadline"):
        router.route(late, now=0.0)
    assert router.stats()["num_refused"] == {"-": 1}  # it had no SLO class
    assert router.route(router.make_request("any", [1] * 40), now=0.0).index in (1, 2)


def test_slo_headroom_refuses_what_no_replica_can_meet(tmp_path):
    router = make_router(tmp_path, settings={"on_miss": "refuse"})
    for i in range(3):
        queue(router, i, 1000)  # 10+ steps of prefill ahead everywhere: ~1.1 s
    with pytest.raises(RouteRefusedError, match="SLO class 'interactive'") as info:
        send(router, "late")
    e = info.value
    assert (e.plugin, e.slo_class, e.request_id) == ("slo-headroom", "interactive", "late")
    assert "TTFT target of 0.2 s" in e.reason and "predicts 1.1" in e.reason
    assert router.replica_of("late") is None and all(r.num_outstanding == 0 for r in router.replicas)
    assert send(router, "patient", slo_class="batch") in (0, 1, 2)  # 30 s is within reach
    assert router.stats()["num_refused"] == {"interactive": 1}


def test_routes_to_a_replica_that_meets_the_class_least_loaded_among_them(tmp_path):
    router = make_router(tmp_path)
    queue(router, 0, 1000)  # the least loaded by outstanding requests, but 1.1 s of prefill queued
    outstanding(router, 1, 3)
    outstanding(router, 2, 2)
    lo = make_router(tmp_path, "least-outstanding")
    queue(lo, 0, 1000)
    outstanding(lo, 1, 3)
    outstanding(lo, 2, 2)
    assert send(lo, "x") == 0
    assert send(router, "x") == 2  # 1 and 2 both meet 0.2 s; 2 has fewer outstanding
    assert send(router, "y") in (1, 2)  # now 3 and 3: either
    assert send(router, "z", slo_class=None) == 0  # no class: least outstanding
    assert router.stats()["num_refused"] == router.stats()["num_downgraded"] == {}


def test_least_headroom_packs_a_class_where_it_just_fits(tmp_path):
    routers = {prefer: make_router(tmp_path, settings={"prefer": prefer})
               for prefer in ("least-loaded", "least-headroom")}
    for router in routers.values():
        queue(router, 0, 100)  # 0.16 s to a first token: within interactive's 0.2 s
        outstanding(router, 0, 1)
        queue(router, 1, 300)  # 0.38 s: over it
    assert send(routers["least-loaded"], "x") == 2  # idle, 0.05 s, and nothing outstanding
    assert send(routers["least-headroom"], "x") == 0  # the one it just fits, 2 left for a tighter class


def test_tpot_target_counts_too(tmp_path):
    router = make_router(tmp_path)
    outstanding(router, 0, 1)
    router.update_load(0, num_waiting=0, num_running=7, kv_cache_usage=0.0, now=0.0)  # 6 not routed here
    outstanding(router, 1, 3)
    outstanding(router, 2, 2)
    assert send(router, "c", slo_class="chat") == 2  # on 0 it would decode in 8-row steps: 18 ms > 15 ms
    assert send(router, "i") == 0  # interactive sets no TPOT target: the least outstanding


def test_downgrade_routes_best_effort_and_counts(tmp_path):
    router = make_router(tmp_path)  # on_miss: downgrade (the default)
    queue(router, 0, 1500)
    queue(router, 1, 600)
    queue(router, 2, 900)
    assert send(router, "late") == 1  # the one predicted closest to its target
    assert router.stats()["num_downgraded"] == {"interactive": 1}
    assert router.stats()["latency_profile"] == "linear"


class BrokenAdmission:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl(tryfirst=True)
    def schedkit_router_admit(self, request, latency):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", [RuntimeError("boom"), "refuse", RouteAdmission("refuse", "no"),
                                    RouteAdmission(RouteVerdict.REFUSE, 42)])
def test_a_failing_admission_plugin_is_skipped(tmp_path, answer):
    router = make_router(tmp_path, settings={"on_miss": "refuse"}, extra=[BrokenAdmission(answer)])
    assert send(router, "ok") in (0, 1, 2)  # the built-in slo-headroom admits it
    assert sum(router.errors.values()) == 1
    [(plugin, hook)] = router.errors
    assert hook == "schedkit_router_admit" and plugin.startswith("BrokenAdmission")


class CrashingLatencyScorer:
    @hookimpl
    def schedkit_router_score(self, request, replicas, latency):
        latency.estimate(request, replicas[0])
        raise ZeroDivisionError("bad day")


def test_a_crashing_latency_scorer_keeps_serving(tmp_path):
    router = make_router(tmp_path, extra=[CrashingLatencyScorer()])
    queue(router, 0, 1000)
    assert send(router, "x") in (1, 2)
    assert router.errors == {("CrashingLatencyScorer-0", "schedkit_router_score"): 1}
    admit = RouteAdmission(RouteVerdict.ADMIT)
    r2 = make_router(tmp_path, settings={"on_miss": "refuse"}, extra=[BrokenAdmission(admit)])
    for i in range(3):
        queue(r2, i, 1000)
    assert send(r2, "vip") in (0, 1, 2)  # admitted by the first plugin to answer
    assert r2.stats()["num_refused"] == {}


def test_latency_needs_a_profile_and_settings_are_checked(tmp_path):
    cfg = config_from_dict({"replicas": {"count": 2}, "router": {"policy": "slo-headroom"}})
    with pytest.raises(ConfigError, match=r"\['slo-headroom'\].*router.latency_profile"):
        Router(cfg)
    with pytest.raises(PluginError, match="on_miss must be 'downgrade' or 'refuse'"):
        make_router(tmp_path, settings={"on_miss": "drop"})
    with pytest.raises(PluginError, match="prefer must be 'least-loaded' or 'least-headroom'"):
        make_router(tmp_path, settings={"prefer": "fastest"})
    with pytest.raises(PluginError, match="margin must be >= 0"):
        make_router(tmp_path, settings={"margin": -1})
    with pytest.raises(ConfigError, match=r"slo_class 'gold' is not one of the config's slo_classes"):
        config_from_dict({"workload": {"tenants": [{"name": "a", "slo_class": "gold"}]}})
    sim = config_from_dict({"replicas": {"count": 2}, "runner": {"kind": "simulated"},
                            "router": {"policy": "slo-headroom"}})
    assert Router(sim).latency_predictor is not None  # the simulated runner's profile


# ------------------------------------------------------------------ the reports and the simulation
def test_a_load_report_carries_the_figures_over_the_wire(tmp_path):
    report = LoadReport(3, 1, 2, 0.5, [], 180, 2, 9000.0, 77, [4, 9], [(100, 20, 8), (80, 0, 16)])
    back = engine_decoder.decode(engine_encoder.encode(report))
    assert back == report
    router = make_router(tmp_path, n=1)
    router.update_load(0, num_waiting=back.num_waiting, num_running=back.num_running,
                       kv_cache_usage=back.kv_cache_usage, num_prefill_tokens=back.num_prefill_tokens,
                       num_prefill_requests=back.num_prefill_requests, prefill_attention=back.prefill_attention,
                       num_context_tokens=back.num_context_tokens, decode_tokens_left=back.decode_tokens_left,
                       prefill_queue=back.prefill_queue, now=2.0)
    r = router.replicas[0]
    assert r.decode_tokens_left == (4, 9) and r.prefill_queue == ((100, 20, 8), (80, 0, 16))


class Predictions:
    """Record the prediction for the replica each request went to."""

    def __init__(self):
        self.seen = {}
        self.chosen = {}

    @hookimpl
    def schedkit_router_score(self, request, replicas, latency):
        self.seen = {r.index: latency.estimate(request, r) for r in replicas}

    @hookimpl
    def schedkit_on_route_event(self, event):
        if event.kind.value == "routed":
            self.chosen[event.request.request_id] = self.seen[event.replica.index]


def sim_config(**more):
    return config_from_dict({"runner": {"kind": "simulated", "profile": "cpu-tiny-llama"},
                             "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 8},
                             "cache": {"enable_prefix_caching": False}, **more})


def test_predictions_equal_the_simulator_when_no_request_arrives_later():
    """Each request arrives while the ones before it decode (a step in progress), and
    the next arrives after its first token: the replay is the simulator's own."""
    workload = [WorkloadRequest(f"r{i}", 0.3 * i, [(7 * i + k) % 500 + 1 for k in range(100 + 40 * i)], 400)
                for i in range(6)]
    rec = Predictions()
    run = run_cluster_workload(sim_config(replicas={"count": 1}, router={"policy": "least-outstanding"}),
                               workload, router_extra_plugins=[rec])
    assert len(run.metrics) == 6 and all(m.ttft is not None for m in run.metrics)
    for m in run.metrics:
        assert rec.chosen[m.request_id].ttft_s == pytest.approx(m.ttft, rel=1e-9, abs=1e-12), m.request_id
    assert run.metrics[-1].num_output_tokens == 400  # they overlapped: the last one ran alone at the end


def test_the_simulation_gives_tenants_their_class_and_counts_refusals():
    config = sim_config(
        replicas={"count": 2}, slo_classes={"instant": {"ttft_s": 1e-6}, "relaxed": {"ttft_s": 60}},
        router={"policy": "slo-headroom", "plugins": [{"name": "slo-headroom", "settings": {"on_miss": "refuse"}}]},
        workload={"kind": "poisson", "rate": 50, "num_requests": 40, "output_len": [4, 16],
                  "tenants": [{"name": "a", "slo_class": "instant"}, {"name": "b", "slo_class": "relaxed"}],
                  "slo": {"by_tenant": {"a": {"ttft_s": 1e-6}, "b": {"ttft_s": 60}}}})
    run = run_cluster_workload(config)
    summary = summarize_cluster(config, run)
    by_tenant = {t: [m for m in run.metrics if m.tenant == t] for t in ("a", "b")}
    assert by_tenant["a"] and by_tenant["b"]
    assert all(m.rejected and m.rejected_by == "slo-headroom" for m in by_tenant["a"])
    assert all(m.ttft is not None for m in by_tenant["b"])
    assert summary["router"]["num_refused"] == {"instant": len(by_tenant["a"])}
    assert summary["overall"]["by_tenant"]["b"]["slo_attainment"] == 1.0
    assert sum(r["requests"] for r in summary["replicas"]) == len(by_tenant["b"])
