"""Configuration: strict pydantic models and one YAML loader.

Every field has a type, a range, a default and a docstring. Unknown keys are errors.
``load_config(path)`` turns any validation failure into a :class:`ConfigError` that
names the key, the offending value, the file and the line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schedkit.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Strict):
    name: str = "tiny-llama"
    """A built-in model name or a local Hugging Face folder."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights and activations dtype."""
    tokenizer: str | None = None
    """Tokenizer folder; None means the model folder (or token-id prompts only)."""
    seed: int = Field(default=0, ge=0)
    """Weight seed of the built-in random-weight models (tiny-llama, tiny-qwen2)."""


class RunnerConfig(_Strict):
    kind: Literal["fake", "simulated", "paged"] = "fake"
    """Which model runner executes the steps."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the paged runner."""
    vocab_size: int = Field(default=32000, ge=2)
    """Vocabulary size of the fake runner's token function."""
    eos_token_id: int | None = Field(default=None, ge=0)
    """EOS id the fake runner emits at each request's sampled output length (None: never)."""
    step_time_ms: float = Field(default=10.0, gt=0)
    """Virtual duration of one fake-runner step, which drives the engine's clock."""
    profile: str = "h200-qwen2.5-0.5b-handset"
    """Simulated runner: cost-model profile, a bundled name or a JSON file path."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Paged runner on CUDA: fraction of GPU memory for weights, activations and KV cache
    (the KV cache gets what is left, at most cache.num_blocks blocks)."""
    enforce_eager: bool = False
    """Paged runner on CUDA: never capture CUDA graphs for decode batches."""
    cuda_graph_max_batch_size: int = Field(default=256, ge=1, le=2048)
    """Paged runner on CUDA: largest decode batch replayed from a captured CUDA graph."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """Paged attention implementation: auto (Triton on CUDA, PyTorch on CPU), torch or triton."""
    seed: int = Field(default=0, ge=0)
    """Seed of the paged runner's sampler for requests without their own seed."""
    num_threads: int | None = Field(default=None, ge=1, le=1024)
    """Paged runner on CPU: torch intra-op threads (None: torch's default)."""


class CacheConfig(_Strict):
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block."""
    num_blocks: int = Field(default=2048, ge=2)
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


class SLOConfig(_Strict):
    ttft_s: float | None = Field(default=None, gt=0)
    """Time-to-first-token target (seconds)."""
    tpot_s: float | None = Field(default=None, gt=0)
    """Time-per-output-token target (seconds, mean over the request's decode)."""
    e2e_s: float | None = Field(default=None, gt=0)
    """End-to-end latency target (seconds)."""
    attainment: float = Field(default=0.9, gt=0, le=1)
    """Share of requests that must meet every target for a rate to count as sustained."""


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
    prompts: list[str] = Field(default_factory=list)
    """Text prompts (synthetic kinds), cycled over num_requests; they need a model with a
    tokenizer and are sent through its chat template when it has one."""
    seed: int = 0
    """Seed: the same config always gives the same requests."""

    @model_validator(mode="after")
    def _check_trace(self) -> WorkloadConfig:
        if self.kind == "trace" and self.trace is None:
            raise ValueError("kind 'trace' needs a trace section (format, path)")
        if self.kind != "trace" and self.trace is not None:
            raise ValueError(f"a trace section needs kind 'trace', not {self.kind!r}")
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


class CompareConfig(_Strict):
    profiles: list[ProfileConfig] = Field(default_factory=list, min_length=1)
    """The policy profiles ``schedkit compare`` runs on the same workload."""


class Config(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to serve."""
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
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

    @model_validator(mode="after")
    def _check_plugins_unique(self) -> Config:
        names = [p.name for p in self.plugins]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"plugin listed twice: {sorted(dup)}")
        for profile in self.compare.profiles if self.compare is not None else ():
            profile_scheduler(self.scheduler, profile)  # raises ValueError naming the profile
        return self


def profile_scheduler(base: SchedulerConfig, profile: ProfileConfig) -> SchedulerConfig:
    """``base`` with a compare profile's policy and scheduler overrides.

    Raises:
        ValueError: An override that SchedulerConfig rejects (named with the profile).
    """
    if "policy" in profile.scheduler:
        raise ValueError(f"compare profile {profile.name!r}: set the policy with its 'policy' "
                         "key, not under 'scheduler'")
    try:
        return SchedulerConfig.model_validate(
            {**base.model_dump(), **profile.scheduler, "policy": profile.policy})
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'scheduler'}: {err['msg']}"
                        for err in e.errors())
        raise ValueError(f"compare profile {profile.name!r}: bad scheduler override: {why}") from None


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


def format_validation_error(err: ValidationError, source: str, root: yaml.Node | None = None) -> str:
    """Render a pydantic error as one line per problem: key, value, file and line."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        where = source
        line = _line_of(root, loc)
        if line is not None:
            where = f"{source}:{line}"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key '{key}'")
        else:
            value = e.get("input")
            lines.append(f"{where}: {key} = {value!r}: {e['msg']}")
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
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from e
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), root)) from e
