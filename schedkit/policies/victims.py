"""Preemption-victim policies."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.policies.common import check_bool

__all__ = ["LeastComputedFirst"]


class LeastComputedFirst:
    """Preempt the running request whose preemption throws away the least work.

    schedkit preempts by recomputation: the victim's KV blocks are freed and its
    computed tokens are computed again when it resumes, except those whose blocks are
    still in the prefix cache then. The work lost is its ``num_computed_tokens`` less,
    with ``count_shared_prefix``, the leading blocks it shares with other requests (a
    common system prompt): those stay allocated, and cached, whatever happens to it, so
    they survive the preemption. The request losing the least is chosen; ties go to the
    latest admitted request, as in FCFS. The requester itself may be chosen (it is in
    ``running``), which ends the scheduling of running requests for the step.

    Defining property: each preemption discards the least work available, so the total
    of recomputed tokens is lower than FCFS's "latest admitted" choice on workloads where
    a late-admitted request has already computed much (a long prompt) while an earlier
    one has computed little; with prefix caching and shared prefixes it does not take a
    request whose tokens are mostly shared for a cheap victim (its own tokens are).

    Hooks: ``schedkit_select_preemption_victim``, and ``schedkit_create_waiting_queue``
    (``tryfirst``, always answering None: it only keeps the KV cache manager, whose block
    reference counts tell what is shared); composes with any ordering policy.

    Args:
        count_shared_prefix: Count blocks shared with other requests as surviving work
            (default true; false counts every computed token).
    """

    def __init__(self, count_shared_prefix: bool = True) -> None:
        self.count_shared_prefix = check_bool("count_shared_prefix", count_shared_prefix)
        self._kv: KVCacheManager | None = None

    @hookimpl(tryfirst=True)
    def schedkit_create_waiting_queue(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv = kv_cache_manager

    def work_lost(self, request: Request) -> int:
        """Computed tokens a preemption of ``request`` would throw away."""
        kv = self._kv
        if not self.count_shared_prefix or kv is None:
            return request.num_computed_tokens
        kept = kv.get_num_shared_prefix_blocks(request.request_id) * kv.block_size
        return max(request.num_computed_tokens - kept, 0)

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request]) -> Request:
        victim = running[-1]
        fewest = self.work_lost(victim)
        for req in reversed(running):  # latest admitted first, so ties go to it
            lost = self.work_lost(req)
            if lost < fewest:
                victim, fewest = req, lost
        return victim
