"""The simulator's cost model: a step's shape (:class:`StepFeatures`), read from the
scheduler's output, and its predicted duration (:class:`CostModel`), loaded from a
profile (``schedkit/runners/profiles/*.json``, fitted by ``schedkit calibrate``)::

    t = base + per_token * tokens + per_request * requests
        + per_context_token * context tokens read + per_prefill_attention * sum(n * (computed + n / 2))
        + per_shared_context_token * context tokens read again
        + per_idle_context_token * attention imbalance   (decode-only steps)
        + per_draft_token * draft tokens verified   (their proposer's work)
        + per_prefill_step * [a chunk of more than one token] + per_mixed_step * [and a one-token one]
        + per_sampled_row * rows sampled + per_random_row * rows on the random path
        + per_filtered_row * rows through top-k / top-p + per_grammar_row * rows under a grammar
        + per_block_store * KV blocks swapped out + per_block_load * KV blocks swapped in
        + decode_batch_residual(requests)   (decode-only steps)

``tokens`` is every token computed in the step; ``context tokens read`` sums, over the
scheduled requests, the KV positions their attention reads (computed + n), less those
*read again*: the positions of a full KV block that another request of the same step
reads too (requests sharing a cached prefix). A block several requests read in one step
is fetched from memory once and then found in the CPU's (or GPU's) cache, so its
further reads cost less; a profile without the coefficient charges them as any read.
The *attention imbalance* of a decode step is what its attention kernel's workers
(the CPU runner's threads, :attr:`CostModel.attention_workers`) stand idle: each sequence is
one work item of its key reads, so a batch of one keeps one thread busy and the others
waiting, and a batch of three on two threads finishes when the thread with two is done.
It is ``workers * makespan - sum(keys)`` with the items placed longest first, and it makes
a long context cost about twice as much per token at batch 1 as at batch 16 on two
threads. The fifth term is the quadratic part of prefill attention. A step that computes a multi-token chunk pays
``per_prefill_step`` (on CUDA it runs eagerly, where decode-only steps replay a captured
CUDA graph), and a mixed one (chunks and one-token decodes together) ``per_mixed_step``
besides. A sampled row is one position whose logits are computed and sampled (a request
whose chunk reaches its last token, plus one per draft token). The paged runner's sampler
works on the whole batch: when any row samples with a temperature, every row takes the
random path (softmax, cumulative sum, search), and when any row has top-k or top-p, every
row is sorted; the ``random`` and ``filtered`` rows count those. A grammar row is a
sampled row of a structured request (its bitmask is filled on the host and applied to
the logits). The swap terms are the blocks the ``cpu-offload`` KV connector saves to
host memory (a victim of preemption) and loads back (the victim resuming) in the step.

A profile may also say what moving KV between two engines costs (prefill/decode
disaggregation in the cluster simulation), under ``kv_transfer``: ``latency_s`` paid once
per hand-off, plus ``per_block_s`` per KV block sent (blocks of the block size the
profile's engines run with). Without them a hand-off has no latency and a block costs a
swap out and a swap in (``per_block_store_s + per_block_load_s``: device to host on the
sender, host to device on the receiver, a transfer staged through host memory); without
swap terms either, it is free. See :meth:`CostModel.kv_transfer_time`.

The optional residual table corrects decode-only steps by batch size (linear between
the sizes it lists, its end values beyond them): what a line cannot express, such as
CUDA-graph batch buckets or a CPU matmul that is slower at 3 rows than at 4. Profiles
written before a coefficient existed load with it at 0.
"""

from __future__ import annotations

import bisect
import difflib
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from schedkit.core.outputs import SchedulerOutput
from schedkit.errors import ConfigError, ForeignProfileWarning
from schedkit.kv.connectors.offload import OffloadMetadata
from schedkit.runners.machine import describe_machine, same_machine, this_machine

PROFILE_DIR = Path(__file__).with_name("profiles")
FEATURES = ("base_s", "per_token_s", "per_request_s", "per_context_token_s", "per_prefill_attention_s",
            "per_prefill_step_s", "per_mixed_step_s", "per_sampled_row_s", "per_random_row_s",
            "per_filtered_row_s", "per_grammar_row_s", "per_block_store_s", "per_block_load_s",
            "per_shared_context_token_s", "per_idle_context_token_s", "per_draft_token_s")
"""Coefficient names: the constant, then one per field of :class:`StepFeatures`, in order."""
REQUIRED_FEATURES = FEATURES[:5]
"""Coefficients every profile has; the others count 0 where a profile leaves them out."""
STEP_KINDS = ("prefill", "decode", "mixed")


class StepFeatures(NamedTuple):
    """The cost model's inputs for one step (see the module docstring)."""

    tokens: float
    requests: float
    context_tokens: float
    prefill_attention: float
    is_prefill_step: float
    """1.0 when some request computes a chunk of more than one token."""
    is_mixed_step: float = 0.0
    """1.0 when such chunks and one-token decodes share the step."""
    sampled_rows: float = 0.0
    random_rows: float = 0.0
    filtered_rows: float = 0.0
    grammar_rows: float = 0.0
    blocks_stored: float = 0.0
    blocks_loaded: float = 0.0
    shared_context_tokens: float = 0.0
    """Context positions read from full KV blocks another request of the step read first
    (left out of ``context_tokens``)."""
    idle_context_tokens: float = 0.0
    """A decode step's attention imbalance over the runner's attention workers: ``workers
    * makespan - sum(keys)``, the makespan of the requests' key reads placed longest
    first on the least-loaded worker (0 without workers, and in steps with a prefill
    chunk, whose tiles fill the idle workers)."""
    draft_tokens: float = 0.0
    """Draft tokens the step verifies (placeholders of a padded admission left out):
    what their proposer did to propose them is charged here (``per_draft_token_s``),
    their verification in the tokens and sampled rows like any other. A request
    verifying drafts counts as a decode, not a prompt chunk."""

    @property
    def kind(self) -> str:
        """"decode" (one-token requests only), "mixed" or "prefill"."""
        if not self.is_prefill_step:
            return "decode"
        return "mixed" if self.is_mixed_step else "prefill"


@dataclass(slots=True, frozen=True)
class CostModel:
    base_s: float
    per_token_s: float
    per_request_s: float
    per_context_token_s: float
    per_prefill_attention_s: float
    per_prefill_step_s: float = 0.0
    per_mixed_step_s: float = 0.0
    per_sampled_row_s: float = 0.0
    per_random_row_s: float = 0.0
    per_filtered_row_s: float = 0.0
    per_grammar_row_s: float = 0.0
    per_block_store_s: float = 0.0
    per_block_load_s: float = 0.0
    per_shared_context_token_s: float = 0.0
    per_idle_context_token_s: float = 0.0
    per_draft_token_s: float = 0.0
    decode_batch_residual_s: tuple[tuple[int, float], ...] = ()
    """(batch size, seconds) pairs, sorted by batch size."""
    name: str = "custom"
    fitted_async_scheduling: bool | None = None
    """``scheduler.async_scheduling`` of the steps the profile was fitted to (None: not
    recorded). Under async scheduling a step's time is the interval between consecutive
    steps' outputs, host work hidden behind the device's excluded."""
    kv_transfer_latency_s: float | None = None
    """The profile's ``kv_transfer.latency_s``: fixed seconds per KV hand-off between
    engines (None: 0)."""
    per_block_transfer_s: float | None = None
    """The profile's ``kv_transfer.per_block_s``: seconds per KV block sent to another
    engine (None: ``per_block_store_s + per_block_load_s``)."""
    attention_workers: int = 0
    """The profile's ``attention_workers``: the threads the fitted runner's attention
    kernel spread a step's sequences over (the CPU runner's ``num_threads``; 0: not
    modelled, as on a GPU). The simulator reads each decode step's imbalance over that
    many workers (:attr:`StepFeatures.idle_context_tokens`)."""
    prefill_scale: float = 1.0
    """A factor on the predicted time of every step with a prompt chunk, over the
    decode-only steps' (:meth:`scaled` with ``prefill_factor``: a machine that slows the
    two kinds of step by different amounts)."""
    probe_ratio: float = 1.0
    """The profile's ``speed_probe.ratio``: the speed probe's measured over predicted
    step time during the fit (run before each of its passes), the model's own bias on
    the probe's few steps. A later probe reads the machine's speed against it (1: not
    recorded)."""
    probe_ratio_decode: float | None = None
    """The profile's ``speed_probe.decode``: :attr:`probe_ratio` of the probe's
    decode-only steps alone (None: not recorded)."""
    probe_ratio_prefill: float | None = None
    """The profile's ``speed_probe.prefill``: :attr:`probe_ratio` of the probe's steps
    with a prompt chunk alone (None: not recorded)."""

    @classmethod
    def load(cls, name_or_path: str) -> CostModel:
        """A profile by name (from the bundled profiles) or by path to a JSON file.

        Warns (:class:`ForeignProfileWarning`) when the profile records the machine it
        was fitted on and that is not this one; it loads all the same.

        Raises:
            ConfigError: No such profile, or the file is not one.
        """
        path = profile_path(name_or_path)
        if not path.is_file():
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise ConfigError(f"runner.profile = {name_or_path!r}: no such profile file or "
                              f"bundled profile (bundled: {known})")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not a cost-model profile: not readable JSON ({e})") from e
        try:
            model = cls.from_profile(data, default_name=path.stem)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            why = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ConfigError(f"{path}: not a cost-model profile: {why}") from e
        _warn_if_foreign(model.name, data.get("hardware"))
        return model

    @classmethod
    def from_profile(cls, data: dict[str, Any], default_name: str = "custom") -> CostModel:
        """The model of a profile's JSON object.

        Raises:
            ValueError: It is not one; the message names the key (a missing or unknown
                coefficient, one that is not a number of seconds in [0, 1000], a residual
                that is not finite, a model that charges nothing for a step...).
        """
        if not isinstance(data, dict):
            raise ValueError(f"the top level must be a JSON object, got {type(data).__name__}")
        coef = data.get("coefficients")
        if not isinstance(coef, dict):
            raise ValueError(f"coefficients must be a JSON object, got {type(coef).__name__}")
        missing = [k for k in REQUIRED_FEATURES if k not in coef]
        if missing:
            raise ValueError(f"coefficients lacks {', '.join(missing)} (a profile needs coefficients "
                             f"{', '.join(REQUIRED_FEATURES)}; docs/lab.md#calibration)")
        unknown = sorted(set(coef) - set(FEATURES))
        if unknown:
            near = difflib.get_close_matches(unknown[0], FEATURES, n=1)
            raise ValueError(f"coefficients has unknown key {unknown[0]!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(FEATURES)})"))
        values = {k: _coefficient(f"coefficients.{k}", coef[k]) for k in FEATURES if k in coef}
        if not values["base_s"] + values["per_token_s"] + values["per_request_s"] > 0:
            raise ValueError("base_s, per_token_s and per_request_s are all 0: a step would take no time")
        residual = data.get("decode_batch_residual_s") or {}
        if not isinstance(residual, dict):
            raise ValueError(f"decode_batch_residual_s must map batch sizes to seconds, got {type(residual).__name__}")
        table = tuple(sorted(_residual(b, t) for b, t in residual.items()))
        fitted_on = data.get("fitted_on") or {}
        if not isinstance(fitted_on, dict):
            raise ValueError(f"fitted_on must be a JSON object, got {type(fitted_on).__name__}")
        is_async = fitted_on.get("async_scheduling")
        transfer = data.get("kv_transfer") or {}
        unknown = sorted(set(transfer) - {"latency_s", "per_block_s"})
        if unknown:
            raise ValueError(f"kv_transfer has unknown keys {unknown} (it takes latency_s, per_block_s)")
        latency, per_block = transfer.get("latency_s"), transfer.get("per_block_s")
        workers = data.get("attention_workers") or 0
        if isinstance(workers, bool) or not isinstance(workers, int) or not 0 <= workers <= MAX_ATTENTION_WORKERS:
            raise ValueError(f"attention_workers must be an integer in [0, {MAX_ATTENTION_WORKERS}], got {workers!r}")
        probe_data = data.get("speed_probe") or {}
        if not isinstance(probe_data, dict):
            raise ValueError(f"speed_probe must be a JSON object, got {type(probe_data).__name__}")
        probe = _ratio("speed_probe.ratio", probe_data.get("ratio", 1.0))
        probe_decode, probe_prefill = (None if probe_data.get(k) is None else _ratio(f"speed_probe.{k}", probe_data[k])
                                       for k in ("decode", "prefill"))
        prefill_scale = _ratio("prefill_scale", data.get("prefill_scale", 1.0))
        # Fitted before shared reads were told apart: they cost what any read costs.
        values.setdefault("per_shared_context_token_s", values["per_context_token_s"])
        return cls(**values,
                   decode_batch_residual_s=table, name=str(data.get("name", default_name)),
                   attention_workers=workers, probe_ratio=probe, probe_ratio_decode=probe_decode,
                   probe_ratio_prefill=probe_prefill, prefill_scale=prefill_scale,
                   fitted_async_scheduling=None if is_async is None else bool(is_async),
                   kv_transfer_latency_s=None if latency is None else _seconds("kv_transfer.latency_s", latency),
                   per_block_transfer_s=None if per_block is None else _seconds("kv_transfer.per_block_s",
                                                                                per_block))

    @classmethod
    def from_coefficients(cls, coefficients: dict[str, float],
                          decode_batch_residual_s: dict[int, float] | None = None,
                          attention_workers: int = 0) -> CostModel:
        values: dict[str, Any] = {k: float(coefficients.get(k, 0.0)) for k in FEATURES}
        return cls(**values, decode_batch_residual_s=tuple(sorted((decode_batch_residual_s or {}).items())),
                   attention_workers=attention_workers)

    @property
    def coefficients(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in FEATURES}

    def scaled(self, factor: float, prefill_factor: float | None = None) -> CostModel:
        """The same model with every duration multiplied by ``factor`` (a machine that runs
        ``factor`` times slower than the one the profile was fitted on); with
        ``prefill_factor``, the steps with a prompt chunk by that instead (a neighbour that
        slows memory-bound decodes and compute-bound prefills by different amounts)."""
        values: dict[str, Any] = {k: v * factor for k, v in self.coefficients.items()}
        values["decode_batch_residual_s"] = tuple((b, t * factor) for b, t in self.decode_batch_residual_s)
        for key in ("kv_transfer_latency_s", "per_block_transfer_s"):
            if getattr(self, key) is not None:
                values[key] = getattr(self, key) * factor
        name = f"{self.name} x{factor:.3f}"
        if prefill_factor is not None:
            values["prefill_scale"] = self.prefill_scale * prefill_factor / factor
            name += f" (prefill x{prefill_factor:.3f})"
        return replace(self, **values, name=name)

    def step_time(self, f: StepFeatures) -> float:
        t = (self.base_s + self.per_token_s * f[0] + self.per_request_s * f[1]
             + self.per_context_token_s * f[2] + self.per_prefill_attention_s * f[3]
             + self.per_prefill_step_s * f[4])
        if len(f) > 5:
            t += (self.per_mixed_step_s * f[5] + self.per_sampled_row_s * f[6]
                  + self.per_random_row_s * f[7] + self.per_filtered_row_s * f[8]
                  + self.per_grammar_row_s * f[9] + self.per_block_store_s * f[10]
                  + self.per_block_load_s * f[11])
            if len(f) > 12:
                t += self.per_shared_context_token_s * f[12]
                if len(f) > 13:
                    t += self.per_idle_context_token_s * f[13]
                    if len(f) > 14:
                        t += self.per_draft_token_s * f[14]
        if self.decode_batch_residual_s and not f[4]:
            t += self.decode_residual(f[1])
        elif f[4] and self.prefill_scale != 1.0:  # the compute, not the KV swap
            swap = self.transfer_time(f) if len(f) > 11 else 0.0
            t = (t - swap) * self.prefill_scale + swap
        return max(t, 0.0)

    def transfer_time(self, f: StepFeatures) -> float:
        """The swap terms alone: what a step that computes nothing but moves KV blocks costs."""
        return self.per_block_store_s * f.blocks_stored + self.per_block_load_s * f.blocks_loaded

    def kv_transfer_time(self, num_blocks: int) -> float:
        """Seconds to hand a request's KV to another engine, ``num_blocks`` blocks of it
        sent: ``latency + num_blocks * per_block`` (module docstring for the defaults of a
        profile without ``kv_transfer``). The latency is paid even with no block to send:
        the hand-off itself is a message."""
        latency = self.kv_transfer_latency_s or 0.0
        per_block = self.per_block_transfer_s
        if per_block is None:
            per_block = self.per_block_store_s + self.per_block_load_s
        return latency + per_block * num_blocks

    def decode_residual(self, batch_size: float) -> float:
        """The residual table at ``batch_size`` (interpolated; 0 without a table)."""
        table = self.decode_batch_residual_s
        if not table:
            return 0.0
        i = bisect.bisect_left(table, (batch_size, float("-inf")))
        if i == 0:
            return table[0][1]
        if i == len(table):
            return table[-1][1]
        (b0, t0), (b1, t1) = table[i - 1], table[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)


def profile_path(name_or_path: str) -> Path:
    """The file of a profile given by path, else by bundled name (it may not exist)."""
    path = Path(name_or_path)
    return path if path.is_file() else PROFILE_DIR / f"{name_or_path}.json"


def _seconds(key: str, value: Any) -> float:
    """A profile's duration: a finite number >= 0 (ValueError naming ``key`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{key} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


MAX_COEFFICIENT_S = 1000.0
"""A coefficient above this many seconds (per step, token, request...) is no measurement."""
MAX_ATTENTION_WORKERS = 4096


def _coefficient(key: str, value: Any) -> float:
    """A profile's coefficient: a number of seconds in [0, MAX_COEFFICIENT_S]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_COEFFICIENT_S:
        raise ValueError(f"{key} must be a number of seconds in [0, {MAX_COEFFICIENT_S:g}], got {value!r}")
    return float(value)


def _residual(batch: Any, seconds: Any) -> tuple[int, float]:
    """A residual table entry: a batch size >= 1 (a JSON key) and finite seconds."""
    try:
        size = int(batch)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ValueError(f"decode_batch_residual_s key {batch!r} is not a batch size >= 1")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not -MAX_COEFFICIENT_S <= seconds <= MAX_COEFFICIENT_S:
        raise ValueError(f"decode_batch_residual_s[{batch!r}] must be a finite number of seconds, got {seconds!r}")
    return size, float(seconds)


def _ratio(key: str, value: Any) -> float:
    """A profile's ratio: a finite number > 0 (ValueError naming ``key`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{key} must be a number > 0, got {value!r}")
    return float(value)


def _warn_if_foreign(name: str, fitted: Any) -> None:
    if not isinstance(fitted, dict):
        return  # hand-set, or written before profiles recorded their machine
    here = this_machine(probe_gpu=bool(fitted.get("gpu")))
    if not same_machine(fitted, here):
        warnings.warn(f"cost-model profile {name!r} was fitted on another machine "
                      f"({describe_machine(fitted)}); this one is {describe_machine(here)}: "
                      "its step times may not hold here", ForeignProfileWarning, stacklevel=3)


def step_features(scheduler_output: SchedulerOutput, computed_before: dict[str, int]) -> StepFeatures:
    """The features of one step, each request's computed tokens before it given; without
    the requests' sampling settings (which :class:`StepShapes` tracks) a request samples
    when it computes one token, greedily."""
    return _scan(scheduler_output, computed_before, {})


@dataclass(slots=True)
class _Sampling:
    sample_from: int
    """A chunk that reaches this many computed tokens samples (prompt; resumed: all tokens)."""
    is_random: bool
    """It samples with a temperature (not greedily)."""
    is_filtered: bool
    """It has top-k or top-p (the batch is sorted when any row samples randomly)."""


def _scan(so: SchedulerOutput, before: dict[str, int], reqs: dict[str, _Sampling],
          workers: int = 0) -> StepFeatures:
    spec = so.scheduled_spec_decode_tokens
    tokens = context = attn = 0.0
    num_prefill = num_decode = rows = num_drafts = 0
    any_random = any_filtered = False
    for rid, n in so.num_scheduled_tokens.items():
        c = before[rid]
        tokens += n
        context += c + n
        drafts = len(spec[rid]) if spec and rid in spec else 0
        if drafts and spec[rid][0] != -1:
            num_drafts += drafts
        if n - drafts > 1:  # a prompt chunk; a decode verifying drafts stays a decode
            attn += n * (c + n / 2)
            num_prefill += 1
        else:
            num_decode += 1
        state = reqs.get(rid)
        if state is None:  # settings unknown: a one-token step samples
            if n - drafts == 1:
                rows += 1 + drafts
        elif c + n - drafts >= state.sample_from:
            rows += 1 + drafts
            any_random = any_random or state.is_random
            any_filtered = any_filtered or state.is_filtered
    grammar = sum(1 + len(spec.get(rid, ())) for rid in so.structured_output_request_ids)
    idle = 0.0
    if workers > 1 and not num_prefill and num_decode:
        idle = attention_idle([before[rid] + n for rid, n in so.num_scheduled_tokens.items()], workers)
    meta = so.kv_connector_metadata
    stored = loaded = 0
    if isinstance(meta, OffloadMetadata):
        stored, loaded = len(meta.saves), len(meta.loads)
    return StepFeatures(tokens, float(num_prefill + num_decode), context, attn, float(num_prefill > 0),
                        float(num_prefill > 0 and num_decode > 0), float(rows),
                        float(rows if any_random else 0), float(rows if any_random and any_filtered else 0),
                        float(grammar), float(stored), float(loaded), 0.0, idle, float(num_drafts))


def attention_idle(keys: list[int], workers: int) -> float:
    """``workers * makespan - sum(keys)``: the key reads the attention kernel's idle workers
    could have done while the busiest finished, each sequence one work item (a decode
    step's), placed longest first on the least-loaded worker, as the CPU kernel's dynamic
    schedule over items sorted by length does."""
    if len(keys) == 1:
        return float(keys[0] * (workers - 1))
    loads = [0] * workers
    for k in sorted(keys, reverse=True):
        i = loads.index(min(loads))
        loads[i] += k
    return float(workers * max(loads) - sum(keys))


@dataclass(slots=True)
class StepShapes:
    """Follows the requests a runner sees (their prompt lengths and sampling settings)
    so that each step's :class:`StepFeatures` can be read from its scheduler output.
    The simulator and the calibration's recorder use the same one, so the features fitted
    are the features charged."""

    block_size: int = 16
    """The engine's KV block size (the unit in which prefixes are shared)."""
    workers: int = 0
    """The attention kernel's workers (:attr:`CostModel.attention_workers`; 0: the
    imbalance feature is not read)."""
    _reqs: dict[str, _Sampling] = field(default_factory=dict)
    _blocks: dict[str, list[int]] = field(default_factory=dict)
    """Each request's KV block ids, in order."""
    _hits: dict[str, int] = field(default_factory=dict)
    """Requests that started from computed tokens (a prefix-cache hit, a resumption): the
    number of leading blocks they found computed. Only through such hits do two requests
    hold the same block."""
    _last: tuple[frozenset[str], int] = (frozenset(), 0)
    """The scheduled requests of the last step that had hits, and their shared reads."""

    def features(self, so: SchedulerOutput) -> StepFeatures:
        """The step's features; call once per step, in order (it updates the tracking)."""
        reqs = self._reqs
        for rid in so.finished_req_ids:
            reqs.pop(rid, None)
            self._blocks.pop(rid, None)
            self._hits.pop(rid, None)
        before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            p = new.sampling_params
            reqs[new.req_id] = _Sampling(len(new.prompt_token_ids), p.temperature > 0,
                                         p.top_k > 0 or p.top_p < 1)
            before[new.req_id] = new.num_computed_tokens
            self._blocks[new.req_id] = list(new.block_ids)
            if new.num_computed_tokens:
                self._hits[new.req_id] = new.num_computed_tokens // self.block_size
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if rid in cached.resumed_req_ids:
                    self._blocks[rid] = list(ids or ())
                    self._hits[rid] = before[rid] // self.block_size
                elif ids:
                    self._blocks.setdefault(rid, []).extend(ids)
        for rid, tokens in cached.resumed_token_ids.items():
            state = reqs.get(rid)
            if state is not None:
                state.sample_from = len(tokens)
        f = _scan(so, before, reqs, self.workers)
        shared = self._shared_reads(so) if self._hits else 0
        return f._replace(context_tokens=f.context_tokens - shared, shared_context_tokens=float(shared)) \
            if shared else f

    def _shared_reads(self, so: SchedulerOutput) -> int:
        """Context positions of the step read from a full block that another request of
        the step reads too (each such block counts for all its readers but one).

        Two requests hold one block only because one of them found it cached, so the
        shared blocks are the leading blocks some scheduled request hit, and each other
        reader holds them as the leading run of its own blocks (past its own hit). While
        the same requests are scheduled the answer holds (their blocks only grow by new,
        unshared ones at the end), so it is kept from one step to the next."""
        scheduled = so.num_scheduled_tokens
        hits = self._hits
        if not any(rid in hits for rid in scheduled):
            return 0
        key = frozenset(scheduled)
        if key == self._last[0]:
            return self._last[1]
        blocks = self._blocks
        readers: dict[int, int] = {}
        for rid in scheduled:
            n = hits.get(rid, 0)
            for b in blocks.get(rid, ())[:n]:
                readers[b] = readers.get(b, 0) + 1
        again = sum(readers.values()) - len(readers)
        for rid in scheduled:
            own = blocks.get(rid, ())
            for i in range(hits.get(rid, 0), len(own)):
                if own[i] not in readers:
                    break
                again += 1
        shared = again * self.block_size
        self._last = (key, shared)
        return shared
