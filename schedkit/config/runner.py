"""The ``runner`` section: which runner executes the steps, and its settings.

``kind`` names any runner registered in the ``schedkit.runners`` entry-point group; the
registry (``schedkit.runners``) resolves it when the engine is built. schedkit's own
runners have their keys directly under ``runner:`` (a model each, so a key the chosen
one lacks is refused here with its line); any other runner gets the common keys plus a
free-form ``settings`` mapping that the runner validates itself, as a plugin validates
its ``plugins[].settings``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from schedkit.config.base import StrictModel


class _RunnerBase(StrictModel):
    """The fields every runner kind has: its kind and the token space of the workload."""

    kind: str = Field(min_length=1)
    """Which model runner executes the steps: its name in the ``schedkit.runners``
    entry-point group."""
    vocab_size: int = Field(default=32000, ge=2)
    """Vocabulary size: bounds generated workload token ids (and the fake and simulated
    runners' tokens; at most the model's vocabulary on the paged runner)."""
    eos_token_id: int | None = Field(default=None, ge=0)
    """EOS id of requests generated from the workload (the fake and simulated runners emit
    it at each request's sampled output length; None: never)."""


class DraftAcceptanceConfig(StrictModel):
    """Per-request draft acceptance of the fake and simulated runners, drawn from a Beta
    distribution (``a = mean * concentration``, ``b = (1 - mean) * concentration``)."""

    mean: float = Field(ge=0.0, le=1.0)
    """The requests' mean chance that a draft is right."""
    concentration: float = Field(default=10.0, gt=0.0)
    """How closely the requests stay to the mean (larger: closer)."""


DraftAcceptance = Annotated[float, Field(ge=0.0, le=1.0)] | DraftAcceptanceConfig | None


class FakeRunnerConfig(_RunnerBase):
    kind: Literal["fake"] = "fake"
    """Which model runner executes the steps: a deterministic model with no weights."""
    step_time_ms: float = Field(default=10.0, gt=0)
    """Virtual duration of one fake-runner step, which drives the engine's clock."""
    clock: Literal["virtual", "wall"] = "virtual"
    """``virtual``: steps take no real time and advance the engine's virtual clock by
    ``step_time_ms``; ``wall``: each step sleeps ``step_time_ms`` and the engine runs on
    the wall clock (a stand-in model behind ``schedkit serve``)."""
    draft_acceptance: DraftAcceptance = None
    """With scheduler.num_speculative_tokens: each request's chance that a draft is right
    (a number for all, or ``{mean, concentration}``: drawn per request from a Beta
    distribution); None: every third draft position is wrong."""


class SimulatedRunnerConfig(_RunnerBase):
    kind: Literal["simulated"] = "simulated"
    """Which model runner executes the steps: fake tokens, cost-model step durations."""
    profile: str = "h200-qwen2.5-0.5b-handset"
    """Cost-model profile, a bundled name or a JSON file path (a relative path is looked
    up next to the config file first, then from the working directory)."""
    draft_acceptance: DraftAcceptance = None
    """With scheduler.num_speculative_tokens: each request's chance that a draft is right
    (a number for all, or ``{mean, concentration}``: drawn per request from a Beta
    distribution); None: every third draft position is wrong."""
    draft_token_s: float | None = Field(default=None, ge=0.0)
    """Seconds each proposed draft costs its proposer (a draft model's pass per draft,
    which a profile fitted with a model-free proposer does not know); None: the
    profile's ``per_draft_token_s``."""


class DraftModelConfig(StrictModel):
    """The draft model of ``speculative_method: draft_model``: a smaller model sharing the
    target's tokenizer (its vocabulary must match, or its folder carry the target's
    tokenizer files where its embedding is padded to another size)."""

    name: str | None = Field(default=None, min_length=1)
    """The draft's weights, as ``model.name`` takes them (a built-in name or a folder of
    config.json and safetensors); None: the target's own."""
    seed: int = Field(default=0, ge=0)
    """Seed of a built-in random-weight draft model."""
    num_layers: int | None = Field(default=None, ge=1)
    """Run only the model's first this many decoder layers (then its final norm and
    head): a truncated model drafting for the whole one. None: every layer."""


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
    speculative_method: Literal["ngram", "suffix", "draft_model", "eagle"] = "ngram"
    """Proposer of draft tokens (with scheduler.num_speculative_tokens > 0): ngram (the
    tokens after the latest earlier occurrence of the last 1-3 tokens, within the
    request's last 1,024), suffix (suffix decoding: suffix trees of the request's
    tokens and of recent requests' outputs, the continuation seen most often),
    draft_model (a smaller model's greedy continuation, ``draft_model``; its KV cache
    lies on the target's blocks) or eagle (an EAGLE head over the target's hidden
    states, its folder in ``draft_model.name``)."""
    draft_model: DraftModelConfig | None = None
    """draft_model: the model drafting (None: the target's own weights, every layer);
    eagle: the head's folder in ``name``."""
    suffix_max_depth: int = Field(default=16, ge=2, le=64)
    """suffix: longest suffix kept in a tree (the longest match plus continuation); a
    request's tree holds up to its length times this many nodes."""
    suffix_max_cached_tokens: int = Field(default=100_000, ge=0)
    """suffix: most output tokens of finished requests in the shared tree (the oldest go
    first; 0: only each request's own tree)."""
    suffix_min_probability: float = Field(default=0.1, ge=0.0, le=1.0)
    """suffix: least share of the occurrences of its context a drafted token needs."""

    @model_validator(mode="after")
    def _draft_model_only_for_its_method(self) -> PagedRunnerConfig:
        method, dm = self.speculative_method, self.draft_model
        if dm is not None and method not in ("draft_model", "eagle"):
            raise ValueError(f"draft_model is set but speculative_method is {method!r}: "
                             "set speculative_method: draft_model (or eagle) to draft with it")
        if method == "eagle" and (dm is None or dm.name is None):
            raise ValueError("speculative_method: eagle needs the head's folder in draft_model.name")
        if method == "eagle" and dm is not None and dm.num_layers is not None:
            raise ValueError("draft_model.num_layers does not apply to an EAGLE head (it has one layer)")
        return self


class PluginRunnerConfig(_RunnerBase):
    """The section of a runner another package registers (``schedkit.runners``)."""

    kind: str = Field(min_length=1)
    """Which model runner executes the steps: an installed runner's entry-point name."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """The runner's own settings; its ``from_config`` reads ``config.runner.settings`` and
    validates them."""


RUNNER_CONFIGS: dict[str, type[_RunnerBase]] = {
    "fake": FakeRunnerConfig, "simulated": SimulatedRunnerConfig, "paged": PagedRunnerConfig}
"""schedkit's own runner kinds -> the model of their ``runner`` section (any other kind's
section is a :class:`PluginRunnerConfig`)."""
_PLUGIN_TAG = "plugin"


def _runner_tag(value: Any) -> str | None:
    """The model a ``runner`` section is validated with: its ``kind``'s own (``fake``
    when the key is left out), else the plugin runners' one; None for no mapping."""
    if isinstance(value, dict):
        kind = value.get("kind", "fake")
    elif isinstance(value, _RunnerBase):
        kind = value.kind
    else:
        return None
    return kind if isinstance(kind, str) and kind in RUNNER_CONFIGS else _PLUGIN_TAG


RunnerConfig = Annotated[
    Annotated[FakeRunnerConfig, Tag("fake")]
    | Annotated[SimulatedRunnerConfig, Tag("simulated")]
    | Annotated[PagedRunnerConfig, Tag("paged")]
    | Annotated[PluginRunnerConfig, Tag(_PLUGIN_TAG)],
    Field(discriminator=Discriminator(_runner_tag)),
]
"""The ``runner`` section: one model per runner kind (a union tagged by ``kind``), so a
key the chosen runner does not have is refused."""


def runner_error(loc: tuple[int | str, ...], e: Any) -> tuple[tuple[int | str, ...], Any, str] | None:
    """An error in the ``runner`` section as (key path, value, message) at the YAML's own
    keys, or None for any other error. pydantic names the chosen member of the tagged
    union in the path (``runner.paged.device``) and reports a section that is no mapping
    on the whole section."""
    if loc[:1] != ("runner",):
        return None
    if e["type"] == "union_tag_not_found":
        return loc, e.get("input"), "Input should be a mapping (the runner section)"
    if len(loc) < 2 or loc[1] not in (*RUNNER_CONFIGS, _PLUGIN_TAG):
        return None
    tag, loc = loc[1], (loc[0], *loc[2:])
    if e["type"] != "extra_forbidden":
        return loc, e.get("input"), e["msg"]
    owners = [k for k, model in RUNNER_CONFIGS.items() if loc[-1] in model.model_fields]
    whose = f" (a key of the {' and '.join(owners)} runner)" if owners else ""
    if tag == _PLUGIN_TAG:
        misspelt = (f"; if runner.kind was meant to be the {' or '.join(owners)} runner, it is misspelt"
                    if owners else "")
        return loc, e.get("input"), (f"unknown key for an installed runner's section{whose}; its own "
                                     f"settings go under runner.settings{misspelt}")
    return loc, e.get("input"), f"unknown key for runner kind {tag!r}{whose}"
