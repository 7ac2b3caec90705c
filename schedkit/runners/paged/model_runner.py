"""PagedModelRunner: executes scheduler steps on a real Llama / Qwen2-family model.

Runs in the engine-core process. Each :meth:`PagedModelRunner.execute` updates the
per-request state from the SchedulerOutput (new, running, resumed, preempted and
finished requests), packs the step's tokens, runs one forward pass over the paged KV
cache (a captured CUDA graph for decode-only batches on CUDA), samples, and copies the
sampled ids to the host once.

:meth:`PagedModelRunner.execute_async` (async scheduling) returns as soon as the step
is launched. The next step may then be launched before this one's tokens reach the
host: each token sampled by a step still in flight is a placeholder in the host token
rows, and the next step's inputs take it from the device tensor the sampler wrote.

Structured outputs: when the step carries a ``grammar_bitmask``, the logits rows of
the structured requests' sampled positions (row ``structured_output_request_ids[rid] + j``
of the bitmask for the ``j``-th row of ``rid``'s sample slice: its next token, then the
position after each draft) get their disallowed tokens set to -inf right after
``compute_logits`` and before the sampler, on every path (eager, CUDA graphs: the
logits are computed outside the graph; async scheduling; drafts, which are then
verified against masked targets). The words go to the device in one copy (through a
pinned staging buffer on CUDA, viewed without a copy on the CPU) with the row indices;
:func:`~schedkit.runners.paged.sampler.apply_grammar_bitmask` does the rest on the
device without a host sync. Other rows are untouched.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.errors import ConfigError

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ConfigError("runner.kind = 'paged' needs PyTorch: pip install 'schedkit[paged]'") from e

from schedkit.core.outputs import (
    DRAFT_PADDING,
    DRAFT_PLACEHOLDER,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from schedkit.core.request import SamplingParams
from schedkit.runners.drafting import DraftProposer, NgramProposer, make_proposer
from schedkit.runners.paged.attention_metadata import AttentionMetadata
from schedkit.runners.paged.cpu_linear import (
    WARM_ROWS,
    cpu_compute_dtype,
    prepare_cpu_model,
    warm_gemm_row_counts,
)
from schedkit.runners.paged.device_inputs import device_inputs
from schedkit.runners.paged.draft_model import DraftModel
from schedkit.runners.paged.eagle_drafter import EagleDrafter
from schedkit.runners.paged.input_batch import InputBatch, RequestState, StepInputs
from schedkit.runners.paged.kv_cache import (
    KVCacheAllocationError,
    allocate_kv_cache,
    num_blocks_from_free_memory,
)
from schedkit.runners.paged.kv_offload import CPUOffloadWorker
from schedkit.runners.paged.loader import load_model, read_model_args, resolve_model_path
from schedkit.runners.paged.models import CausalLM, ModelArgs
from schedkit.runners.paged.models.eagle import EagleHead, load_eagle_head
from schedkit.runners.paged.sampler import Sampler, SamplingBatch, apply_grammar_bitmask

logger = logging.getLogger(__name__)

DRAFT_FAILURE_LOG_S = 10.0
"""At most one log line per this many seconds for a drafter failing inside steps."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class RunnerOptions:
    """Settings of a PagedModelRunner (normally taken from the config)."""

    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    attention_backend: str = "auto"
    use_cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = 256
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    kv_cache_dtype: str | None = None
    """The cache's dtype (None: the model's parameters'); the model's dtype when the CPU
    computes in float32 (``runner.compute_dtype``)."""
    proposer: DraftProposer = field(default_factory=NgramProposer)
    """Where draft tokens come from (``runner.speculative_method``) unless a draft
    model is given."""
    num_speculative_tokens: int = 0
    """``scheduler.num_speculative_tokens``: with a draft model, the lookahead slots it
    needs past each step's tokens."""
    drafts_in_step: bool = False
    """Asynchronous scheduling with speculation: each step proposes the drafts the
    scheduler left placeholders for, once the step before it is settled on the host."""


@dataclass(slots=True)
class _Parked:
    """What a preempted request keeps until it resumes (its KV and row are gone)."""

    num_prompt_tokens: int
    params: SamplingParams


@dataclass(slots=True)
class _InFlightStep:
    """A launched step: its sampled tokens on the device, their host copy (complete once
    ``copied`` has fired, on CUDA) and where each token belongs."""

    runner: PagedModelRunner
    req_ids: list[str]
    t0: float
    tokens: Any = None
    """[N] int64 sampled ids on the device (None if nothing was sampled)."""
    host_tokens: Any = None
    copied: Any = None
    """A CUDA event recorded after the device-to-host copy (None on CPU)."""
    finished_ids: set[str] = field(default_factory=set)
    """Requests finished before this step (told to the connector's ``get_finished``)."""
    slices: list[tuple[int, int]] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    placeholders: list[tuple[RequestState, int, int]] = field(default_factory=list)
    """(request state, token position, index in ``tokens``) per pending token."""
    num_proposed: dict[str, int] = field(default_factory=dict)
    """Requests drafted inside the step -> the drafts proposed (the rest padding)."""
    sampled: list[list[int]] | None = None
    """Per request, its tokens (the accepted drafts and the bonus) once settled."""
    done: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        """Wait for the sampled tokens (the step's one device-to-host copy)."""
        if self.done is None:
            self.done = self.runner._collect(self)
        return self.done


class PagedModelRunner:
    """Args:
        model: The loaded model, on its device.
        options: Runner settings.
        model_path: The folder the model came from (for tokenizers and messages).
    """

    def __init__(self, model: CausalLM, options: RunnerOptions,
                 model_path: Path | None = None, draft_model: CausalLM | EagleHead | None = None) -> None:
        self.model = model
        self.args: ModelArgs = model.args
        self.options = options
        self.model_path = model_path
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = DTYPES[options.kv_cache_dtype] if options.kv_cache_dtype else self.dtype
        self.attention_backend = resolve_attention_backend(options.attention_backend, self.device,
                                                           self.args.head_dim, self.kv_dtype)
        """What ``auto`` became on this machine: ``triton``, ``cpu`` or ``torch``."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.draft: DraftModel | EagleDrafter | None = None
        """The drafting model (``speculative_method``: a draft model or an EAGLE head), else None."""
        if isinstance(draft_model, EagleHead):
            self.draft = EagleDrafter(draft_model, model, self.attention_backend, self.kv_dtype)
        elif draft_model is not None:
            self.draft = DraftModel(draft_model, self.attention_backend, self.kv_dtype,
                                    options.max_num_batched_tokens, target_vocab_size=model.args.vocab_size)
        self.input_batch: InputBatch | None = None
        self.sampler = Sampler(self.device, options.seed)
        self.graphs: Any = None
        self._parked: dict[str, _Parked] = {}
        self._in_flight: _InFlightStep | None = None
        """The last launched step while its tokens have not been collected."""
        self.num_draft_failures = 0
        """Steps whose drafts the drafter failed to propose inside the step (they ran
        without); ``EngineCore.num_draft_failures`` counts them too."""
        self._draft_failure_logged = float("-inf")
        self._num_uncollected = 0
        self.kv_connector: Any = None
        """The worker side of the KV connector, if one is configured."""
        self._grammar_staging: list[torch.Tensor | None] = [None, None]
        """Pinned host buffers (CUDA) for the bitmask words and row indices, used in
        turn: with two steps in flight one may still be copying."""
        self._grammar_turn = 0
        self._bit_shifts: torch.Tensor | None = None
        self._grammar_kernel: bool | None = None
        """Whether the bitmask is applied by the compiled CPU kernel (decided at first use)."""

    check_grammar_bitmask = False
    """Debug: raise AssertionError when a structured row allows no token (costs a host
    sync per step). Off, such a row samples its unmasked argmax."""

    checks_token_ids = True
    """Prompt token ids index the embedding: the engine rejects those >= vocab_size."""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary."""
        return self.args.vocab_size

    @property
    def drafts_from_hidden_states(self) -> bool:
        """Whether the drafter reads the target's hidden states (an EAGLE head): the
        engine then calls :meth:`propose_draft_token_ids` after every step, plan or
        not (under asynchronous scheduling the runner does, inside every step), and a
        prefix hit leaves out its last block, whose hidden states the head needs."""
        return isinstance(self.draft, EagleDrafter)

    @property
    def drafts_in_step(self) -> bool:
        """Whether the runner proposes the drafts of :data:`DRAFT_PLACEHOLDER` slots
        inside the step (``options.drafts_in_step``), as asynchronous scheduling with
        speculation needs."""
        return self.options.drafts_in_step

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past each step's tokens the scheduler allocates for the draft model's
        own drafts (its KV lies on the target's blocks); 0 without one."""
        return self.options.num_speculative_tokens if self.draft is not None else 0

    @property
    def attention_workers(self) -> int:
        """The threads the CPU attention kernel spreads a step's sequences over (torch's
        own); 0 on CUDA, where the cost model does not read the imbalance."""
        return torch.get_num_threads() if self.device.type == "cpu" else 0

    @property
    def device_name(self) -> str | None:
        """The GPU's name on CUDA (calibration records it); None on the CPU."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any) -> PagedModelRunner:
        """Load the model named by ``config.model`` onto ``config.runner.device``.

        Raises:
            ConfigError: Missing or unsupported model, or a config the model cannot serve.
        """
        rc, sc = config.runner, config.scheduler
        if rc.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("runner.device = 'cuda' but no CUDA device is available")
        if rc.attention_backend == "triton" and rc.device == "cpu":
            raise ConfigError("runner.attention_backend = 'triton' needs runner.device = 'cuda'")
        if rc.num_threads is not None and rc.device == "cpu":
            torch.set_num_threads(rc.num_threads)
        path = resolve_model_path(config.model.name, config.model.seed)
        args = read_model_args(path)
        check_fits(config, args)
        model_dtype = DTYPES[config.model.dtype]
        if rc.attention_backend == "cpu":  # refused before the weights load, not after
            resolve_attention_backend("cpu", torch.device(rc.device), args.head_dim, model_dtype)
        model = load_model(path, args, dtype=model_dtype,
                           device=torch.device(rc.device), max_positions=sc.max_model_len + 32)
        if rc.device == "cpu":
            prepare_cpu_model(model, cpu_compute_dtype(model_dtype, rc.compute_dtype))
        draft: CausalLM | EagleHead | None = None
        dm = rc.draft_model
        if rc.speculative_method == "draft_model" and sc.num_speculative_tokens:
            # The target's own weights, whole, serve as their own draft without a copy.
            own = dm is None or (dm.name is None and dm.num_layers is None)
            draft = model if own else load_draft_model(config, args, model_dtype)
        elif rc.speculative_method == "eagle" and sc.num_speculative_tokens:
            draft = load_eagle(config, args, model_dtype)
        options = RunnerOptions(
            max_model_len=sc.max_model_len, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs, attention_backend=rc.attention_backend,
            use_cuda_graphs=not rc.enforce_eager and rc.attention_backend != "torch",
            cuda_graph_max_batch_size=min(rc.cuda_graph_max_batch_size, sc.max_num_seqs),
            gpu_memory_utilization=rc.gpu_memory_utilization, seed=rc.seed,
            kv_cache_dtype=config.model.dtype, proposer=make_proposer(rc),
            num_speculative_tokens=sc.num_speculative_tokens,
            drafts_in_step=sc.async_scheduling and bool(sc.num_speculative_tokens))
        return cls(model, options, path, draft)

    def initialize(self, num_blocks: int, block_size: int) -> int:
        """Allocate the KV cache (on CUDA: what fits in memory, at most ``num_blocks``)
        and capture decode CUDA graphs; returns the usable number of blocks.

        Raises:
            KVCacheAllocationError: The cache does not fit.
        """
        opts = self.options
        if self.device.type == "cuda":
            peak = self._profile_peak_memory(block_size)
            fit = num_blocks_from_free_memory(self.args, block_size, self.kv_dtype, self.device,
                                              opts.gpu_memory_utilization, peak,
                                              self.draft.bytes_per_block(block_size) if self.draft else 0)
            min_blocks = -(-opts.max_model_len // block_size) + 1
            if fit < min_blocks:
                raise KVCacheAllocationError(
                    f"only {fit} KV blocks fit in runner.gpu_memory_utilization="
                    f"{opts.gpu_memory_utilization} of GPU memory; one max_model_len="
                    f"{opts.max_model_len} sequence needs {min_blocks}")
            num_blocks = min(num_blocks, fit)
        self.kv_caches = allocate_kv_cache(self.args, num_blocks, block_size, self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.initialize(num_blocks, block_size)
        self.input_batch = InputBatch(opts.max_model_len, block_size, max(opts.max_num_seqs, 8))
        if self.device.type == "cpu":  # oneDNN builds each GEMM shape's kernels on its first call
            self._full_budget_pass(block_size)
            warm_gemm_row_counts(self.model, min(WARM_ROWS, opts.max_num_batched_tokens))
        if self.device.type == "cuda" and opts.use_cuda_graphs:
            from schedkit.runners.paged.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, opts.cuda_graph_max_batch_size,
                                       self.input_batch.max_blocks, self.args.num_kv_heads, block_size)
            self.graphs.capture()
        return num_blocks

    def close(self) -> None:
        """Free the KV cache, the captured graphs and the weights now, not when the
        engine's reference cycles are next collected (the runner cannot step after)."""
        self.kv_caches = []
        self.draft = None
        self.graphs = None
        self.__dict__.pop("model", None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def set_kv_connector(self, connector: Any) -> None:
        """Use ``connector`` (worker side): it sees this runner's KV cache, loads into it
        before each step's forward pass and saves from it after."""
        self.kv_connector = connector
        # An EAGLE head's KV moves with the target's through a swap (saved after the head
        # caught up); a draft model recomputes a resumed request, and stores that save
        # right after the forward pass would keep the head's stale.
        head = self.draft if isinstance(self.draft, EagleDrafter) and isinstance(connector, CPUOffloadWorker) else None
        connector.register_kv_caches(self.kv_caches + (head.kv_caches if head is not None else []))

    @torch.inference_mode()
    def _profile_peak_memory(self, block_size: int) -> int:
        """Peak bytes of a forward + sampling pass over a full token budget (weights included)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._full_budget_pass(block_size)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _full_budget_pass(self, block_size: int) -> None:
        """A forward + sampling pass over a full token budget (one prompt of
        ``max_num_batched_tokens``) on a cache of its own: the peak-memory probe on CUDA,
        and on the CPU the warm-up that has oneDNN build its GEMM kernels for that shape
        before the first real prefill step (vLLM's profile run does both)."""
        opts = self.options
        n = min(opts.max_num_batched_tokens, opts.max_model_len)
        caches = allocate_kv_cache(self.args, -(-n // block_size) + 1, block_size, self.kv_dtype,
                                   self.device)
        ib = InputBatch(opts.max_model_len, block_size, 1)
        ib.add("profile", [0] * n, n, list(range(1, len(caches[0][0]))), 0, SamplingParams())
        inputs = ib.prepare({"profile": n}, {})
        input_ids, positions, meta = self._device_inputs(inputs)
        hidden = self.model(input_ids, positions, caches, meta)
        num_rows = min(opts.max_num_seqs, n)
        logits = self.model.compute_logits(hidden[:num_rows])
        rows = torch.arange(num_rows, dtype=torch.int32, device=self.device)
        apply_grammar_bitmask(logits, torch.full((num_rows, (self.args.vocab_size + 31) // 32), -1,
                                                 dtype=torch.int32, device=self.device), rows, rows)
        self.sampler(logits, SamplingBatch.build([SamplingParams(top_k=5, top_p=0.9)] * num_rows,
                                                 [0] * num_rows, self.args.vocab_size, self.device))
        del caches, hidden, logits

    # -- one step --------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; returns the sampled tokens of every scheduled request."""
        return self.execute_async(scheduler_output).result()

    @torch.inference_mode()
    def execute_async(self, scheduler_output: SchedulerOutput) -> _InFlightStep:
        """Launch one step; ``result()`` of the returned handle waits for its tokens.

        At most one earlier step may still be in flight: the tokens it samples feed
        this step's inputs on the device.
        """
        t0 = time.perf_counter()
        assert self._num_uncollected <= 1, "more than two steps in flight"
        if self.options.drafts_in_step:
            try:
                if self._in_flight is not None:
                    self._settle(self._in_flight)  # its accepted drafts place this step's tokens
                if scheduler_output.preempted_req_ids and self.drafts_from_hidden_states:
                    self._propose_or_none({})  # the head's KV of the victims' last step, before it is swapped out
            except BaseException:  # the device failed: the runner still follows the scheduler
                self._update_states(scheduler_output)
                raise
        self._update_states(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        step = _InFlightStep(self, req_ids, t0, finished_ids=scheduler_output.finished_req_ids)
        if not req_ids:  # still polls the connector: transfers go on between steps
            if self.kv_connector is not None:  # and moves what it was told (a victim's save)
                self.kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
                self.kv_connector.start_load_kv(None)
            step.done = ModelRunnerOutput([], {}, [], step_duration=time.perf_counter() - t0,
                                          kv_connector_output=self._connector_output(step))
            return step
        ib = self.input_batch
        assert ib is not None, "initialize() was not called"
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv(None)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if self.options.drafts_in_step:  # after the connector saved what leaves and loaded what returns
            drafts, step.num_proposed = self._draft_in_step(drafts)
        inputs = ib.prepare(scheduler_output.num_scheduled_tokens, drafts)
        grammar = self._grammar_inputs(scheduler_output, req_ids, inputs.sample_slices)
        fill = None
        if inputs.fill_rows:  # tokens the step in flight is sampling
            prev = self._in_flight
            assert prev is not None and prev.done is None and prev.tokens is not None
            fill = (torch.tensor(inputs.fill_rows, dtype=torch.int64).to(self.device, non_blocking=True),
                    torch.tensor(inputs.fill_src, dtype=torch.int64).to(self.device, non_blocking=True),
                    prev.tokens)
        hidden = self._forward(inputs, fill)
        if isinstance(self.draft, EagleDrafter):
            self.draft.observe(inputs, hidden)
        if connector is not None:
            connector.wait_for_save()
        step.slices, step.drafts, step.placeholders = inputs.sample_slices, drafts, inputs.placeholders
        if len(inputs.logits_indices):
            idx = torch.from_numpy(inputs.logits_indices).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[idx])
            if grammar is not None:  # before any temperature, top-k/top-p or argmax
                self._apply_grammar(logits, grammar, req_ids, inputs.sample_slices)
            batch = SamplingBatch.build(inputs.sample_params, inputs.sample_positions,
                                        self.args.vocab_size, self.device)
            step.tokens = self.sampler(logits, batch)
            if self.device.type == "cuda":
                step.host_tokens = step.tokens.to("cpu", non_blocking=True)  # pinned
                step.copied = torch.cuda.Event()
                step.copied.record()
            else:
                step.host_tokens = step.tokens
        self._in_flight = step
        self._num_uncollected += 1
        return step

    def _grammar_inputs(self, so: SchedulerOutput, req_ids: list[str],
                        slices: list[tuple[int, int]]) -> _GrammarInputs | None:
        """The step's bitmask words and row indices, on their way to the device (queued
        before the forward pass, so the copy overlaps it); None without structured rows.

        Raises:
            ValueError: A malformed bitmask (a bug upstream).
        """
        bitmask = so.grammar_bitmask
        if bitmask is None or not so.structured_output_request_ids:
            return None
        logit_rows, mask_rows = grammar_rows(so.structured_output_request_ids, bitmask.num_rows,
                                             req_ids, slices)
        if not logit_rows:
            return None
        num_rows, num_words = bitmask.num_rows, bitmask.num_words
        if bitmask.words.itemsize != 4 or len(bitmask.words) != num_rows * num_words:
            raise ValueError(f"grammar bitmask: expected {num_rows} x {num_words} 32-bit words, got "
                             f"{len(bitmask.words)} of {bitmask.words.itemsize} bytes")
        if num_words == 0:  # nothing allowed: no buffer to view
            words = torch.zeros(0, dtype=torch.int32)
        else:
            words = torch.frombuffer(bitmask.words, dtype=torch.int32)  # a view, no copy
        if self.device.type == "cuda":
            dev = _stage_grammar(self, words, logit_rows, mask_rows, num_rows, num_words)
        else:  # the view itself: only the rows used are gathered, on the device
            idx = torch.tensor((logit_rows, mask_rows), dtype=torch.int32)
            dev = words.view(num_rows, num_words), idx[0], idx[1]
        return _GrammarInputs(*dev, logit_rows, mask_rows)

    def _apply_grammar(self, logits: torch.Tensor, g: _GrammarInputs, req_ids: list[str],
                       slices: list[tuple[int, int]]) -> None:
        """Mask the logits rows of the step's structured requests (before sampling): on
        the CPU in one pass of the compiled kernel, elsewhere with torch ops."""
        if self._grammar_kernel is None:
            from schedkit.runners.paged.cpu_kernels import load_cpu_kernels

            self._grammar_kernel = self.device.type == "cpu" and load_cpu_kernels() is not None
        if self._grammar_kernel and logits.dtype == torch.float32 and logits.is_contiguous():
            from schedkit.runners.paged.cpu_kernels import apply_grammar_bitmask_cpu

            none_allowed = apply_grammar_bitmask_cpu(logits, g.words.contiguous(), g.dev_logit_rows,
                                                     g.dev_mask_rows)
        else:
            if self._bit_shifts is None:
                self._bit_shifts = torch.arange(32, dtype=torch.int32, device=self.device)
            none_allowed = apply_grammar_bitmask(logits, g.words, g.dev_logit_rows, g.dev_mask_rows,
                                                 self._bit_shifts)
        if self.check_grammar_bitmask and bool(none_allowed.any()):  # debug only: a host sync
            owner = {r: rid for rid, (a, b) in zip(req_ids, slices, strict=True) for r in range(a, b)}
            bad = [(owner[g.logit_rows[j]], g.mask_rows[j]) for j in none_allowed.nonzero()[:, 0].tolist()]
            raise AssertionError(f"grammar bitmask rows allow no token below the vocabulary size "
                                 f"{logits.shape[1]}: (request, bitmask row) {bad}")

    def _collect(self, step: _InFlightStep) -> ModelRunnerOutput:
        """The step's tokens on the host: placeholders filled, drafts verified."""
        req_ids = step.req_ids
        try:
            sampled = self._settle(step)
        finally:  # collected, even if the device failed: the pipeline must not wedge
            self._num_uncollected -= 1
            if self._in_flight is step:
                self._in_flight = None
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, step_duration=time.perf_counter() - step.t0,
                                 kv_connector_output=self._connector_output(step), num_proposed_drafts=step.num_proposed)

    def _settle(self, step: _InFlightStep) -> list[list[int]]:
        """Bring the step's tokens to the host (once): its pending tokens written, its
        drafts verified and the accepted ones appended. With drafts proposed inside
        each step, the next launch settles the step before it (a device sync on CUDA)."""
        if step.sampled is not None:
            return step.sampled
        ib = self.input_batch
        assert ib is not None
        req_ids = step.req_ids
        sampled: list[list[int]] = [[] for _ in req_ids]
        if step.tokens is not None:
            if step.copied is not None:
                step.copied.synchronize()
            tokens = step.host_tokens.tolist()
            ib.resolve(step.placeholders, tokens)
            drafts = step.drafts
            for i, (a, b) in enumerate(step.slices):
                if a == b:
                    continue
                if drafts and drafts.get(req_ids[i]):
                    sampled[i] = _accept(tokens[a:b], drafts[req_ids[i]])
                    if req_ids[i] in ib.states:
                        ib.append_tokens(req_ids[i], sampled[i])
                else:
                    sampled[i] = tokens[a:b]
        step.sampled = sampled
        return sampled

    def _propose_or_none(self, plan: Mapping[str, int]) -> dict[str, list[int]]:
        """:meth:`propose_draft_token_ids` inside a step: a drafter that fails costs the
        step its drafts only (counted, logged at most every DRAFT_FAILURE_LOG_S)."""
        try:
            return self.propose_draft_token_ids(plan)
        except Exception as e:
            self.num_draft_failures += 1
            now = time.monotonic()
            if now - self._draft_failure_logged >= DRAFT_FAILURE_LOG_S:
                self._draft_failure_logged = now
                logger.error("the drafter failed (%s: %s; %d times so far); this step runs without drafts",
                             type(e).__name__, e, self.num_draft_failures)
            return {}

    def _draft_in_step(self, scheduled: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, int]]:
        """The step's drafts with its placeholders proposed, and how many were proposed
        per request: the drafter caught up on the settled step before (an EAGLE head
        every step); a request it drafts fewer for (its catch-up cut to the budget) is
        padded with never-accepted slots."""
        plan = {rid: len(d) for rid, d in scheduled.items() if d and d[0] == DRAFT_PLACEHOLDER}
        if not plan and not self.drafts_from_hidden_states:
            return scheduled, {}
        proposed = self._propose_or_none(plan)
        drafts = dict(scheduled)
        num_proposed = {}
        for rid, k in plan.items():
            got = list(proposed.get(rid, ()))[:k]
            drafts[rid] = got + [DRAFT_PADDING] * (k - len(got))
            num_proposed[rid] = len(got)
        return drafts, num_proposed

    def _connector_output(self, step: _InFlightStep) -> KVConnectorOutput | None:
        """The transfers the worker-side connector finished since the last step."""
        if self.kv_connector is None:
            return None
        sending, recving = self.kv_connector.get_finished(step.finished_ids)
        if not sending and not recving:
            return None
        return KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()))

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        assert ib is not None, "initialize() was not called"
        for rid in so.finished_req_ids:
            st = ib.states.get(rid)
            proposer = self.options.proposer
            if proposer.keeps_outputs and st is not None:
                proposer.finish(rid, ib.token_ids[st.row, :st.num_tokens].tolist(), st.num_prompt_tokens)
            else:
                proposer.finish(rid)
            ib.remove(rid)
            self._parked.pop(rid, None)
        for rid in so.preempted_req_ids:
            st = ib.remove(rid)
            if st is not None:
                self._parked[rid] = _Parked(st.num_prompt_tokens, st.sampling_params)
        for new in so.scheduled_new_reqs:
            ib.add(new.req_id, new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                   new.block_ids, new.num_computed_tokens, new.sampling_params)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                parked = self._parked.pop(rid, None)
                assert parked is not None, f"{rid}: resumed but never preempted while known"
                ib.add(rid, cached.resumed_token_ids[rid], parked.num_prompt_tokens, blocks or [],
                       cached.num_computed_tokens[i], parked.params)
                continue
            st = ib.states[rid]
            if blocks:
                ib.append_blocks(rid, blocks)
            appended = cached.appended_token_ids.get(rid)
            if appended:  # tokens jump-forward decoding appended: this step computes them
                ib.append_tokens(rid, appended)
            known = st.num_prompt_tokens + cached.num_output_tokens[i]
            # Planned before the step in flight's output was processed (drafts proposed
            # inside the step), the scheduler still counts the drafts that step rejected.
            behind = known - st.num_tokens
            assert behind <= 0 or self.options.drafts_in_step, \
                f"{rid}: scheduler knows tokens the runner never sampled"
            st.num_computed_tokens = cached.num_computed_tokens[i] - max(behind, 0)
            st.num_tokens = min(known, st.num_tokens)

    def _device_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return device_inputs(inputs, self.device, self.attention_backend, self.args.num_kv_heads)

    def _forward(self, inputs: StepInputs, fill: Any = None) -> torch.Tensor:
        """``fill``: (rows, source rows, source) to overwrite input ids on the device."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs, fill)
        input_ids, positions, meta = self._device_inputs(inputs)
        if fill is not None:
            dst, src, tokens = fill
            input_ids[dst] = tokens[src]
        return self.model(input_ids, positions, self.kv_caches, meta)

    def propose_draft_token_ids(self, num_spec_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """Drafts continuing the tokens of each request planned some: the drafting
        model's (an EAGLE head also catches up on the last step, planned or not: the
        engine calls this after every step then, or the runner inside every step under
        asynchronous scheduling), else the configured proposer's (``options.proposer``:
        n-gram or suffix decoding). The scheduler drops those of requests still
        prefilling."""
        ib = self.input_batch
        if ib is None:
            return {}
        if self.draft is not None:
            return self.draft.propose(ib, num_spec_tokens, self.options.max_model_len)
        drafts = {}
        proposer = self.options.proposer
        for rid, k in num_spec_tokens.items():
            st = ib.states.get(rid)
            if st is None or k <= 0:
                continue
            known = ib.token_ids[st.row, :st.num_tokens].tolist()
            proposal = proposer.propose(rid, known, st.num_prompt_tokens, k)
            if proposal:
                drafts[rid] = proposal
        return drafts


def grammar_rows(first_rows: dict[str, int], num_rows: int, req_ids: list[str],
                 slices: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows) of the structured requests' sampled positions.

    ``first_rows``: request -> its first bitmask row; ``slices[i]``: the sampled rows of
    ``req_ids[i]`` in the logits (its next token, then one after each draft), matched
    in order with bitmask rows ``first, first + 1, ...``. A structured request that
    samples nothing this step (a prompt chunk) or is not scheduled is skipped.

    Raises:
        ValueError: A request's rows run past the bitmask (a bug upstream).
    """
    index = {rid: i for i, rid in enumerate(req_ids)}
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for rid, first in first_rows.items():
        i = index.get(rid)
        if i is None:
            continue
        a, b = slices[i]
        if a == b:
            continue
        if first < 0 or first + (b - a) > num_rows:
            raise ValueError(f"grammar bitmask: request {rid!r} samples {b - a} positions from row "
                             f"{first}, but the bitmask has {num_rows} rows")
        logit_rows.extend(range(a, b))
        mask_rows.extend(range(first, first + b - a))
    return logit_rows, mask_rows


@dataclass(slots=True)
class _GrammarInputs:
    """One step's bitmask on the device, and which logits rows it constrains."""

    words: torch.Tensor
    """[bitmask rows, words] int32."""
    dev_logit_rows: torch.Tensor
    dev_mask_rows: torch.Tensor
    logit_rows: list[int]
    mask_rows: list[int]


def _stage_grammar(runner: PagedModelRunner, words: torch.Tensor, logit_rows: list[int],
                   mask_rows: list[int], num_rows: int, num_words: int,
                   pin: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices and words through the runner's pinned staging buffer of this turn, then
    one non-blocking copy to the device. The buffer of a turn is reused two staged steps
    later: with at most two steps in flight, the older has been collected by then (its
    token copy, queued after this copy, completed)."""
    m = len(logit_rows)
    total = 2 * m + num_rows * num_words
    turn = runner._grammar_turn
    buf = runner._grammar_staging[turn]
    if buf is None or len(buf) < total:
        size = max(total, 2 * len(buf) if buf is not None else 0, 1024)
        buf = torch.empty(size, dtype=torch.int32, pin_memory=pin)
        runner._grammar_staging[turn] = buf
    runner._grammar_turn = turn ^ 1
    host = buf.numpy()
    host[:m] = logit_rows
    host[m:2 * m] = mask_rows
    buf[2 * m:total].copy_(words)
    dev = buf[:total].to(runner.device, non_blocking=True)
    return dev[2 * m:].view(num_rows, num_words), dev[:m], dev[m:2 * m]


def _accept(targets: list[int], drafts: Any) -> list[int]:
    """Target tokens up to and including the first that disagrees with its draft."""
    for j, d in enumerate(drafts):
        if targets[j] != d:
            return targets[:j + 1]
    return targets


def resolve_attention_backend(name: str, device: torch.device, head_dim: int,
                              kv_dtype: torch.dtype = torch.float32) -> str:
    """The attention implementation ``runner.attention_backend = name`` means here.

    Raises:
        ConfigError: ``cpu`` asked for where the kernel cannot serve (a CUDA device, no
            compiler, a head_dim that is not a multiple of 8, a float16 cache the
            compiler cannot hold).
    """
    if device.type == "cuda":
        if name == "cpu":
            raise ConfigError("runner.attention_backend = 'cpu' needs runner.device = 'cpu'")
        return "triton" if name == "auto" else name
    if name not in ("auto", "cpu"):
        return name
    from schedkit.runners.paged.cpu_kernels import build_error, load_cpu_kernels, supports_float16

    why = None
    if head_dim % 8:
        why = f"head_dim {head_dim} is not a multiple of 8"
    elif load_cpu_kernels() is None:
        why = f"the kernel could not be built: {build_error()}"
    elif kv_dtype == torch.float16 and not supports_float16():
        why = "float16 caches need a compiler with _Float16 (GCC >= 12, clang >= 15)"
    if why is None:
        return "cpu"
    if name == "cpu":
        raise ConfigError(f"runner.attention_backend = 'cpu': {why}")
    logger.warning("CPU attention kernel unavailable (%s); using the PyTorch reference", why)
    return "torch"


def load_draft_model(config: Any, target: ModelArgs, dtype: torch.dtype) -> CausalLM:
    """The draft model ``config.runner.draft_model`` names (the target's own weights
    when it names none), on the target's device and dtype.

    A draft whose embedding is padded to another size than the target's (Qwen2.5-0.5B's
    151,936 rows against Qwen2.5-7B's 152,064, one tokenizer) is accepted when its
    folder carries the very tokenizer files the target uses: it drafts from the
    vocabulary both cover (:class:`~schedkit.runners.paged.draft_model.DraftModel`).

    Raises:
        ConfigError: The draft cannot be loaded, keeps more layers than it has, or its
            vocabulary's size is not the target's and its folder lacks the target's
            tokenizer files.
    """
    rc = config.runner
    dm = rc.draft_model
    name = dm.name if dm is not None and dm.name is not None else config.model.name
    seed = dm.seed if dm is not None and dm.name is not None else config.model.seed
    path = resolve_model_path(name, seed)
    args = read_model_args(path)
    if args.vocab_size != target.vocab_size:
        target_tokenizer = resolve_model_path(config.model.name, config.model.seed)
        ours = tokenizer_fingerprint(target_tokenizer)
        if ours is None and config.model.tokenizer is not None and Path(config.model.tokenizer).is_dir():
            target_tokenizer = Path(config.model.tokenizer)
            ours = tokenizer_fingerprint(target_tokenizer)
        if ours is None or ours != tokenizer_fingerprint(path):
            raise ConfigError(
                f"runner.draft_model.name = {name!r}: its vocabulary has {args.vocab_size} tokens, the "
                f"target's {target.vocab_size}, and its folder does not carry the target's tokenizer files "
                f"({', '.join(TOKENIZER_FILES)}, as in {str(target_tokenizer)!r}); a draft model must share the "
                "target's tokenizer (one padded to another size is accepted with the same tokenizer files)")
    layers = dm.num_layers if dm is not None else None
    if layers is not None and layers > args.num_layers:
        raise ConfigError(f"runner.draft_model.num_layers = {layers}: {name!r} has only {args.num_layers} layers")
    model = load_model(path, args, dtype=dtype, device=torch.device(rc.device),
                       max_positions=config.scheduler.max_model_len + 32, first_layers=layers)
    if rc.device == "cpu":
        prepare_cpu_model(model, cpu_compute_dtype(dtype, rc.compute_dtype))
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
"""The files whose bytes say which tokenizer a model folder holds."""


def tokenizer_fingerprint(folder: Path) -> str | None:
    """A digest of the tokenizer files in ``folder`` (None: it holds none)."""
    digest, found = hashlib.sha256(), False
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            found = True
            data = f.read_bytes()
            digest.update(f"{name}:{len(data)}:".encode() + data)
    return digest.hexdigest() if found else None


def load_eagle(config: Any, target: ModelArgs, dtype: torch.dtype) -> EagleHead:
    """The EAGLE head in ``config.runner.draft_model.name``, on the target's device and dtype.

    Raises:
        ConfigError: No such folder, or not a head for this target.
    """
    rc = config.runner
    path = resolve_model_path(rc.draft_model.name, rc.draft_model.seed)
    head = load_eagle_head(path, read_model_args(path), target, dtype=dtype, device=torch.device(rc.device),
                           max_positions=config.scheduler.max_model_len + 32)
    if rc.device == "cpu":
        prepare_cpu_model(head, cpu_compute_dtype(dtype, rc.compute_dtype))
    return head


def check_fits(config: Any, args: ModelArgs) -> None:
    """Raise ConfigError where the config asks for more than the model offers."""
    sc, rc = config.scheduler, config.runner
    if sc.max_model_len > args.max_position_embeddings:
        raise ConfigError(f"scheduler.max_model_len = {sc.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({args.max_position_embeddings})")
    if rc.vocab_size > args.vocab_size:
        raise ConfigError(f"runner.vocab_size = {rc.vocab_size} exceeds the model's vocabulary "
                          f"({args.vocab_size}); it bounds generated workload token ids, so set "
                          f"it to at most {args.vocab_size}")
    if rc.eos_token_id is not None and rc.eos_token_id >= args.vocab_size:
        raise ConfigError(f"runner.eos_token_id = {rc.eos_token_id} is outside the model's "
                          f"vocabulary ({args.vocab_size})")
