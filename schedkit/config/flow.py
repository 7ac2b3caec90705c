"""The ``flow_control`` section: who goes first at the front door when every engine is
saturated (docs/flow-control.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from schedkit.config.base import StrictModel
from schedkit.config.plugins import PluginConfig, check_listed_once


class FlowControlConfig(StrictModel):
    """Requests held in front of the engines, in queues by priority band and tenant,
    while a saturation detector says the engines are full; a fairness plugin picks the
    tenant served next within a band. Off by default: requests go straight to the
    engines, as without this section."""

    enabled: bool = False
    """Hold requests at the front door while the engines are saturated."""
    fairness: str = "tenant-round-robin"
    """The plugin (``schedkit_flow_pick_tenant``) that picks the tenant served next within
    a band: ``tenant-round-robin``, ``tenant-weighted`` (least service per weight, VTC's
    counters) or an installed plugin's entry-point name."""
    saturation: str = "queue-depth"
    """The plugin (``schedkit_flow_saturated``) that says whether the engines are full:
    ``queue-depth`` (every live replica's estimated queue at its limit, or its KV cache
    nearly full) or an installed plugin's entry-point name."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """Settings for those plugins (an entry naming one gives it its settings), and more
    flow plugins (observers)."""
    queue_timeout_s: float = Field(default=30.0, gt=0)
    """A request held longer is refused (503 with the reason, ``Retry-After``)."""
    max_queued: int = Field(default=4096, ge=1)
    """Requests held at once. Past it a newcomer displaces the newest request of the
    tenant holding the most (in a less urgent band, or in its own band when that tenant
    holds at least two more than the newcomer's), which is refused (429); with none to
    displace, the newcomer is refused at once (429)."""

    @model_validator(mode="after")
    def _check(self) -> FlowControlConfig:
        check_listed_once(self.plugins, "flow plugin")
        return self
