"""Configuration: strict pydantic models and one YAML loader.

Every field has a type, a range, a default and a docstring. Unknown keys are errors,
and so is a value of the wrong type: no coercion (``'8'`` or ``8.0`` is not an int,
``'off'`` is not a bool; an int is a valid float). A key given twice in one mapping is an
error too. ``load_config(path)`` turns any of these into a :class:`ConfigError` that
names the key, the offending value, the file and the line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from schedkit.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              use_attribute_docstrings=True)


class ModelConfig(_Strict):
    name: str = "tiny-llama"
    """A built-in model name or a local Hugging Face folder."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights and activations dtype."""
    tokenizer: str | None = None
    """Tokenizer folder; None means the model folder (or token-id prompts only)."""
    seed: int = Field(default=0, ge=0)
    """Weight seed of the built-in random-weight models (tiny-llama, tiny-qwen2)."""


class _RunnerBase(_Strict):
    """The fields every runner kind has: its kind and the token space of the workload."""

    kind: Literal["fake", "simulated", "paged"]
    """Which model runner executes the steps."""
    vocab_size: int = Field(default=32000, ge=2)
    """Vocabulary size: bounds generated workload token ids (and the fake and simulated
    runners' tokens; at most the model's vocabulary on the paged runner)."""
    eos_token_id: int | None = Field(default=None, ge=0)
    """EOS id of requests generated from the workload (the fake and simulated runners emit
    it at each request's sampled output length; None: never)."""


class FakeRunnerConfig(_RunnerBase):
    kind: Literal["fake"] = "fake"
    """Which model runner executes the steps: a deterministic model with no weights."""
    step_time_ms: float = Field(default=10.0, gt=0)
    """Virtual duration of one fake-runner step, which drives the engine's clock."""
    clock: Literal["virtual", "wall"] = "virtual"
    """``virtual``: steps take no real time and advance the engine's virtual clock by
    ``step_time_ms``; ``wall``: each step sleeps ``step_time_ms`` and the engine runs on
    the wall clock (a stand-in model behind ``schedkit serve``)."""


class SimulatedRunnerConfig(_RunnerBase):
    kind: Literal["simulated"] = "simulated"
    """Which model runner executes the steps: fake tokens, cost-model step durations."""
    profile: str = "h200-qwen2.5-0.5b-handset"
    """Cost-model profile, a bundled name or a JSON file path."""


class PagedRunnerConfig(_RunnerBase):
    kind: Literal["paged"] = "paged"
    """Which model runner executes the steps: a real model over the paged KV cache."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the model and its KV cache."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """On CUDA: fraction of GPU memory for weights, activations and KV cache (the KV
    cache gets what is left, at most cache.num_blocks blocks)."""
    enforce_eager: bool = False
    """On CUDA: never capture CUDA graphs for decode batches."""
    cuda_graph_max_batch_size: int = Field(default=256, ge=1, le=2048)
    """On CUDA: largest decode batch replayed from a captured CUDA graph."""
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    """Paged attention implementation: auto (Triton on CUDA; on CPU the compiled C++
    kernel, or the PyTorch reference where no compiler works), torch (the reference),
    triton or cpu (the C++ kernel)."""
    compute_dtype: Literal["auto", "model", "float32"] = "auto"
    """Arithmetic dtype on the CPU: model (the model's dtype), float32 (bfloat16 / float16
    weights widened once at load; the KV cache keeps the model's dtype) or auto (float32
    where this CPU has no native matmul in the model's dtype: bfloat16 needs AVX512-BF16
    or AMX, float16 AMX-FP16; else the model's). Ignored on CUDA."""
    seed: int = Field(default=0, ge=0)
    """Seed of the sampler for requests without their own seed."""
    num_threads: int | None = Field(default=None, ge=1, le=1024)
    """On CPU: torch intra-op threads (None: torch's default)."""


RUNNER_CONFIGS: dict[str, type[_RunnerBase]] = {
    "fake": FakeRunnerConfig, "simulated": SimulatedRunnerConfig, "paged": PagedRunnerConfig}
"""Runner kind -> the model of its ``runner`` section."""


def _runner_kind(value: Any) -> str | None:
    """The tag of a ``runner`` section: its ``kind``, ``fake`` when the key is left out."""
    if isinstance(value, dict):
        return value.get("kind", "fake")
    return getattr(value, "kind", None)


RunnerConfig = Annotated[
    Annotated[FakeRunnerConfig, Tag("fake")]
    | Annotated[SimulatedRunnerConfig, Tag("simulated")]
    | Annotated[PagedRunnerConfig, Tag("paged")],
    Field(discriminator=Discriminator(_runner_kind)),
]
"""The ``runner`` section: one model per runner kind (a union tagged by ``kind``), so a
key the chosen runner does not have is refused."""


MAX_NUM_BLOCKS = 1 << 24
"""16.7M blocks: 268M tokens of 16-token blocks, over 20x what fits in an H200 for a
0.5B model; the pool's bookkeeping is a Python object per block, so more would only
exhaust the host's memory."""


class CacheConfig(_Strict):
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block."""
    num_blocks: int = Field(default=2048, ge=2, le=MAX_NUM_BLOCKS)
    """Blocks in the pool, including the reserved null block 0."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches (prefix caching)."""
    hash_algo: Literal["xxhash", "sha256"] = "xxhash"
    """Block-hash algorithm for prefix caching."""
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of blocks kept free when admitting waiting requests while others run."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    """When a KV connector reports a failed asynchronous load: start the request over
    (recompute) or finish it with an error (fail)."""
    enable_kv_events: bool = False
    """Publish KV cache events (blocks stored, removed, cache cleared). The router turns
    it on in every replica: its prefix-affinity view of each engine is built from them."""


class SchedulerConfig(_Strict):
    policy: str = "fcfs"
    """fcfs, priority, or the entry-point name of an installed policy plugin."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Token budget of one step."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most requests running at once."""
    max_model_len: int = Field(default=2048, ge=2)
    """Longest sequence (prompt + output) a request may reach."""
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    """Per-request cap on prefill tokens per step when other requests exist (0 = off)."""
    long_prefill_token_threshold_adaptive: bool = False
    """Raise that cap to an equal share of the budget (max_num_batched_tokens divided by
    the running and waiting requests) when the share is larger."""
    max_num_active_seqs: int | None = Field(default=None, ge=1)
    """Admit waiting requests only while fewer than this many run (<= max_num_seqs;
    None: max_num_seqs). Running requests are never preempted for it."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit the budget whole."""
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    """Draft tokens per request per step (n-gram style, no lookahead slots)."""
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if blocks for its whole current sequence are free."""
    async_scheduling: bool = False
    """Schedule step t+1 while step t runs (vLLM's AsyncScheduler): decode requests are
    scheduled again before their sampled token is known, with output placeholders."""
    max_voluntary_preemptions: int = Field(default=4, ge=0)
    """Most running requests a policy may preempt voluntarily at the start of one step
    (``schedkit_select_voluntary_preemptions``; 0: the hook is never called)."""

    @model_validator(mode="after")
    def _check_limits(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs ({self.max_num_active_seqs}) must be <= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"<= max_model_len ({self.max_model_len})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        if self.num_speculative_tokens and self.max_num_batched_tokens <= self.num_speculative_tokens:
            raise ValueError("max_num_batched_tokens must exceed num_speculative_tokens")
        if self.async_scheduling and self.num_speculative_tokens:
            raise ValueError(
                "async_scheduling does not combine with num_speculative_tokens: n-gram drafts "
                "need the previous step's tokens (vLLM turns async scheduling off for n-gram too)")
        return self


class PluginConfig(_Strict):
    name: str = Field(min_length=1)
    """Entry-point name of an installed plugin (group ``schedkit``)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the plugin's factory; the plugin validates them itself."""


class LengthConfig(_Strict):
    """A token-length distribution. YAML shorthands: ``128`` (fixed) or ``[lo, hi]`` (uniform)."""

    dist: Literal["fixed", "uniform", "zipf", "lognormal"] = "uniform"
    """fixed: always ``min``; uniform on [min, max]; zipf: P(k) ~ k^-a on [min, max];
    lognormal: median ``median`` and shape ``sigma``, clipped to [min, max]."""
    min: int = Field(default=1, ge=1)
    """Smallest length (the value of a fixed distribution)."""
    max: int = Field(default=512, ge=1)
    """Largest length."""
    a: float = Field(default=1.2, gt=1.0)
    """Zipf exponent."""
    median: float = Field(default=128.0, gt=0)
    """Lognormal median."""
    sigma: float = Field(default=1.0, gt=0)
    """Lognormal shape (standard deviation of the log)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return {"dist": "fixed", "min": v, "max": v}
        if isinstance(v, (list, tuple)) and len(v) == 2:
            return {"dist": "uniform", "min": v[0], "max": v[1]}
        return v

    @model_validator(mode="after")
    def _check(self) -> LengthConfig:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class TenantConfig(_Strict):
    name: str = Field(min_length=1)
    """Tenant (client) name attached to its requests."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the requests sent by this tenant."""
    share: float = Field(default=1.0, gt=0)
    """The tenant's entitled share of service, by which the lab's fairness metrics divide
    its service (the role of ``vtc``'s ``tenant_weights``)."""


class PriorityClassConfig(_Strict):
    priority: int = 0
    """Priority value (smaller is more important)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the requests in this class."""


class SharedPrefixConfig(_Strict):
    count: int = Field(default=4, ge=1)
    """Distinct shared system prompts."""
    length: int = Field(default=256, ge=1)
    """Tokens in each shared prompt (prepended to the request's own prompt)."""
    fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of the requests that start with one of them."""


class TraceConfig(_Strict):
    format: Literal["azure", "mooncake", "vidur"]
    """azure: Azure LLM inference 2023 CSV; mooncake: FAST'25 JSONL (hash_ids become shared
    prefixes); vidur: length pairs without timestamps (arrivals generated)."""
    path: str
    """Trace file; relative paths are resolved against the config file, then the repository."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiplies every arrival time (0.5 replays twice as fast)."""
    start: int = Field(default=0, ge=0)
    """Skip this many requests at the start of the trace."""
    max_prompt_len: int | None = Field(default=None, ge=1)
    """Clip prompts to this many tokens (None: keep, then too-long requests are rejected)."""
    max_output_len: int | None = Field(default=None, ge=1)
    """Clip each request's output length (its max_tokens) to this many tokens."""


class SLOTargets(_Strict):
    ttft_s: float | None = Field(default=None, gt=0)
    """Time-to-first-token target (seconds)."""
    tpot_s: float | None = Field(default=None, gt=0)
    """Time-per-output-token target (seconds, mean over the request's decode)."""
    e2e_s: float | None = Field(default=None, gt=0)
    """End-to-end latency target (seconds)."""


class SLOConfig(SLOTargets):
    attainment: float = Field(default=0.9, gt=0, le=1)
    """Share of requests that must meet every target for a rate to count as sustained."""
    by_priority: dict[int, SLOTargets] = Field(default_factory=dict)
    """Targets of a priority class (``Request.priority``), each overriding the targets above."""
    by_tenant: dict[str, SLOTargets] = Field(default_factory=dict)
    """Targets of a tenant, each overriding its priority class's and the targets above."""

    @field_validator("by_priority", mode="before")
    @classmethod
    def _int_keys(cls, value: Any) -> Any:
        """JSON (and a dumped config) writes the priorities as strings: read them back."""
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                    for k, v in value.items()}
        return value

    def class_target(self, name: str, tenant: str, priority: int) -> float | None:
        """The value of target ``name`` set for the class itself: the tenant's entry
        first, then the priority class's; None when neither sets it."""
        for entry in (self.by_tenant.get(tenant), self.by_priority.get(priority)):
            if entry is not None and (value := getattr(entry, name)) is not None:
                return value
        return None

    def for_class(self, tenant: str, priority: int) -> SLOTargets:
        """The targets a request of ``tenant`` and ``priority`` is judged by: each target
        from the tenant's entry if set there, else the priority class's, else the base."""
        if tenant not in self.by_tenant and priority not in self.by_priority:
            return self
        values = {}
        for name in SLOTargets.model_fields:
            value = self.class_target(name, tenant, priority)
            values[name] = getattr(self, name) if value is None else value
        return SLOTargets(**values)


class FairnessConfig(_Strict):
    input_weight: float = Field(default=1.0, ge=0)
    """Cost of one prompt token in a tenant's service (VTC's w_p)."""
    output_weight: float = Field(default=2.0, ge=0)
    """Cost of one output token in a tenant's service (VTC's w_q)."""
    window_s: float | None = Field(default=None, gt=0)
    """Length of the intervals over which Jain's index of backlogged tenants is taken
    (null: a twentieth of the run)."""


class WorkloadConfig(_Strict):
    kind: Literal["poisson", "gamma", "fixed", "trace"] = "poisson"
    """Arrival process of a synthetic workload, or ``trace`` to replay ``trace``."""
    rate: float = Field(default=4.0, gt=0)
    """Mean arrivals per second (synthetic, and vidur traces)."""
    burstiness: float = Field(default=1.0, gt=0)
    """Coefficient of variation of gamma inter-arrival times (1 = Poisson, > 1 burstier)."""
    num_requests: int = Field(default=200, ge=1)
    """Requests to generate, or the most to take from a trace."""
    prompt_len: LengthConfig = Field(default_factory=lambda: LengthConfig(min=32, max=512))
    """Prompt-length distribution (synthetic)."""
    output_len: LengthConfig = Field(default_factory=lambda: LengthConfig(min=16, max=256))
    """Output-length distribution (synthetic, and every request's max_tokens)."""
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Tenants with weights; requests are assigned at random by weight."""
    priorities: list[PriorityClassConfig] = Field(default_factory=list)
    """Priority classes with weights."""
    shared_prefix: SharedPrefixConfig | None = None
    """Shared system prompts (synthetic)."""
    trace: TraceConfig | None = None
    """The trace to replay when kind is ``trace``."""
    slo: SLOConfig = Field(default_factory=SLOConfig)
    """Service-level objectives used by goodput, attainment and rate sweeps."""
    fairness: FairnessConfig = Field(default_factory=FairnessConfig)
    """How the lab weighs tenants' service in its fairness metrics."""
    prompts: list[str] = Field(default_factory=list)
    """Text prompts (synthetic kinds), cycled over num_requests; they need a model with a
    tokenizer and are sent through its chat template when it has one."""
    seed: int = 0
    """Seed: the same config always gives the same requests."""

    @property
    def tenant_shares(self) -> dict[str, float]:
        """``tenant -> share`` of the listed tenants (the fairness metrics' weights)."""
        return {t.name: t.share for t in self.tenants}

    @model_validator(mode="after")
    def _check_trace(self) -> WorkloadConfig:
        if self.kind == "trace" and self.trace is None:
            raise ValueError("kind 'trace' needs a trace section (format, path)")
        if self.kind != "trace" and self.trace is not None:
            raise ValueError(f"a trace section needs kind 'trace', not {self.kind!r}")
        return self


class StructuredOutputsConfig(_Strict):
    """Grammar-constrained decoding (requests with ``structured_outputs``)."""

    backend: str = Field(default="auto", min_length=1)
    """``auto`` (xgrammar, else the pure-Python backend), ``xgrammar``, ``python`` (regex
    and choice only, no torch), or the name a plugin's
    ``schedkit_create_structured_output_backend`` answers to."""
    num_workers: int = Field(default=2, ge=1, le=64)
    """Grammars checked and compiled at once, off the engine thread: worker processes
    for backends that can compile in one (xgrammar), threads otherwise."""
    cache_size: int = Field(default=256, ge=1)
    """Compiled grammars kept, by constraint (least recently used dropped first)."""
    jump_forward: bool = False
    """Jump-forward decoding: where the grammar allows exactly one continuation, append
    its tokens in one step instead of one step per token."""
    json_max_whitespace: int | None = Field(default=4, ge=0)
    """Most whitespace characters a JSON output may put between two of its tokens
    (xgrammar's ``max_whitespace_cnt``); None: no limit. Without one a small model can
    spend its whole ``max_tokens`` on newlines inside an unfinished object."""
    compile_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Longest a constraint's check and compilation may run on a worker; past it the
    compile is stopped (its worker process killed) and its requests fail."""
    max_queued_compiles: int = Field(default=128, ge=1, le=100_000)
    """Compiles waiting for a worker, in total; a new constraint beyond it is refused."""
    max_queued_compiles_per_client: int = Field(default=16, ge=1, le=100_000)
    """Compiles waiting for a worker per client (a request's ``client_index`` and
    ``tenant``, over HTTP the ``user`` field); the queue serves the clients in turn."""
    max_constraint_chars: int = Field(default=65536, ge=1)
    """Longest constraint text (a schema's compact JSON, a pattern, a grammar, the
    choices' JSON list), checked before compiling."""
    max_json_schema_depth: int = Field(default=64, ge=1, le=10_000)
    """Deepest nesting of objects and arrays in a JSON schema's text, checked before
    compiling (compiling costs about the cube of the depth)."""
    step_budget_ms: float | None = Field(default=None, gt=0)
    """Matcher work one request may cost per step (filling its bitmask rows and
    accepting its tokens); a request over it two steps in a row, or ten times over in
    one, fails alone. None: the backend's own default (xgrammar 10 ms; the python
    backend, whose every new state scans the whole vocabulary, 2 ms per 1,000 tokens of
    vocabulary, at least 10 ms)."""


class ReplicasConfig(_Strict):
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


class RouterConfig(_Strict):
    """How the router picks a replica: filters narrow the candidates, every scoring
    plugin scores them (weighted), then a picker chooses (docs/cluster.md)."""

    policy: str = "weighted"
    """The router plugin: ``round-robin``, ``least-outstanding``, ``kv-usage``,
    ``prefix-affinity``, ``session-affinity``, ``weighted`` (queue depth plus prefix
    hits, like llm-d's default) or an installed router plugin's entry-point name."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """More router plugins to switch on (filters, scorers, observers), with settings; an
    entry naming the policy gives the policy its settings."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Weight of each scoring plugin's score, by plugin name (default 1)."""

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        names = [p.name for p in self.plugins]
        _check_listed_once(self.plugins, "router plugin")
        bad = {k: v for k, v in self.weights.items() if not (v >= 0 and v < float("inf"))}
        if bad:
            raise ValueError(f"router.weights must be finite and non-negative, got {bad}")
        unknown = sorted(set(self.weights) - {self.policy, *names})
        if unknown:
            raise ValueError(f"router.weights names {unknown}, which are not switched on "
                             f"(the policy {self.policy!r} or router.plugins)")
        return self


class ProfileConfig(_Strict):
    name: str = Field(min_length=1)
    """Label of this policy profile in tables, JSON and plots."""
    policy: str = "fcfs"
    """scheduler.policy for this profile."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """Plugins switched on in addition to the config's own."""
    scheduler: dict[str, Any] = Field(default_factory=dict)
    """scheduler keys this profile changes, e.g. ``{async_scheduling: true}`` or
    ``{long_prefill_token_threshold: 256}`` (the policy is set with ``policy``)."""
    router: RouterConfig | None = None
    """The router this profile uses instead of the config's (with ``replicas.count`` >
    1, routing policies are compared like engine policies)."""


class CompareConfig(_Strict):
    profiles: list[ProfileConfig] = Field(default_factory=list, min_length=1)
    """The policy profiles ``schedkit compare`` runs on the same workload."""

    @field_validator("profiles")
    @classmethod
    def _names_unique(cls, profiles: list[ProfileConfig]) -> list[ProfileConfig]:
        k = _first_repeat([p.name for p in profiles])
        if k is not None:  # results are keyed by name: one would silently replace the other
            raise LocatedValueError(f"the name {profiles[k].name!r} is taken by an earlier profile: each "
                                    "profile needs its own (results are keyed by it)", (k, "name"), profiles[k].name)
        return profiles


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    """Address ``schedkit serve`` binds (loopback unless told otherwise)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_key: str | None = Field(default=None, min_length=1)
    """With a key every ``/v1`` route needs ``Authorization: Bearer KEY`` (also from
    ``--api-key`` or the ``SCHEDKIT_API_KEY`` environment variable)."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """The model name clients send and ``/v1/models`` lists (None: the last part of
    ``model.name``)."""
    max_pending_requests: int = Field(default=1024, ge=1)
    """Generation requests in flight at once (each of ``n`` choices counts); beyond it a
    request is answered 503 with ``Retry-After``."""
    retry_after_s: int = Field(default=1, ge=0)
    """The ``Retry-After`` seconds of a 503 (too many pending requests) or 429 (rejected)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Largest request body; a longer one is answered 413."""
    max_n: int = Field(default=16, ge=1, le=1024)
    """Largest ``n`` (choices per request)."""
    keep_alive_s: float = Field(default=10.0, ge=1)
    """Seconds an idle keep-alive connection stays open. Longer than the 5 s after which
    httpx (and so the openai client) drops an idle pooled connection, so the client always
    closes first: a request sent on a connection the server is closing would fail."""
    drain_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: seconds in-flight requests get to finish before they are aborted."""
    exit_on_engine_death: bool = False
    """When the engine dies (every replica, with ``replicas.count`` > 1): False keeps the
    server up with ``/health`` answering 503 (a liveness probe restarts it); True ends the
    open streams with their error event, then exits 1 (vLLM's default), for a supervisor
    that restarts processes rather than probing them."""
    max_tenant_labels: int = Field(default=64, ge=1, le=10000)
    """Tenants (the ``user`` field) with their own label on the per-tenant metrics; the
    others are counted under ``other``."""
    max_request_line_bytes: int = Field(default=8 * 1024, ge=256, le=1024 * 1024)
    """Longest request target (the URL of the request line); a longer one is answered 414
    and its connection closed, before authentication and before the rest is read."""
    max_header_line_bytes: int = Field(default=16 * 1024, ge=256, le=1024 * 1024)
    """Longest header (name and value); a longer one is answered 431."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Most bytes of all the headers of one request together; more is answered 431 (the
    server stops reading at the limit)."""
    max_headers: int = Field(default=100, ge=8, le=10000)
    """Most headers in one request; more is answered 431."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Seconds a request's line and headers may take to arrive, from the connection's
    opening or the request's first byte; a client still sending them then is answered 408
    and its connection closed (one that sent nothing is closed)."""
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a request body may take to arrive in full once its headers have; a client
    still sending it then is answered 408 and its connection closed."""
    tokenizer_threads: int = Field(default=2, ge=1, le=64)
    """Threads that tokenize long texts (over 4,096 characters); short texts have a thread
    of their own, so they never wait behind long ones."""


class Config(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to serve."""
    runner: RunnerConfig = Field(default_factory=FakeRunnerConfig)
    """The model runner."""
    cache: CacheConfig = Field(default_factory=CacheConfig)
    """The paged KV cache."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """The scheduler and its policy."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """Extra plugins to switch on (installed is not enabled)."""
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    """The workload that ``schedkit run`` drives through the engine."""
    compare: CompareConfig | None = None
    """Policy profiles for ``schedkit compare`` (default: just this config's policy)."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """The HTTP server of ``schedkit serve``."""
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    """Data-parallel replicas (one engine unless ``count`` is more)."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The router in front of the replicas."""
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    """Grammar-constrained decoding: the backend, its compile threads and cache."""

    _origin: ConfigOrigin | None = PrivateAttr(default=None)

    def where_switched_on(self, name: str) -> str | None:
        """``file:line`` where the YAML switches plugin (or policy) ``name`` on: the first
        ``scheduler.policy``, ``plugins[i].name``, ``compare.profiles[k].policy`` or
        ``compare.profiles[k].plugins[j].name`` that names it; else the file alone (None for
        a config not read from a file)."""
        if self._origin is None:
            return None
        for loc, node in _scalars(self._origin.root):
            if node.value == name and _switches_on(loc):
                return f"{self._origin.source}:{node.start_mark.line + 1}"
        return self._origin.source

    @model_validator(mode="after")
    def _check_plugins_unique(self) -> Config:
        _check_listed_once(self.plugins, "plugin")
        for k, profile in enumerate(self.compare.profiles if self.compare is not None else ()):
            try:
                profile_scheduler(self.scheduler, profile)
            except LocatedValueError as e:  # re-anchored at the profile's key
                raise LocatedValueError(str(e), ("compare", "profiles", k, *e.loc), e.value) from None
        return self


class LocatedValueError(ValueError):
    """A validator's ValueError about one key below the model (``loc``, with its value), so
    that :func:`format_validation_error` can name that key and its line."""

    def __init__(self, message: str, loc: tuple[int | str, ...], value: Any):
        super().__init__(message)
        self.loc, self.value = loc, value


def _first_repeat(names: list[str]) -> int | None:
    """The index of the first name that an earlier entry already has, or None."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return i
        seen.add(name)
    return None


def _check_listed_once(plugins: list[PluginConfig], what: str) -> None:
    """Raises LocatedValueError at the second entry of a plugin listed twice."""
    i = _first_repeat([p.name for p in plugins])
    if i is not None:
        raise LocatedValueError(f"{what} {plugins[i].name!r} is listed twice", ("plugins", i, "name"),
                                plugins[i].name)


@dataclass(frozen=True, slots=True)
class ConfigOrigin:
    """Where a :class:`Config` was read from: the file and its YAML node tree (lines)."""

    source: str
    root: yaml.Node | None


def _switches_on(loc: tuple[int | str, ...]) -> bool:
    """Whether the YAML value at ``loc`` names a policy or plugin to switch on."""
    if loc in (("scheduler", "policy"), ("router", "policy")):
        return True
    if len(loc) == 3 and loc[0] == "plugins" and loc[2] == "name":
        return True
    if len(loc) == 4 and loc[:2] == ("router", "plugins") and loc[3] == "name":
        return True
    if loc[:2] == ("compare", "profiles"):
        return (len(loc) == 4 and loc[3] == "policy"
                or len(loc) == 6 and loc[3] == "plugins" and loc[5] == "name"
                or len(loc) == 5 and loc[3:] == ("router", "policy")
                or len(loc) == 7 and loc[3:5] == ("router", "plugins") and loc[6] == "name")
    return False


def _scalars(root: yaml.Node | None) -> Iterator[tuple[tuple[int | str, ...], yaml.ScalarNode]]:
    """Every scalar value of the tree with its key path, in document order."""
    stack: list[tuple[tuple[int | str, ...], yaml.Node]] = [((), root)] if root is not None else []
    seen: set[int] = set()
    while stack:
        loc, node = stack.pop()
        if id(node) in seen:  # an alias met again
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            yield loc, node
        elif isinstance(node, yaml.MappingNode):
            stack.extend(reversed([((*loc, k.value), v) for k, v in node.value]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([((*loc, i), v) for i, v in enumerate(node.value)]))


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, mapping: yaml.MappingNode, key: Any, value: Any, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r}")
        self.mapping, self.key, self.value = mapping, key, value
        self.line, self.first_line = line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (PyYAML would silently
    keep the last). Keys brought in by a ``<<`` merge may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if seen is not key_node:
                    raise _DuplicateKey(node, key, self.construct_object(value_node, deep=True),
                                        key_node.start_mark.line + 1, seen.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


def _path_to(root: yaml.Node | None, target: yaml.Node) -> tuple[int | str, ...]:
    """Key path of ``target`` in the tree (() when it is the root or not found)."""
    stack: list[tuple[tuple[int | str, ...], yaml.Node]] = [((), root)] if root is not None else []
    seen: set[int] = set()
    while stack:
        loc, node = stack.pop()
        if node is target:
            return loc
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack.extend(((*loc, k.value), v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(((*loc, i), v) for i, v in enumerate(node.value))
    return ()


def load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML (safe tags only) into its data and its node tree (for line numbers).

    Raises:
        ConfigError: Not valid YAML, or a key given twice in one mapping (named with its
            path, its second value and ``source:line``).
    """
    loader = _UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _DuplicateKey as e:
        key = ".".join(str(p) for p in (*_path_to(root, e.mapping), e.key))
        raise ConfigError(f"{source}:{e.line}: {key} = {e.value!r}: duplicate key (already set "
                          f"at line {e.first_line}; YAML would keep only the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    finally:
        loader.dispose()
    return data, root


def profile_scheduler(base: SchedulerConfig, profile: ProfileConfig) -> SchedulerConfig:
    """``base`` with a compare profile's policy and scheduler overrides.

    Raises:
        ValueError: An override that SchedulerConfig rejects (named with the profile).
    """
    if "policy" in profile.scheduler:
        raise LocatedValueError(f"compare profile {profile.name!r}: set the policy with its "
                                "'policy' key, not under 'scheduler'", ("scheduler", "policy"),
                                profile.scheduler["policy"])
    try:
        return SchedulerConfig.model_validate(
            {**base.model_dump(), **profile.scheduler, "policy": profile.policy})
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'scheduler'}: {err['msg']}"
                        for err in e.errors())
        err = e.errors()[0]
        loc = tuple(err["loc"])
        value = err.get("input") if loc else profile.scheduler
        raise LocatedValueError(f"compare profile {profile.name!r}: bad scheduler override: {why}",
                                ("scheduler", *loc), value) from None


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == key:
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return line


def _runner_error(loc: tuple[int | str, ...], e: Any) -> tuple[tuple[int | str, ...], Any, str] | None:
    """An error in the ``runner`` section as (key path, value, message) at the YAML's own
    keys, or None for any other error. pydantic names the chosen member of the tagged
    union in the path (``runner.paged.device``) and reports an unknown kind, or a section
    that is no mapping, on the whole section."""
    if loc[:1] != ("runner",):
        return None
    if e["type"] == "union_tag_invalid":
        kinds = ", ".join(repr(k) for k in RUNNER_CONFIGS)
        return ("runner", "kind"), e["input"].get("kind"), f"Input should be one of {kinds}"
    if e["type"] == "union_tag_not_found":
        return loc, e.get("input"), "Input should be a mapping (the runner section)"
    if len(loc) < 2 or loc[1] not in RUNNER_CONFIGS:
        return None
    kind, loc = loc[1], (loc[0], *loc[2:])
    if e["type"] != "extra_forbidden":
        return loc, e.get("input"), e["msg"]
    owners = [k for k, model in RUNNER_CONFIGS.items() if loc[-1] in model.model_fields]
    whose = f" (a key of the {' and '.join(owners)} runner)" if owners else ""
    return loc, e.get("input"), f"unknown key for runner kind {kind!r}{whose}"


def format_validation_error(err: ValidationError, source: str, root: yaml.Node | None = None) -> str:
    """Render a pydantic error as one line per problem: key, value, file and line."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        value, message = e.get("input"), e["msg"].removeprefix("Value error, ")
        located = (e.get("ctx") or {}).get("error")
        if isinstance(located, LocatedValueError):
            loc, value = (*loc, *located.loc), located.value
        runner = _runner_error(loc, e)
        if runner is not None:
            loc, value, message = runner
        key = ".".join(str(p) for p in loc) or "<root>"
        where = source
        line = _line_of(root, loc)
        if line is not None:
            where = f"{source}:{line}"
        if e["type"] == "extra_forbidden" and runner is None:
            lines.append(f"{where}: unknown key '{key}'")
        else:
            lines.append(f"{where}: {key} = {value!r}: {message}")
    return "\n".join(lines)


def cache_dir() -> Path:
    """Where schedkit keeps files between runs (converted and built-in models, stored
    KV): ``$SCHEDKIT_CACHE_DIR`` or ``$XDG_CACHE_HOME/schedkit`` (default
    ``~/.cache/schedkit``)."""
    env = os.environ.get("SCHEDKIT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "schedkit"


def config_from_dict(data: dict[str, Any] | None, source: str = "<dict>") -> Config:
    """Validate a plain mapping into a :class:`Config` (ConfigError on any mistake)."""
    try:
        return Config.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from e


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: The file is missing, is not YAML, or fails validation; the message
            names key, value, file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from e
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start})") from None
    data, root = load_yaml(text, str(path))
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        config = Config.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), root)) from e
    config._origin = ConfigOrigin(str(path), root)
    return config
