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
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit the budget whole."""
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    """Draft tokens per request per step (n-gram style, no lookahead slots)."""
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if blocks for its whole current sequence are free."""

    @model_validator(mode="after")
    def _check_limits(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
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
        return self


class PluginConfig(_Strict):
    name: str = Field(min_length=1)
    """Entry-point name of an installed plugin (group ``schedkit``)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the plugin's factory; the plugin validates them itself."""


class WorkloadConfig(_Strict):
    kind: Literal["poisson", "fixed"] = "poisson"
    """Arrival process."""
    rate: float = Field(default=4.0, gt=0)
    """Mean arrivals per second."""
    num_requests: int = Field(default=200, ge=1)
    """Requests to generate."""
    prompt_len: tuple[int, int] = (32, 512)
    """Uniform prompt-length range [lo, hi] in tokens."""
    output_len: tuple[int, int] = (16, 256)
    """Uniform output-length range [lo, hi] in tokens."""
    seed: int = 0
    """Seed of the workload generator."""

    @model_validator(mode="after")
    def _check_ranges(self) -> WorkloadConfig:
        for key in ("prompt_len", "output_len"):
            lo, hi = getattr(self, key)
            if not 1 <= lo <= hi:
                raise ValueError(f"{key} must satisfy 1 <= lo <= hi, got [{lo}, {hi}]")
        return self


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

    @model_validator(mode="after")
    def _check_plugins_unique(self) -> Config:
        names = [p.name for p in self.plugins]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"plugin listed twice: {sorted(dup)}")
        return self


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
