"""docs/grafana/schedkit-dashboard.json: valid dashboard JSON, and its queries match what a
live ``schedkit serve`` exposes on /metrics, both ways (every series a panel reads exists;
every metric family the server exposes is on some panel), for a single-engine server and
for one with ``replicas.count: 2``: the families only a replicated server has (per replica,
the router's) are read on the "Replicas and router" row's panels and nowhere else; and the
families a disaggregated, a migrating or a flow-controlled server adds are exactly those
on its own row."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import LiveServer, server_config, start_server, stop_server

pytestmark = pytest.mark.slow  # servers scraped for every dashboard series

httpx = pytest.importorskip("httpx")

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "schedkit-dashboard.json"
_METRIC = re.compile(r"schedkit:[A-Za-z0-9_]+")
_TYPE = re.compile(r"^# TYPE (schedkit:\S+) (\w+)$", re.M)
_SUFFIXES = ("_bucket", "_sum", "_count")

# Counters labelled by plugin that have no series until a plugin rejects a request or a hook
# fails; on the default server (fcfs, no failing plugin) only their # TYPE line is there.
NO_SAMPLES_ON_DEFAULT_SERVER = {"schedkit:admission_rejections_total", "schedkit:hook_errors_total",
                                 # by SLO class: none without slo_classes in the config
                                 "schedkit:slo_class_requests_total", "schedkit:slo_class_slo_met_total"}
REPLICA_ROW = "Replicas and router"
# The families only a server with replicas exposes: per replica, and the router's.
REPLICA_ONLY = ("schedkit:replica_", "schedkit:router_")
DISAGG_ROW = "Disaggregation"
# The families only a server with replicas.roles exposes: KV hand-offs, queues per role.
DISAGG_ONLY = ("schedkit:kv_transfer_", "schedkit:role_")
MIGRATION_ROW = "Live migration"
# The families only a server with a migration plugin exposes: the moved requests' KV.
MIGRATION_ONLY = ("schedkit:migration_",)
FLOW_ROW = "Flow control"
# The families only a server with flow_control.enabled exposes: the front door's.
FLOW_ONLY = ("schedkit:flow_",)
OPTIONAL_ROWS = (DISAGG_ROW, MIGRATION_ROW, FLOW_ROW)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def row_of(dashboard: dict[str, Any]) -> dict[int, str | None]:
    """Panel id -> the title of the (expanded) row it sits in, None above the first row: in
    Grafana a row holds the panels below it up to the next row."""
    rows = sorted((p["gridPos"]["y"], p["title"]) for p in dashboard["panels"] if p["type"] == "row")
    out: dict[int, str | None] = {}
    for p in dashboard["panels"]:
        if p["type"] != "row":
            above = [title for y, title in rows if y <= p["gridPos"]["y"]]
            out[p["id"]] = above[-1] if above else None
    return out


def referenced_by_row(dashboard: dict[str, Any], row: str = REPLICA_ROW) -> tuple[set[str], set[str]]:
    """``(series the panels of ``row`` read, series read anywhere else but on the
    optional rows: disaggregation, migration, flow control)``, the template variables'
    queries counted as elsewhere."""
    rows = row_of(dashboard)
    inside: set[str] = set()
    outside = {m for e in variable_queries(dashboard) for m in _METRIC.findall(e)}
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            if rows.get(p["id"]) == row:
                inside.update(_METRIC.findall(t["expr"]))
            elif rows.get(p["id"]) not in OPTIONAL_ROWS:
                outside.update(_METRIC.findall(t["expr"]))
    return inside, outside


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def scrape(server: LiveServer) -> tuple[dict[str, str], set[str]]:
    """``(family name -> type, sample names)`` of the server's /metrics. Families are named as
    the exposition names them (counters with ``_total``); prometheus_client's ``_created``
    timestamps are left out (no panel wants when a counter was created)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    families = dict(_TYPE.findall(text))
    for name in [n for n in families if n.endswith("_created")]:
        base = name.removesuffix("_created")
        if base + "_total" in families or families.get(base) == "histogram":
            del families[name]
    samples = {key.partition("{")[0] for key in server.stats()}
    return families, samples


def series_family(name: str, families: dict[str, str]) -> str | None:
    """The family a series name belongs to, or None when the server exposes no such family."""
    if name in families:
        return name
    for suffix in _SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and families.get(base) == "histogram":
            return base
    return None


def traffic(server: LiveServer) -> None:
    """Enough requests that every histogram and counter of the default server has samples:
    plain and streamed completions from two tenants (one in a session), a chat, and one 400."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "w7 w8", "max_tokens": 3, "session_id": "s1"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": "w7 w8 w9", "max_tokens": 3, "user": "alice",
                                             "stream": True})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w9"}],
                                                  "max_tokens": 2, "user": "bob"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text


@pytest.fixture(scope="module")
def single(live: LiveServer) -> tuple[dict[str, str], set[str]]:
    """The default single-engine server's ``scrape`` after ``traffic``."""
    traffic(live)
    return scrape(live)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, word_tokenizer) -> Iterator[tuple[dict[str, str], set[str]]]:
    """``scrape`` of a server with two replicas (fake runner) behind the default router,
    after ``traffic``."""
    s = start_server(tmp_path_factory.mktemp("replicated"),
                     server_config(word_tokenizer, replicas={"count": 2}))
    try:
        traffic(s)
        yield scrape(s)
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory, word_tokenizer) -> Iterator[tuple[dict[str, str], set[str]]]:
    """``scrape`` of a server with one prefill and one decode replica (fake runner), every
    request split, after ``traffic``."""
    s = start_server(tmp_path_factory.mktemp("disaggregated"),
                     server_config(word_tokenizer, replicas={"count": 2, "roles": {"prefill": 1, "decode": 1}},
                                   router={"plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}))
    try:
        traffic(s)
        yield scrape(s)
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def flow_controlled(tmp_path_factory, word_tokenizer) -> Iterator[tuple[dict[str, str], set[str]]]:
    """``scrape`` of a server with two replicas (fake runner) behind flow control, after
    ``traffic``."""
    s = start_server(tmp_path_factory.mktemp("flow"),
                     server_config(word_tokenizer, replicas={"count": 2}, flow_control={"enabled": True}))
    try:
        traffic(s)
        yield scrape(s)
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def migrating(tmp_path_factory, word_tokenizer) -> Iterator[tuple[dict[str, str], set[str]]]:
    """``scrape`` of a server with two replicas (fake runner) and the ``rebalance``
    migration plugin, after ``traffic``."""
    s = start_server(tmp_path_factory.mktemp("migrating"),
                     server_config(word_tokenizer, replicas={"count": 2},
                                   router={"plugins": [{"name": "rebalance"}]}))
    try:
        traffic(s)
        yield scrape(s)
    finally:
        stop_server(s)


def check_kinds(names: set[str], families: dict[str, str]) -> None:
    for name in names:
        kind = families[series_family(name, families)]
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith(_SUFFIXES), f"{name}: read a histogram through its _bucket series"


def not_shown(families: dict[str, str], names: set[str]) -> list[str]:
    def shown(family: str) -> bool:
        return family + "_bucket" in names if families[family] == "histogram" else family in names

    return sorted(f for f in families if not shown(f))


def test_dashboard_is_valid(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = dashboard["panels"]
    assert panels
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), ids
    cells: set[tuple[int, int]] = set()
    for p in panels:
        where = f"panel {p['id']} ({p.get('title')!r})"
        assert p["type"] and p["title"], where
        g = p["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, where
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{where} overlaps another panel"
        cells |= mine
        if p["type"] == "row":  # expanded: its panels follow it in the list, none nested
            assert (g["x"], g["w"], g["h"]) == (0, 24, 1), where
            assert p["collapsed"] is False and p["panels"] == [] and "targets" not in p, where
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        targets = p["targets"]
        assert targets, where
        refs = [t["refId"] for t in targets]
        assert len(set(refs)) == len(refs), where
        for t in targets:
            assert isinstance(t["expr"], str) and t["expr"].strip(), where
            assert t["datasource"] == p["datasource"], where
            # every selector is on the chosen model
            for m in re.finditer(r"(schedkit:[A-Za-z0-9_]+)(\{[^}]*\})?", t["expr"]):
                assert m.group(2) and 'model_name="$model_name"' in m.group(2), f"{where}: {m.group(0)}"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert model["query"]["query"] == model["definition"] == "label_values(schedkit:num_requests_running, model_name)"
    rows = row_of(dashboard)
    assert [p["title"] for p in panels if p["type"] == "row"] == [REPLICA_ROW, "Structured outputs", DISAGG_ROW,
                                                                   MIGRATION_ROW, "SLO classes", FLOW_ROW]
    assert sum(r == REPLICA_ROW for r in rows.values()) >= 10
    # the row's panels come after it in the list, the others before it
    at = next(i for i, p in enumerate(panels) if p["type"] == "row")
    title = REPLICA_ROW
    assert all(rows[p["id"]] is None for p in panels[:at]), "a panel above the row is listed after it"
    for p in panels[at + 1:]:  # each row's panels come right after it
        if p["type"] == "row":
            title = p["title"]
        else:
            assert rows[p["id"]] == title, f"panel {p['title']!r} is listed under the wrong row"


def test_quantile_panels_read_rates_of_buckets(dashboard: dict[str, Any]) -> None:
    quantile_exprs = [e for e in panel_exprs(dashboard) if "histogram_quantile" in e]
    assert quantile_exprs
    for e in quantile_exprs:
        assert re.search(r"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(schedkit:\w+_bucket\{", e), e
    for e in panel_exprs(dashboard):
        for name in _METRIC.findall(e):
            if name.endswith("_total"):  # counters are only ever read as rates or increases
                assert re.search(rf"(rate|increase)\({re.escape(name)}\{{", e), e


def test_every_referenced_series_exists_and_every_family_is_shown(single, dashboard: dict[str, Any]) -> None:
    """The single-engine server: every series outside the replica row exists and has samples,
    the replica row's families are absent, and every family exposed is on a panel."""
    families, samples = single
    on_row, elsewhere = referenced_by_row(dashboard)
    unknown = sorted(n for n in elsewhere if series_family(n, families) is None)
    assert not unknown, f"the dashboard reads series the server does not expose: {unknown}"
    check_kinds(elsewhere, families)
    empty = {n for n in elsewhere if n not in samples}
    assert empty <= NO_SAMPLES_ON_DEFAULT_SERVER, f"no samples after traffic: {sorted(empty)}"
    assert not [f for f in families if f.startswith(REPLICA_ONLY)], families
    present = sorted(n for n in on_row if series_family(n, families) is not None)
    assert not present, f"the replica row reads series a single engine has: {present}"
    missing = not_shown(families, elsewhere)
    assert not missing, f"exposed on /metrics but on no panel outside the replica row: {missing}"


def test_replicated_server_series_are_on_the_replica_row(single, replicated,
                                                          dashboard: dict[str, Any]) -> None:
    """With two replicas: every series the dashboard reads exists and has samples (the panels
    above the row show the cluster's totals), and the families a single engine lacks are
    exactly the per-replica and router ones, each read on the replica row and only there."""
    single_families, _ = single
    families, samples = replicated
    on_row, elsewhere = referenced_by_row(dashboard)
    names = on_row | elsewhere
    unknown = sorted(n for n in names if series_family(n, families) is None)
    assert not unknown, f"the dashboard reads series the replicated server does not expose: {unknown}"
    check_kinds(names, families)
    empty = {n for n in names if n not in samples}
    assert empty <= NO_SAMPLES_ON_DEFAULT_SERVER, f"no samples after traffic: {sorted(empty)}"
    assert set(single_families) <= set(families)
    replica_only = set(families) - set(single_families)
    assert replica_only == {f for f in families if f.startswith(REPLICA_ONLY)}, sorted(replica_only)
    assert {"schedkit:replica_healthy", "schedkit:router_info"} <= replica_only, sorted(replica_only)
    missing = not_shown({f: families[f] for f in replica_only}, on_row)
    assert not missing, f"exposed with replicas but on no panel of the replica row: {missing}"
    misplaced = sorted(n for n in elsewhere if series_family(n, families) in replica_only)
    assert not misplaced, f"replica-only series read outside the replica row: {misplaced}"
    missing = not_shown(families, names)
    assert not missing, f"exposed on /metrics but on no panel: {missing}"


def test_policy_panels_see_an_admission_plugin(serve, word_tokenizer, dashboard: dict[str, Any]) -> None:
    """With edf rejecting every request (a prefill estimate no deadline survives), the
    rejections panel's series appears, labelled by the plugin, next to the 429s."""
    server = serve(server_config(word_tokenizer, scheduler={"policy": "edf"},
                                 plugins=[{"name": "edf", "settings": {"prefill_s_per_token": 1000.0}}]))
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "w7 w8", "max_tokens": 3})
    assert r.status_code == 429, r.text
    stats = server.stats()
    assert stats['schedkit:admission_rejections_total{model_name="word-model",plugin="edf"}'] == 1
    assert stats['schedkit:http_request_errors_total{model_name="word-model",status="429"}'] == 1
    assert any(k.startswith("schedkit:policy_info{") and 'policy="edf"' in k for k in stats)
    exprs = panel_exprs(dashboard)
    assert any("sum by (plugin) (rate(schedkit:admission_rejections_total{" in e for e in exprs)
    assert any("sum by (status) (rate(schedkit:http_request_errors_total{" in e for e in exprs)


@pytest.mark.parametrize(("server", "row", "prefixes"), [("disaggregated", DISAGG_ROW, DISAGG_ONLY),
                                                         ("migrating", MIGRATION_ROW, MIGRATION_ONLY),
                                                         ("flow_controlled", FLOW_ROW, FLOW_ONLY)])
def test_optional_rows_show_exactly_what_their_servers_add(request, replicated, server, row, prefixes,
                                                          dashboard: dict[str, Any]) -> None:
    """With roles (the disaggregation row), a migration plugin (the live migration row) or
    flow control (the flow control row): every series the row reads exists and has samples, and the families a plain replicated
    server lacks are exactly the row's, each shown on it."""
    replicated_families, _ = replicated
    families, samples = request.getfixturevalue(server)
    on_row, _ = referenced_by_row(dashboard, row)
    assert on_row
    unknown = sorted(n for n in on_row if series_family(n, families) is None)
    assert not unknown, f"the {row} row reads series the server does not expose: {unknown}"
    check_kinds(on_row, families)
    empty = {n for n in on_row if n not in samples}
    assert not empty, f"no samples after traffic: {sorted(empty)}"
    assert set(replicated_families) <= set(families)
    added = set(families) - set(replicated_families)
    assert added and added == {f for f in families if f.startswith(prefixes)}, sorted(added)
    assert not [f for f in replicated_families if f.startswith(prefixes)]
    missing = not_shown({f: families[f] for f in added}, on_row)
    assert not missing, f"exposed by the {server} server but on no panel of the {row} row: {missing}"
