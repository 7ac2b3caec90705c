"""Speculation as a policy decision: how many draft tokens each running request gets
proposed for its next step (``schedkit_num_speculative_tokens``).

A draft token costs the target model one more position to verify, whether or not it
is accepted. While the batch is small the step is bound by reading the weights and the
extra positions are nearly free; as the batch grows the step becomes bound by compute
and every rejected draft is time taken from the other requests. And a request whose
drafts keep failing (its text is not repetitive, its proposer does not know it) pays
the verification for nothing. The two built-ins cut speculation on those two signals.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_int, check_number

__all__ = ["SpeculateByAcceptance", "SpeculateByBatch", "acceptance_estimate", "drafts_worth_proposing"]


class SpeculateByBatch:
    """Speculate (the configured ``num_speculative_tokens`` for every request) only while
    at most ``max_batch`` requests run; above that, no drafts for anyone (vLLM's
    ``disable_by_batch_size``).

    Hooks: ``schedkit_num_speculative_tokens``.

    Args:
        max_batch: Most running requests at which drafts are still proposed (>= 1,
            default 8).

    Raises:
        ValueError: ``max_batch`` is not an integer >= 1.
    """

    def __init__(self, max_batch: int = 8) -> None:
        self.max_batch = check_int("max_batch", max_batch, minimum=1)

    @hookimpl
    def schedkit_num_speculative_tokens(self, running: Sequence[Request]) -> dict[str, int] | None:
        if len(running) <= self.max_batch:
            return None
        return dict.fromkeys((r.request_id for r in running), 0)


def acceptance_estimate(request: Request, prior: float, prior_weight: float) -> float:
    """The chance that ``request``'s next draft is accepted, given the one before it was:
    its accepted drafts over its accepted drafts and its misses (verification steps in
    which a draft was rejected), which is the maximum-likelihood estimate when every
    draft is accepted with one chance until the first rejection ends the run. ``prior``
    counts as ``prior_weight`` drafts seen before the first."""
    accepted = request.num_accepted_tokens
    seen = accepted + request.num_draft_misses + prior_weight
    return (accepted + prior * prior_weight) / seen if seen > 0 else prior


def drafts_worth_proposing(acceptance: float, max_tokens: int, min_acceptance: float) -> int:
    """The longest run of drafts (at most ``max_tokens``) whose last one is accepted
    with probability at least ``min_acceptance``: the ``k``-th draft counts only if
    all before it were accepted, which happens with probability ``acceptance ** k``."""
    if acceptance >= 1.0:
        return max_tokens
    if acceptance <= 0.0 or acceptance < min_acceptance:
        return 0
    return min(max_tokens, int(math.log(min_acceptance) / math.log(acceptance) + 1e-9))


class SpeculateByAcceptance:
    """Give each request the drafts its own record says will be accepted.

    A request's acceptance is estimated from its drafts so far
    (:func:`acceptance_estimate`, starting from ``prior``) and it gets the longest run
    whose last draft is still accepted with probability ``threshold(b)``
    (:func:`drafts_worth_proposing`) in a batch of ``b`` running requests. A draft is
    worth verifying when the step it saves its request outweighs the row it adds to
    everyone's step: with ``draft_cost`` the cost of one verified row relative to a
    step's fixed cost (reading the weights), that is ``b * draft_cost / (1 + b *
    draft_cost)``, never below ``min_acceptance``: cheap in a small batch, dear in a
    large one. A request cut to 0 gets one draft every ``probe_every`` steps times its
    misses so far (at a step of its own, from its id), so that one whose text turns
    repetitive is found again while one that never does costs ever less. With
    ``max_batch``, no request gets drafts while more than ``max_batch`` run.

    Hooks: ``schedkit_num_speculative_tokens``.

    Args:
        min_acceptance: Least chance of acceptance worth a draft's verification, in
            (0, 1] (default 0.3).
        draft_cost: One verified row's cost over a decode step's fixed cost (>= 0,
            default 0: the threshold is ``min_acceptance`` at every batch size); about
            0.04 for SmolLM2-135M on two CPU threads (a row 1.3 ms, the step 31 ms).
        prior: The acceptance assumed for a request with no record yet, in [0, 1]
            (default 0.5).
        prior_weight: How many drafts the prior counts for (>= 0, default 2).
        probe_every: Steps between the single drafts of a request cut to 0 (>= 1,
            default 16).
        max_batch: Most running requests at which drafts are proposed (>= 1; default
            None: no limit).
        pooled_prior: Start a request with no record from what every request's drafts
            showed so far (their accepted drafts and misses, ``prior`` counted as
            ``prior_weight`` drafts among them) instead of from ``prior`` alone, and
            space a request's probes by everyone's misses as well as its own: a drafter
            bad for everyone (a draft model that does not fit the workload) stops being
            tried on each new request (default false).
        pool_half_life: With ``pooled_prior``, the drafts (accepted drafts and misses)
            after which what the pool showed counts half: a workload that changes (a
            drafter that stops fitting, or starts to) moves the pool within a few of
            them (> 0; default None: the pool never forgets).

    Raises:
        ValueError: A setting out of its range; the message names it.
    """

    def __init__(self, min_acceptance: float = 0.3, draft_cost: float = 0.0, prior: float = 0.5,
                 prior_weight: float = 2.0, probe_every: int = 16, max_batch: int | None = None,
                 pooled_prior: bool = False, pool_half_life: float | None = None) -> None:
        self.min_acceptance = check_number("min_acceptance", min_acceptance, minimum=0.0, strict=True)
        if self.min_acceptance > 1:
            raise ValueError(f"min_acceptance must be at most 1, got {min_acceptance!r}")
        self.draft_cost = check_number("draft_cost", draft_cost)
        self.prior = check_number("prior", prior)
        if self.prior > 1:
            raise ValueError(f"prior must be at most 1, got {prior!r}")
        self.prior_weight = check_number("prior_weight", prior_weight)
        self.probe_every = check_int("probe_every", probe_every, minimum=1)
        self.max_batch = None if max_batch is None else check_int("max_batch", max_batch, minimum=1)
        if not isinstance(pooled_prior, bool):
            raise ValueError(f"pooled_prior must be true or false, got {pooled_prior!r}")
        self.pooled_prior = pooled_prior
        self.pool_half_life = (None if pool_half_life is None
                               else check_number("pool_half_life", pool_half_life, minimum=0.0, strict=True))
        self._seen: dict[str, tuple[Request, int, int]] = {}
        """Per unfinished request seen running, its (accepted drafts, misses) when last
        counted into the pool (kept through a preemption, so a resumed request's record
        is not counted twice)."""
        self._pool = [0.0, 0.0]
        """Accepted drafts and misses of every request so far (``pooled_prior``), each
        weighed down by the drafts seen since (``pool_half_life``)."""

    @hookimpl
    def schedkit_num_speculative_tokens(self, running: Sequence[Request], num_speculative_tokens: int,
                                        step: int) -> dict[str, int]:
        b = len(running)
        if self.max_batch is not None and b > self.max_batch:
            return dict.fromkeys((r.request_id for r in running), 0)
        cost = b * self.draft_cost
        threshold = max(self.min_acceptance, cost / (1.0 + cost))
        prior = self._pooled(running) if self.pooled_prior else self.prior
        pool_misses = round(self._pool[1]) if self.pooled_prior else 0
        plan = {}
        for r in running:
            alpha = acceptance_estimate(r, prior, self.prior_weight)
            k = drafts_worth_proposing(alpha, num_speculative_tokens, threshold)
            period = self.probe_every * max(1, r.num_draft_misses + pool_misses)
            if not k and (step + zlib.crc32(r.request_id.encode())) % period == 0:
                k = 1
            plan[r.request_id] = k
        return plan

    def _pooled(self, running: Sequence[Request]) -> float:
        """Count the running requests' new accepted drafts and misses into the pool
        and return its acceptance (``prior`` counted as ``prior_weight`` drafts)."""
        pool, seen = self._pool, self._seen
        new_accepted = new_misses = 0
        for r in running:
            accepted, misses = r.num_accepted_tokens, r.num_draft_misses
            _, was_accepted, was_missed = seen.get(r.request_id, (r, 0, 0))
            new_accepted += accepted - was_accepted
            new_misses += misses - was_missed
            seen[r.request_id] = (r, accepted, misses)
        if self.pool_half_life is not None and new_accepted + new_misses:
            keep = 0.5 ** ((new_accepted + new_misses) / self.pool_half_life)
            pool[0] *= keep
            pool[1] *= keep
        pool[0] += new_accepted
        pool[1] += new_misses
        if len(seen) > len(running):  # finished requests leave; what they showed stays in the pool
            for rid in [rid for rid, (r, _, _) in seen.items() if r.is_finished]:
                del seen[rid]
        total = pool[0] + pool[1] + self.prior_weight
        return (pool[0] + self.prior * self.prior_weight) / total if total > 0 else self.prior
