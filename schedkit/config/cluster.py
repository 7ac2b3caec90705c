"""The ``replicas`` and ``router`` sections: several engines behind one router."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schedkit.config.base import LocatedValueError, StrictModel
from schedkit.config.plugins import PluginConfig, check_listed_once

ROLES = ("prefill", "decode", "both")
"""What a replica does: ``prefill`` replicas only prefill requests that are disaggregated
(their KV goes on to a decode replica); ``decode`` and ``both`` replicas serve whole
requests and decode disaggregated ones; ``both`` replicas may also be picked for a
disaggregated request's prefill."""


class RolesConfig(StrictModel):
    """Prefill/decode disaggregation: how many replicas have each role. Replica indices
    are given out in order: the first ``prefill`` replicas prefill, the next ``decode``
    ones decode, the rest are ``both`` (docs/cluster-simulation.md#disaggregation)."""

    prefill: int = Field(default=0, ge=0)
    """Replicas that only prefill (indices ``0 .. prefill-1``)."""
    decode: int = Field(default=0, ge=0)
    """Replicas that serve whole requests and the decode of disaggregated ones (the
    indices after the prefill replicas)."""

    def role_of(self, index: int) -> str:
        """``prefill``, ``decode`` or ``both`` for replica ``index``."""
        if index < self.prefill:
            return "prefill"
        return "decode" if index < self.prefill + self.decode else "both"


class ReplicasConfig(StrictModel):
    """Data-parallel replicas: ``count`` engines behind one router."""

    count: int = Field(default=1, ge=1, le=1024)
    """Engines (each with its own scheduler, KV cache and runner). With 1 there is no
    router: clients talk to the one engine directly."""
    backend: Literal["local", "ray"] = "local"
    """``local``: engine-core processes on this machine; ``ray``: one Ray actor per
    replica, placed with the resources below (``pip install 'schedkit[cluster]'``)."""
    ray_address: str | None = Field(default=None, min_length=1)
    """The Ray cluster to join (``ray.init(address=...)``, e.g. ``auto`` or
    ``ray://host:10001``); None starts a local cluster for the process."""
    num_cpus: float = Field(default=1.0, ge=0)
    """Ray: CPUs each replica's actor holds."""
    num_gpus: float = Field(default=0.0, ge=0)
    """Ray: GPUs each replica's actor holds (1 for one GPU per engine)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Ray: custom resources each replica's actor holds, e.g. ``{accelerator_type:H200: 1}``."""
    transport: Literal["ipc", "tcp"] = "ipc"
    """How the front end reaches local replicas (Ray replicas always use TCP). Either way
    each engine's sockets admit only its front end's key (docs/cluster.md)."""
    engine_host: Literal["loopback", "node"] = "loopback"
    """Ray: the address a replica's engine binds. ``loopback``: 127.0.0.1, so a replica
    must run on the front end's node (one elsewhere fails to start, saying so); ``node``:
    a replica on another node binds that node's IP as Ray knows it
    (``ray.util.get_node_ip_address()``, the node's ``--node-ip-address``), reachable from
    that network; one on the front end's node still binds loopback."""
    roles: RolesConfig | None = None
    """Prefill/decode disaggregation, e.g. ``{prefill: 4, decode: 12}``; None (the
    default): every replica serves whole requests. Real replicas move a disaggregated
    request's KV through the front end (each runs the ``kv-transfer`` connector); the
    cluster simulation charges the profile's transfer time."""
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    """With ``roles``: the longest one step of a KV hand-off (a replica's answer) may
    take before the decode replica computes the prompt itself instead."""

    def role_of(self, index: int) -> str:
        """Replica ``index``'s role: ``prefill``, ``decode`` or ``both`` (every replica
        without ``roles``)."""
        return "both" if self.roles is None else self.roles.role_of(index)

    @model_validator(mode="after")
    def _check_roles(self) -> ReplicasConfig:
        roles = self.roles
        if roles is None:
            return self
        if roles.prefill + roles.decode > self.count:
            raise LocatedValueError(f"prefill ({roles.prefill}) + decode ({roles.decode}) "
                                    f"replicas exceed replicas.count ({self.count})",
                                    ("roles",), roles.model_dump())
        if roles.prefill == 0:
            raise LocatedValueError("at least one replica must prefill: with no prefill replica "
                                    "nothing is disaggregated (leave roles out instead)",
                                    ("roles", "prefill"), roles.prefill)
        if roles.prefill == self.count:
            raise LocatedValueError(f"all {self.count} replicas prefill, so a prefilled "
                                    "request has nowhere to decode; give some the decode role or leave "
                                    "them unlisted (both)", ("roles", "prefill"), roles.prefill)
        return self

    @model_validator(mode="after")
    def _check_resources(self) -> ReplicasConfig:
        bad = {k: v for k, v in self.resources.items() if not v >= 0}
        if bad:
            raise ValueError(f"replicas.resources must be non-negative amounts, got {bad}")
        reserved = sorted({"CPU", "GPU"} & set(self.resources))
        if reserved:
            raise ValueError(f"replicas.resources: {reserved} are Ray's own resources; set them with "
                             "replicas.num_cpus / replicas.num_gpus")
        if self.backend == "local":
            ray_only = [k for k, default in (("ray_address", None), ("num_cpus", 1.0), ("num_gpus", 0.0),
                                             ("engine_host", "loopback"))
                        if getattr(self, k) != default] + (["resources"] if self.resources else [])
            if ray_only:
                raise ValueError(f"replicas.{', replicas.'.join(ray_only)} only apply with backend: ray "
                                 "(local replicas share this machine's devices)")
        return self


class RouterConfig(StrictModel):
    """How the router picks a replica: filters narrow the candidates, every scoring
    plugin scores them (weighted), then a picker chooses (docs/cluster.md)."""

    policy: str = "weighted"
    """The router plugin: ``round-robin``, ``least-outstanding``, ``kv-usage``,
    ``prefix-affinity``, ``session-affinity``, ``weighted`` (queue depth plus prefix
    hits, like llm-d's default), ``slo-headroom`` (predicted latency against the
    request's SLO class) or an installed router plugin's entry-point name."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """More router plugins to switch on (filters, scorers, observers), with settings; an
    entry naming the policy gives the policy its settings."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Weight of each scoring plugin's score, by plugin name (default 1)."""
    migration_interval_s: float = Field(default=0.5, gt=0)
    """How often a migration plugin (``schedkit_router_migrate``: ``rebalance``,
    ``drain``) is asked which running requests to move."""
    latency_profile: str | None = Field(default=None, min_length=1)
    """The cost-model profile (a bundled name or a JSON file path, as ``runner.profile``)
    the router predicts each replica's TTFT and TPOT with, for the router plugins whose
    hooks take ``latency`` (``slo-headroom``). Default: ``runner.profile`` with the
    simulated runner; a real runner needs one fitted to it (``schedkit calibrate``)."""

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        names = [p.name for p in self.plugins]
        check_listed_once(self.plugins, "router plugin")
        bad = {k: v for k, v in self.weights.items() if not (v >= 0 and v < float("inf"))}
        if bad:
            raise ValueError(f"router.weights must be finite and non-negative, got {bad}")
        unknown = sorted(set(self.weights) - {self.policy, *names})
        if unknown:
            raise ValueError(f"router.weights names {unknown}, which are not switched on "
                             f"(the policy {self.policy!r} or router.plugins)")
        return self
