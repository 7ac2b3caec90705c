"""The front door's Prometheus series, with ``flow_control.enabled``
(docs/flow-control.md#metrics): read from ``stats()["flow_control"]`` when ``/metrics``
is scraped.

Label values stay bounded whatever clients send: a request's band is its ``priority``
(any 64-bit integer over HTTP), so only the first :data:`MAX_BAND_LABELS` bands seen get
a label of their own (band 0, the default, from the start) and later ones count as
``other``; tenants share the server's per-tenant labels (``server.max_tenant_labels``,
the rest ``other``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "schedkit:"
MAX_BAND_LABELS = 16
"""Bands (priorities) with a label of their own on ``flow_num_requests_held``."""
OTHER = "other"
REFUSAL_REASONS = ("timeout", "full")
"""Why the front door refuses a request: held past ``queue_timeout_s``; ``max_queued`` held."""


class FlowSeries:
    """Args:
        model_name: The ``model_name`` label.
        tenant_label: The server's tenant -> label map (bounded; "other" past its limit).
        labelled_tenants: The tenants that have a label (read when collecting).
        max_tenant_labels: How many tenants may have one.
    """

    def __init__(self, model_name: str, tenant_label: Callable[[str], str], labelled_tenants: Collection[str],
                 max_tenant_labels: int) -> None:
        self.model_name = model_name
        self.tenant_label = tenant_label
        self.labelled_tenants = labelled_tenants
        self.max_tenant_labels = max_tenant_labels
        self._bands: dict[int, str] = {0: "0"}

    def band_label(self, band: int) -> str:
        """``band`` while fewer than :data:`MAX_BAND_LABELS` bands have a label; else "other"."""
        label = self._bands.get(band)
        if label is None:
            if len(self._bands) >= MAX_BAND_LABELS:
                return OTHER
            label = self._bands[band] = str(band)
        return label

    def collect(self, flow: Mapping[str, Any]) -> Iterable[Metric]:
        m = self.model_name
        info = GaugeMetricFamily(PREFIX + "flow_info", "The front door's fairness and saturation plugins "
                                 "and every flow plugin switched on (value 1).",
                                 labels=["model_name", "fairness", "saturation", "plugins"])
        info.add_metric([m, str(flow.get("fairness", "")), str(flow.get("saturation", "")),
                         ",".join(name for name, _ in flow.get("plugin_hooks", []))], 1)
        yield info
        yield from self._held(flow)
        yield _one(GaugeMetricFamily, "flow_num_requests_outstanding", "Requests the front door sent on to "
                   "the engines that have not finished.", m, flow.get("num_outstanding", 0))
        yield _one(GaugeMetricFamily, "flow_saturated", "The saturation detector's last answer: 1, the "
                   "engines are full (new requests are held), or 0. Asked when a request arrives and while "
                   "held ones wait.", m, 1 if flow.get("saturated") else 0)
        yield _one(CounterMetricFamily, "flow_requests_dispatched", "Requests the front door sent on to the "
                   "engines, at once or after waiting.", m, flow.get("num_dispatched", 0))
        yield _one(CounterMetricFamily, "flow_requests_held", "Requests that had to wait at the front door "
                   "(held at some point).", m, flow.get("num_held", 0))
        refused = dict.fromkeys(REFUSAL_REASONS, 0) | dict(flow.get("num_refused", {}))
        ref = CounterMetricFamily(PREFIX + "flow_requests_refused", "Requests the front door refused (429), "
                                  "by reason: timeout (held past flow_control.queue_timeout_s), full "
                                  "(flow_control.max_queued held).", labels=["model_name", "reason"])
        for reason, n in sorted(refused.items()):
            ref.add_metric([m, str(reason)], n)
        yield ref
        errors = {(p, h): 0 for p, hooks in flow.get("plugin_hooks", []) for h in hooks}
        errors |= {(p, h): n for p, h, n in flow.get("num_hook_errors", [])}
        err = CounterMetricFamily(PREFIX + "flow_hook_errors", "Flow-hook calls that raised or answered "
                                  "something impossible, by plugin and hook (the answer was ignored).",
                                  labels=["model_name", "plugin", "hook"])
        for (p, h), n in sorted(errors.items()):
            err.add_metric([m, p, h], n)
        yield err

    def _held(self, flow: Mapping[str, Any]) -> Iterable[Metric]:
        """Requests held now, by band and by tenant: every label given so far at its
        count (0 when it holds none), so a series drops to 0 instead of vanishing."""
        m = self.model_name
        by_band: dict[str, int] = {}
        for band, n in flow.get("num_queued_by_band", {}).items():
            label = self.band_label(int(band))
            by_band[label] = by_band.get(label, 0) + n
        labels = list(self._bands.values()) + ([OTHER] if len(self._bands) >= MAX_BAND_LABELS else [])
        held = GaugeMetricFamily(PREFIX + "flow_num_requests_held", "Requests held at the front door now, "
                                 "by band (the request's priority; past the first 16 bands seen, "
                                 "\"other\").", labels=["model_name", "band"])
        for label in labels:
            held.add_metric([m, label], by_band.get(label, 0))
        yield held
        by_tenant: dict[str, int] = {}
        for tenant, n in flow.get("num_queued_by_tenant", {}).items():
            label = self.tenant_label(str(tenant))
            by_tenant[label] = by_tenant.get(label, 0) + n
        tenants = sorted(self.labelled_tenants)
        if len(tenants) >= self.max_tenant_labels:
            tenants.append(OTHER)
        per_tenant = GaugeMetricFamily(PREFIX + "flow_tenant_num_requests_held", "Requests held at the "
                                       "front door now, by tenant (the request's user field; tenants past "
                                       "server.max_tenant_labels count as \"other\").",
                                       labels=["model_name", "tenant"])
        for label in tenants:
            per_tenant.add_metric([m, label], by_tenant.get(label, 0))
        yield per_tenant


def _one(family: Any, name: str, doc: str, model_name: str, value: float) -> Metric:
    metric = family(PREFIX + name, doc, labels=["model_name"])
    metric.add_metric([model_name], value)
    return metric
