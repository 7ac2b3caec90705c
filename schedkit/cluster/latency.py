"""Predicted TTFT and TPOT of a request on a replica, from the calibrated cost model.

:class:`LatencyPredictor` replays, step by step on the replica's last load report, what
its scheduler will do, each step's duration from the simulator's
:class:`~schedkit.runners.cost_model.CostModel` (the profile the replicas were fitted
to), on a :class:`~schedkit.cluster.replica_model.ReplicaModel` of what the report
gives: the requests still in their prompt in scheduling order (the first 256 one by one,
with the tokens each has left and computed and the outputs it is to make; the rest as a
run of their mean size), and the running requests past their prompt (the output tokens
each may still make, and the KV positions they read). Each step, as the scheduler goes:

* every decoding request takes one token of ``max_num_batched_tokens``, and leaves when
  it has made its last (``max_tokens``, or its ``expected_output_tokens`` hint within it);
* the queued prompts holding one of ``max_num_seqs`` sequence slots take what is left,
  in order, at most ``long_prefill_token_threshold`` tokens each (when set, and not
  alone in the scheduler); requests finishing their prompt decode from the next step;
* the request being routed, queued behind all of those (FCFS), takes what is left after
  them once it holds a slot; its first token comes at the end of the step that
  computes its prompt's last token. Stretches of decode-only steps (the queue waiting
  for slots) are summed at once.

The steps that began before the decision (the one in progress when the report was
sent, and any since) run without the request; the requests routed to the replica since
its report (``unreported``) join the queue at the first step that began after each was
routed. The prediction's TTFT is the time from the decision to that step's end; its
TPOT is the duration of the next step, with the request decoding in it.

Every row is taken to sample with a temperature (the API's default), none with top-k
or top-p. Not modelled: requests that arrive after this one (they take what its steps
leave of the budget, and lengthen those steps: the largest error under load, for
prompts longer than ``long_prefill_token_threshold``), waiting for KV blocks
(preemption), prefix-cache hits of requests still waiting (their prompts count whole),
answers that stop before ``max_tokens``, and engine policies other than FCFS.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from schedkit.cluster.replica_model import Member, ReplicaModel, Run
from schedkit.config import Config, SchedulerConfig, SimulatedRunnerConfig
from schedkit.core.routing import LatencyEstimate, ReplicaState, RouteRequest, RouteStage
from schedkit.runners.cost_model import CostModel

__all__ = ["LatencyPredictor", "Prefill", "RouterLatency", "prefill_work"]

MAX_STEPS = 10_000
"""The most stretches of steps a prediction replays (then it answers what it has)."""
RECENT_ROUTES = 256
"""Routed requests remembered per replica (those its next report will count first)."""


class Prefill(NamedTuple):
    """The work a request brings to a replica's queue."""

    tokens: int
    """Prompt tokens to compute."""
    cached: int
    """Prompt tokens found in the prefix cache."""
    num_outputs: int
    """The most output tokens it may make (0: not known)."""
    routed_at: float = 0.0
    """When it was routed there (the router's clock)."""


def prefill_work(num_tokens: int, num_cached: int, num_outputs: int = 0, routed_at: float = 0.0) -> Prefill:
    """The prefill a prompt of ``num_tokens`` needs with ``num_cached`` of them in the
    prefix cache (at least one token computed: a whole-prompt hit recomputes its last)."""
    cached = min(max(num_cached, 0), num_tokens - 1)
    return Prefill(num_tokens - cached, cached, num_outputs, routed_at)


class LatencyPredictor:
    """Predict a request's TTFT and TPOT on a replica (module docstring).

    Args:
        cost_model: The replicas' cost model (the simulator's profile).
        scheduler: The replicas' scheduler settings (budget, sequences, chunk cap).
    """

    def __init__(self, cost_model: CostModel, scheduler: SchedulerConfig) -> None:
        self.cost_model = cost_model
        self.budget = scheduler.max_num_batched_tokens
        self.max_seqs = min(scheduler.max_num_seqs, self.budget - 1) if self.budget > 1 else 1
        self.threshold = scheduler.long_prefill_token_threshold
        self.adaptive = scheduler.long_prefill_token_threshold_adaptive
        m = cost_model
        self._coef = (m.base_s, m.per_token_s, m.per_request_s, m.per_context_token_s, m.per_prefill_attention_s,
                      m.per_prefill_step_s, m.per_mixed_step_s, m.per_sampled_row_s + m.per_random_row_s)

    @classmethod
    def from_config(cls, config: Config) -> LatencyPredictor | None:
        """The predictor of ``router.latency_profile`` (default: the simulated runner's
        profile); None when neither names one.

        Raises:
            ConfigError: The profile does not load.
        """
        profile = config.router.latency_profile
        if profile is None and isinstance(config.runner, SimulatedRunnerConfig):
            profile = config.runner.profile
        if profile is None:
            return None
        return cls(CostModel.load(profile), config.scheduler)

    def predict(self, replica: ReplicaState, num_prompt_tokens: int, num_cached_tokens: int, now: float,
                unreported: Sequence[Prefill] = ()) -> LatencyEstimate:
        """The TTFT and TPOT of a request of ``num_prompt_tokens`` (``num_cached_tokens``
        of them in the replica's prefix cache) sent to ``replica`` at ``now`` (the
        router's clock, as ``replica.reported_at``), behind the ``unreported`` requests
        routed there since its last report."""
        model = self._model(replica)
        t = now if replica.reported_at is None else min(replica.reported_at, now)
        pending = deque(sorted(unreported, key=lambda w: w.routed_at))
        t = self._run_until(model, t, now, pending)
        while pending:
            _enqueue(model, pending.popleft())
        own = prefill_work(num_prompt_tokens, num_cached_tokens)
        left, done = own.tokens, own.cached
        holds_slot = False
        for _ in range(MAX_STEPS):
            model.admit(self.max_seqs)
            holds_slot = holds_slot or (not model.num_waiting
                                        and len(model.ends) + len(model.active) < self.max_seqs)
            if not holds_slot and model.active_tokens <= 0:  # nothing starts before a request ends
                t += self._decode_only(model, MAX_STEPS)
                continue
            dt, n = self._step(model, left if holds_slot else 0, done, waiting=not holds_slot)
            t += dt
            left -= n
            done += n
            if left <= 0:
                break
        model.endless += 1  # decoding: its length does not matter for the next step
        model.context += num_prompt_tokens
        model.admit(self.max_seqs)
        tpot, _ = self._step(model)
        return LatencyEstimate(t - now, tpot)

    def _model(self, replica: ReplicaState) -> ReplicaModel:
        """The replica as its last report shows it."""
        lefts = replica.decode_tokens_left
        running_prefills = max(replica.num_prefill_requests - replica.num_waiting, 0)
        decoding = max(replica.num_running - running_prefills, 0)
        model = ReplicaModel(float(replica.num_context_tokens), ends=sorted(lefts),
                             endless=float(max(decoding - len(lefts), 0)))
        listed = replica.prefill_queue
        tokens, attention, outputs, known = 0.0, 0.0, 0.0, 0
        for i, (left, done, num_outputs) in enumerate(listed):
            tokens += left
            attention += left * (done + left / 2)
            if num_outputs:
                outputs += num_outputs
                known += 1
            if i < running_prefills:
                model.activate(Member(left, done, num_outputs))
            else:
                model.enqueue(Run(1, left, done, num_outputs))
        rest = replica.num_prefill_requests - len(listed)
        rest_tokens = replica.num_prefill_tokens - tokens
        if rest > 0 and rest_tokens > 0:  # past the list: requests of their mean size
            size = rest_tokens / rest
            per_token = max(replica.prefill_attention - attention, 0.0) / rest_tokens
            model.enqueue(Run(rest, size, max(per_token - size / 2, 0.0), outputs / known if known else 0.0))
        return model

    def _run_until(self, model: ReplicaModel, t: float, now: float, pending: deque[Prefill]) -> float:
        """Step ``model`` from ``t`` through every step that begins before ``now``, each
        ``pending`` request joining the queue at the first step that begins once it was
        routed; returns when the replica can next take a request in (``now`` if it is
        idle by then)."""
        for _ in range(MAX_STEPS):
            if t >= now:
                break
            while pending and pending[0].routed_at <= t:
                _enqueue(model, pending.popleft())
            if not (model.num_queued or model.decoding > 0):  # idle until the next one came
                if not pending or pending[0].routed_at >= now:
                    break
                t = pending[0].routed_at
                continue
            model.admit(self.max_seqs)
            if model.active_tokens > 0:
                t += self._step(model)[0]
                continue
            until = min(now, pending[0].routed_at) if pending else now
            first = self._decode_cost(min(model.decoding, self.max_seqs), model.context)
            t += self._decode_only(model, max(math.ceil((until - t) / first), 1) if first > 0 else 1)
        return max(t, now)

    def _cost(self, tokens: float, requests: float, context: float, attention: float, is_prefill: bool,
              is_mixed: bool, rows: float) -> float:
        """``cost_model.step_time`` of the step with these features (every row sampled
        with a temperature; no top-k or top-p, grammar or KV swap), inlined: it is
        evaluated for every step replayed."""
        base, per_token, per_request, per_context, per_attention, prefill, mixed, per_row = self._coef
        t = base + per_token * tokens + per_request * requests + per_context * context + per_row * rows
        if is_prefill:
            t += per_attention * attention + prefill + (mixed if is_mixed else 0.0)
            t *= self.cost_model.prefill_scale
        elif self.cost_model.decode_batch_residual_s:
            t += self.cost_model.decode_residual(requests)
        return t if t > 0.0 else 0.0

    def _decode_cost(self, d: float, context: float) -> float:
        return self._cost(d, d, context + d, 0.0, False, False, d)

    def _decode_only(self, model: ReplicaModel, max_steps: int) -> float:
        """Up to ``max_steps`` decode-only steps at once, to the next request's end at
        most (their durations are linear in the context, so the mean of the first and
        the last is theirs); returns their duration."""
        d = min(model.decoding, self.max_seqs)
        k = max_steps if not model.ends else max(min(max_steps, model.ends[0] - model.step_no), 1)
        if d <= 0:
            model.decoded(k, 0.0)
            return 0.0
        total = k * (self._decode_cost(d, model.context) + self._decode_cost(d, model.context + (k - 1) * d)) / 2
        model.decoded(k, d)
        return total

    def _chunk(self, num_requests: float) -> float:
        """The most prompt tokens one request computes in a step (the scheduler's
        long-prefill cap: none for a request alone)."""
        if not self.threshold or num_requests <= 1:
            return self.budget
        if self.adaptive:
            return max(self.threshold, self.budget // num_requests)
        return self.threshold

    def _step(self, model: ReplicaModel, own_left: int = 0, own_done: int = 0,
              waiting: bool = False) -> tuple[float, int]:
        """One step: the decoding requests, the queued prompts holding a slot, then the
        request's own prompt (``own_left`` tokens left, ``own_done`` computed;
        ``waiting``: it waits for a slot). Updates ``model``; returns the step's
        duration and the request's tokens computed in it."""
        d = min(model.decoding, self.max_seqs)
        budget = self.budget - d
        chunk = self._chunk(model.decoding + model.num_queued + (1 if own_left > 0 or waiting else 0))
        x = attention = context = 0.0
        touched = 0
        finished: list[Member] = []
        if budget >= 1 and model.active:
            x, touched, attention, context, finished = model.take(budget, chunk)
        y = int(min(own_left, budget - x, chunk)) if own_left > 0 else 0
        if y:
            attention += y * (own_done + y / 2)
            context += own_done + y
        rows = d + len(finished) + (1 if y and y == own_left else 0)
        is_prefill = x + y > 0
        dt = self._cost(d + x + y, d + touched + (1 if y else 0), model.context + d + context, attention,
                        is_prefill, is_prefill and d > 0, rows)
        model.decoded(1, d)
        for m in finished:
            model.join(m)
        return dt, y


def _enqueue(model: ReplicaModel, work: Prefill) -> None:
    model.enqueue(Run(1, work.tokens, work.cached, work.num_outputs))


class RouterLatency:
    """The router hooks' ``latency`` argument (:class:`~schedkit.core.routing.RouteLatency`):
    the predictor at one decision's time, each replica's answer computed once, and the
    requests routed to each replica that its last report does not count yet.

    Args:
        predictor: The cost-model predictor.
        num_replicas: Replicas behind the router.
    """

    def __init__(self, predictor: LatencyPredictor, num_replicas: int) -> None:
        self.predictor = predictor
        self.now = 0.0
        self._request: RouteRequest | None = None
        self._known: dict[int, LatencyEstimate] = {}
        self._recent: list[deque[Prefill]] = [deque(maxlen=RECENT_ROUTES) for _ in range(num_replicas)]
        """Per replica: the prefill work of the last requests routed there, newest last."""

    def begin(self, request: RouteRequest, now: float) -> None:
        """A new decision: ``request`` at ``now`` (earlier answers are forgotten)."""
        self.now = now
        self._request = request
        self._known.clear()

    def estimate(self, request: RouteRequest, replica: ReplicaState) -> LatencyEstimate:
        if request is not self._request:  # asked about another request: a fresh answer
            self.begin(request, self.now)
        known = self._known.get(replica.index)
        if known is None:
            known = self.predictor.predict(replica, request.num_prompt_tokens, _num_cached(request, replica),
                                           self.now, self.unreported(replica))
            self._known[replica.index] = known
        return known

    def routed(self, request: RouteRequest, replica: ReplicaState, stage: RouteStage) -> None:
        """``request`` went to ``replica`` (at a decode stage it brings no prefill: its
        KV comes from its prefill replica)."""
        outputs = _num_outputs(request)
        work = (Prefill(0, 0, outputs, self.now) if stage is RouteStage.DECODE
                else prefill_work(request.num_prompt_tokens, _num_cached(request, replica), outputs, self.now))
        self._recent[replica.index].append(work)

    def unreported(self, replica: ReplicaState) -> list[Prefill]:
        """The prefill work of the requests routed to ``replica`` that its last report
        does not count yet: its outstanding requests beyond those it reported, taken as
        the last ones routed there."""
        k = replica.num_outstanding - replica.num_waiting - replica.num_running
        return list(itertools.islice(reversed(self._recent[replica.index]), k)) if k > 0 else []


def _num_outputs(request: RouteRequest) -> int:
    """The output tokens ``request`` is expected to make: its ``expected_output_tokens``
    hint within its ``max_tokens`` (0: neither is known)."""
    expected, most = request.hints.expected_output_tokens, request.max_tokens
    if expected is not None:
        return max(min(expected, most) if most is not None else expected, 1)
    return most or 0


def _num_cached(request: RouteRequest, replica: ReplicaState) -> int:
    """Prompt tokens of ``request`` the router sees in ``replica``'s prefix cache."""
    hashes = request.block_hashes
    return replica.cached_blocks.num_matched_blocks(hashes) * request.block_size if hashes else 0
