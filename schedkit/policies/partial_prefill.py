"""A cap on the requests computing their prompt at once, with a smaller cap for long
prompts, so that long prefills cannot hold up short requests (vLLM V0's partial
prefills)."""

from __future__ import annotations

from schedkit.core.hooks import AdmissionDecision
from schedkit.core.request import Request, RequestStatus
from schedkit.hookspecs import hookimpl
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.policies.common import check_int

__all__ = ["PartialPrefillCap"]

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_SKIP = AdmissionDecision.SKIP


class PartialPrefillCap:
    """Admit a waiting request only while fewer than ``max_partial_prefills`` requests
    are computing their prompt, and a long one only while fewer than
    ``max_long_partial_prefills`` long ones are.

    A request computes its prompt (is a *partial prefill*) from its admission until
    every token it had when admitted is computed: its prompt, and after a preemption its
    outputs so far, which it recomputes. That covers the running requests with prompt
    tokens left, whose chunks the step has already scheduled, and the requests admitted
    earlier in the same step, even those whose whole prompt fits in the step. A prefill
    is *long* while the tokens it has left exceed ``long_threshold``; for a waiting
    request that is its tokens less those already computed (loaded by a KV connector)
    and less its prefix-cache hit, so a long prompt that is mostly cached counts as
    short.

    A waiting request that would go over a cap is skipped this step
    (``AdmissionDecision.SKIP``): the scheduler examines the requests behind it and puts
    the skipped ones back at their place at the end of the step. So while long prompts
    fill their cap, the short requests behind them are admitted, and the long prompts
    keep their places for the next step. A request within both caps is left to the
    other plugins (the answer is None), so it composes with any ordering policy and with
    admission control (``edf``): its check runs first (``tryfirst``) so that no other
    plugin's ``ADMIT`` can pass the cap.

    The cap bounds how many requests share the prefill work, not how many tokens each
    gets in a step: ``scheduler.long_prefill_token_threshold`` caps a request's chunk
    (each long prefill then takes at most that much of the step's token budget and the
    rest goes to the short ones), and the two together are vLLM V0's
    ``max_num_partial_prefills``, ``max_long_partial_prefills`` and
    ``long_prefill_token_threshold``.

    Defining property: at every step at most ``max_partial_prefills`` requests compute
    prompt tokens, at most ``max_long_partial_prefills`` of them long ones; a short
    request is never held up because long prompts are waiting ahead of it while the long
    cap is full.

    Cost: while a cap is full, every waiting request the step examines is skipped, and
    the step examines the whole waiting queue (one admission call per request) unless
    the token budget or the seats run out first.

    Hooks: ``schedkit_admit_request`` (``tryfirst``: SKIP over a cap, None otherwise),
    ``schedkit_create_waiting_queue`` (``tryfirst``, always answering None: it keeps the
    KV cache manager, for the prefix-cache hits, and forgets the last scheduler's
    requests), ``schedkit_on_request_finished`` (forgets the request). One plugin object
    serves one scheduler.

    Args:
        max_partial_prefills: Most requests computing their prompt at once (>= 1,
            default 4).
        max_long_partial_prefills: Most of them with a long prompt (>= 1, at most
            ``max_partial_prefills``, default 1).
        long_threshold: Prompt tokens left above which a prefill is long (>= 1,
            default 1024).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, max_partial_prefills: int = 4, max_long_partial_prefills: int = 1,
                 long_threshold: int = 1024) -> None:
        self.max_partial_prefills = check_int("max_partial_prefills", max_partial_prefills, minimum=1)
        self.max_long_partial_prefills = check_int("max_long_partial_prefills", max_long_partial_prefills,
                                                   minimum=1)
        if self.max_long_partial_prefills > self.max_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be <= max_partial_prefills "
                             f"({self.max_partial_prefills}), got {self.max_long_partial_prefills}")
        self.long_threshold = check_int("long_threshold", long_threshold, minimum=1)
        self._kv: KVCacheManager | None = None
        self._prefills: dict[str, tuple[Request, int]] = {}
        """Requests let through, by id, with the tokens their prefill reaches."""
        self.num_skipped = 0
        """Admissions skipped because a cap was full (one per request and step)."""

    @hookimpl(tryfirst=True)
    def schedkit_create_waiting_queue(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv = kv_cache_manager
        self._prefills = {}

    def tokens_left(self, request: Request) -> int:
        """Tokens of a waiting request's prefill not yet computed nor in the prefix cache."""
        left = request.num_tokens - request.num_computed_tokens
        if left > self.long_threshold and self._kv is not None and request.num_computed_tokens == 0:
            left -= self._kv.get_computed_blocks(request)[1]
        return left

    def count(self) -> tuple[int, int]:
        """``(partial prefills, long ones)`` now: the requests let through that run with
        prompt tokens left. Forgets those that finished their prefill, that finished, or
        that were not admitted after all; keeps preempted ones (a step undone may run
        them again; a readmission replaces them)."""
        num, num_long, done = 0, 0, []
        threshold = self.long_threshold
        for rid, (req, target) in self._prefills.items():
            status = req.status
            if status is _RUNNING and req.num_computed_tokens < target:
                num += 1
                num_long += target - req.num_computed_tokens > threshold
            elif status is not _PREEMPTED:
                done.append(rid)
        for rid in done:
            del self._prefills[rid]
        return num, num_long

    @hookimpl(tryfirst=True)
    def schedkit_admit_request(self, request: Request) -> AdmissionDecision | None:
        num, num_long = self.count()
        if num >= self.max_partial_prefills or (
                num_long >= self.max_long_partial_prefills and self.tokens_left(request) > self.long_threshold):
            self.num_skipped += 1
            return _SKIP
        self._prefills[request.request_id] = (request, request.num_tokens)
        return None

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        entry = self._prefills.get(request.request_id)
        if entry is not None and entry[0] is request:
            del self._prefills[request.request_id]
