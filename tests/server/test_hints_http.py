"""Hints over HTTP: body fields and ``x-schedkit-*`` headers reach the engine's hooks,
bad ones are 400s naming the field or header, and a header that contradicts the body is
refused."""

from __future__ import annotations

import pytest

from tests.server.conftest import server_config

GATE = '''
from schedkit import hookimpl, Rejection


class HintGate:
    """Rejects every request, telling what it saw: the 429's message shows the hints."""

    @hookimpl
    def schedkit_admit_request(self, request, num_running, kv_cache_usage, now):
        h = request.hints
        return Rejection(f"saw class={h.slo_class} deadline={h.deadline_s} expects={h.expected_output_tokens} "
                         f"session={h.session_id} tenant={request.tenant} priority={request.priority} "
                         f"ttft={request.ttft_slo_s} tpot={request.tpot_slo_s}")
'''

CLASSES = {"interactive": {"ttft_s": 0.5, "tpot_s": 0.05}, "batch": {"e2e_s": 600}}


@pytest.fixture
def gated(serve, word_tokenizer, install_plugin):
    install_plugin("hint_gate", GATE, {"hint-gate": "hint_gate:HintGate"})
    return serve(server_config(word_tokenizer, plugins=[{"name": "hint-gate"}], slo_classes=CLASSES))


def seen(r) -> str:
    assert r.status_code == 429, r.text
    return r.json()["error"]["message"].split("saw ", 1)[1]


def test_hints_from_the_body_and_from_headers_reach_the_hooks(gated):
    with gated.client() as c:
        body = {"model": "word-model", "prompt": "w7 w8", "max_tokens": 2, "slo_class": "interactive",
                "deadline_s": 4.5, "expected_output_tokens": 12, "session_id": "chat-1", "user": "acme",
                "priority": 3}
        assert seen(c.post("/v1/completions", json=body)) == (
            "class=interactive deadline=4.5 expects=12 session=chat-1 tenant=acme priority=3 ttft=0.5 tpot=0.05")
        headers = {"x-schedkit-slo-class": "batch", "x-schedkit-deadline-s": "30",
                   "x-schedkit-expected-output-tokens": "7", "x-schedkit-session-id": "agent-9",
                   "x-schedkit-tenant": "beta", "x-schedkit-priority": "-2", "x-schedkit-ttft-slo-s": "2.5"}
        r = c.post("/v1/chat/completions", headers=headers, json={
            "model": "word-model", "messages": [{"role": "user", "content": "w7"}], "max_tokens": 2})
        assert seen(r) == ("class=batch deadline=30.0 expects=7 session=agent-9 tenant=beta priority=-2 "
                           "ttft=2.5 tpot=None")
        # A header that agrees with the body is fine.
        r = c.post("/v1/completions", headers={"x-schedkit-slo-class": "batch"},
                   json={"model": "word-model", "prompt": "w7", "max_tokens": 2, "slo_class": "batch"})
        assert seen(r).startswith("class=batch ")


@pytest.mark.parametrize(("body", "headers", "param", "words"), [
    ({"slo_class": "gold"}, {}, "slo_class", "not one of the server's SLO classes (batch, interactive)"),
    ({"slo_class": "has space"}, {}, "slo_class", "should match pattern"),
    ({"deadline_s": -1}, {}, "deadline_s", "greater than 0"),
    ({"deadline_s": 1e9}, {}, "deadline_s", "less than or equal"),
    ({"expected_output_tokens": 1.5}, {}, "expected_output_tokens", "integer"),
    ({"expected_output_tokens": -3}, {}, "expected_output_tokens", "greater than or equal to 0"),
    ({}, {"x-schedkit-deadline-s": "soon"}, "x-schedkit-deadline-s", "is not a number"),
    ({}, {"x-schedkit-deadline-s": "-5"}, "x-schedkit-deadline-s", "greater than 0"),
    ({}, {"x-schedkit-priority": "1.5"}, "x-schedkit-priority", "is not an integer"),
    ({}, {"x-schedkit-slo-class": "gold"}, "slo_class", "not one of the server's SLO classes"),
    ({}, {"x-schedkit-slo-class": "a/b"}, "x-schedkit-slo-class", "pattern"),
    ({"slo_class": "batch"}, {"x-schedkit-slo-class": "interactive"}, "x-schedkit-slo-class", "differ"),
    ({"user": "a"}, {"x-schedkit-tenant": "b"}, "x-schedkit-tenant", "differ"),
])
def test_bad_hints_are_400s_naming_what_is_wrong(gated, body, headers, param, words):
    with gated.client() as c:
        r = c.post("/v1/completions", headers=headers,
                   json={"model": "word-model", "prompt": "w7", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        assert seen(c.post("/v1/completions", json={"model": "word-model", "prompt": "w7", "max_tokens": 2}))


def test_more_tenants_than_labels_keep_the_metric_labels_bounded(serve, word_tokenizer):
    """Each tenant header is accepted; /metrics labels at most ``max_tenant_labels`` of them
    and counts the rest as "other"."""
    s = serve(server_config(word_tokenizer))
    with s.client() as c:
        for i in range(300):
            r = c.post("/v1/completions", headers={"x-schedkit-tenant": f"t{i}"},
                       json={"model": "word-model", "prompt": "w7", "max_tokens": 1})
            assert r.status_code == 200, r.text
    labels = {k for k in s.stats() if k.startswith("schedkit:tenant_prompt_tokens_total{")}
    assert len(labels) == 65 and any('tenant="other"' in k for k in labels)


def test_attainment_is_counted_per_slo_class(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, slo_classes={
        "roomy": {"ttft_s": 600, "e2e_s": 600}, "hopeless": {"ttft_s": 1e-9}, "idle": {"tpot_s": 1}}))
    with s.client() as c:
        for cls in ("roomy", "roomy", "hopeless"):
            r = c.post("/v1/completions", json={"model": "word-model", "prompt": "w7 w8", "max_tokens": 3,
                                                "slo_class": cls})
            assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": "word-model", "prompt": "w7", "max_tokens": 3})
        assert r.status_code == 200, r.text  # no class: counted under none
    st = s.stats()
    from tests.server.conftest import metric

    assert [metric(st, "schedkit:slo_class_requests_total", slo_class=k) for k in ("roomy", "hopeless", "idle")] \
        == [2, 1, 0]
    assert [metric(st, "schedkit:slo_class_slo_met_total", slo_class=k) for k in ("roomy", "hopeless", "idle")] \
        == [2, 0, 0]
    assert metric(st, "schedkit:slo_class_requests_total") == 3
