"""VirtualTokenCounter: bounded service difference between backlogged tenants."""

from __future__ import annotations

import pytest

from schedkit.core.request import EventType
from schedkit.policies.vtc import VirtualTokenCounter, VTCQueue

from ._harness import req, run

W_IN, W_OUT = 1.0, 2.0
PROMPT, OUTPUT = 32, 16
COST = W_IN * PROMPT + W_OUT * OUTPUT  # the service one request receives


def two_tenants() -> list:
    """Tenant A sends a request every 10 ms, B every 30 ms; four slots serve ~25/s, so
    both are backlogged for most of the run."""
    reqs = [req(f"a{i}", PROMPT, t=i * 0.01, max_tokens=OUTPUT, tenant="A") for i in range(100)]
    reqs += [req(f"b{i}", PROMPT, t=i * 0.03, max_tokens=OUTPUT, tenant="B") for i in range(34)]
    return reqs


def serve_measuring(plugins, reqs, weights=None, **kw):
    """Run, measuring weighted service per tenant independently of the plugin; return the
    run, the service, and (A - B) at every step end where both tenants had requests waiting."""
    service = {"A": 0.0, "B": 0.0}
    weights = weights or {}
    diffs: list[float] = []

    def on_step(res, out, outputs):
        starts = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        starts += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for rid, start in starts:
            r = res.requests[rid]
            n = max(0, min(start + out.num_scheduled_tokens[rid], r.num_prompt_tokens) - start)
            service[r.tenant] += W_IN * n / weights.get(r.tenant, 1.0)
        for group in outputs.values():
            for o in group.outputs:
                t = res.requests[o.request_id].tenant
                service[t] += W_OUT * len(o.new_token_ids) / weights.get(t, 1.0)
        if {r.tenant for r in res.sched.waiting} >= {"A", "B"}:
            diffs.append(service["A"] - service["B"])

    res = run(reqs, plugins, on_step=on_step, max_num_seqs=4, **kw)
    return res, service, diffs


def test_vtc_keeps_the_service_difference_bounded_while_fcfs_does_not():
    vtc = VirtualTokenCounter(input_weight=W_IN, output_weight=W_OUT)
    res, service, diffs = serve_measuring([vtc], two_tenants(), check=True, num_blocks=64)
    _, _, fcfs_diffs = serve_measuring([], two_tenants())
    assert len(diffs) > 200  # both tenants were backlogged for most of the run
    assert max(abs(d) for d in diffs) <= 4 * COST  # measured: 130 (about two requests)
    # FCFS gives A three times B's share: the difference grows with time, without bound.
    assert abs(fcfs_diffs[-1]) > 40 * COST
    quarter = fcfs_diffs[len(fcfs_diffs) // 4]
    assert abs(fcfs_diffs[-1]) > 3 * abs(quarter)
    # The plugin charged exactly the service measured (nothing was preempted); its
    # counters are at least that (lifts only raise them).
    assert res.sched.num_preemptions_total == 0
    assert vtc.served == pytest.approx(service)
    assert all(vtc.counters[t] >= vtc.served[t] for t in service)


def test_tenant_weights_give_proportional_shares():
    vtc = VirtualTokenCounter(tenant_weights={"A": 3.0})
    res, service, diffs = serve_measuring([vtc], two_tenants(), weights={"A": 3.0})
    assert max(abs(d) for d in diffs) <= 4 * COST  # weighted service stays level
    n_a = sum(1 for r in res.admitted[:60] if r.startswith("a"))
    assert 40 <= n_a <= 50  # A gets about 3/4 of the admissions while both wait


def _admitted_after(res, t: float) -> list[str]:
    return [r for r in res.admitted if res.first(r, EventType.SCHEDULED) >= t]


def test_a_tenant_back_from_idle_is_lifted_to_the_backlogged_minimum(monkeypatch):
    def reqs():
        return ([req(f"a{i}", PROMPT, t=0.0, max_tokens=OUTPUT, tenant="A") for i in range(40)]
                + [req(f"b{i}", PROMPT, t=1.0, max_tokens=OUTPUT, tenant="B") for i in range(10)])

    res = run(reqs(), [VirtualTokenCounter()], max_num_seqs=4)
    after = _admitted_after(res, 1.0)
    upto_b9 = after[: after.index("b9")]
    assert sum(r.startswith("a") for r in upto_b9) >= 5  # A keeps its share
    # Without the lift, B's idle second is banked as credit and B takes every slot.
    monkeypatch.setattr(VTCQueue, "_lift", lambda self, tenant: None)
    res = run(reqs(), [VirtualTokenCounter()], max_num_seqs=4)
    assert _admitted_after(res, 1.0)[:10] == [f"b{i}" for i in range(10)]


def test_with_an_empty_queue_the_new_tenant_starts_at_the_last_leavers_counter(monkeypatch):
    def reqs():
        return ([req(f"a{i}", PROMPT, t=0.0, max_tokens=OUTPUT, tenant="A") for i in range(4)]
                + [req(f"b{i}", PROMPT, t=0.5, max_tokens=OUTPUT, tenant="B") for i in range(6)]
                + [req(f"c{i}", PROMPT, t=0.5, max_tokens=OUTPUT, tenant="A") for i in range(6)])

    res = run(reqs(), [VirtualTokenCounter()], max_num_seqs=4)
    assert res.admitted[4:10] == ["b0", "c0", "b1", "c1", "b2", "c2"]
    monkeypatch.setattr(VTCQueue, "_lift", lambda self, tenant: None)
    res = run(reqs(), [VirtualTokenCounter()], max_num_seqs=4)
    assert res.admitted[4:8] == ["b0", "b1", "b2", "b3"]


def test_prompt_recomputation_after_preemption_is_not_charged_again():
    # Two long-output requests in a tiny KV cache: one is preempted and recomputed.
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=0.0)
    reqs = [req("x", 40, max_tokens=60, tenant="X"), req("y", 40, max_tokens=60, tenant="Y")]
    res = run(reqs, [vtc], block_size=16, num_blocks=9, max_num_seqs=2, check=True)
    assert res.sched.num_preemptions_total > 0
    assert vtc.served == {"X": 40.0, "Y": 40.0}


@pytest.mark.parametrize("kwargs, name", [
    ({"input_weight": -1}, "input_weight"), ({"output_weight": "2"}, "output_weight"),
    ({"input_weight": 0, "output_weight": 0}, "input_weight"),
    ({"tenant_weights": {"A": 0}}, "tenant_weights"), ({"tenant_weights": {1: 1.0}}, "tenant_weights"),
    ({"tenant_weights": "A=2"}, "tenant_weights"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        VirtualTokenCounter(**kwargs)
