"""Asynchronous KV loads: the requests whose KV a connector is loading, or has loaded.

A connector may answer a lookup with tokens it will load asynchronously. The request
then gets blocks for those tokens, takes no budget and no running slot, and waits here
(status ``WAITING_FOR_REMOTE_KVS``) until the worker reports the load finished
(``finished_recving``) or failed (``failed_recving``, or ``invalid_block_ids`` for part
of it). :class:`KVLoads` owns that lifecycle: the queue of requests holding blocks, the
loads reported done or failed, and aborted requests whose blocks a load still writes.
It changes requests and block tables; finishing a request (freeing it, telling the
connector and the observers, producing its output) stays with the scheduler, which acts
on what these methods return.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedkit.core.queues import FCFSQueue
from schedkit.core.request import Request, RequestStatus
from schedkit.kv.kv_cache_manager import KVCacheManager

_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS
_RUNNING = RequestStatus.RUNNING


class KVLoads:
    """Args:
        kv: The scheduler's KV cache manager.
        requests: The scheduler's request table (read only).
        recompute_failed: ``cache.kv_load_failure_policy == "recompute"``: a failed load
            starts over instead of failing its request.

    Attributes:
        holding: Waiting requests that hold KV blocks (a load in progress or done), in
            the order their loads started; the scheduler serves them before ``waiting``.
        finished: Loading requests whose load the worker reported complete.
        failed: Loading requests whose load failed: they start over at promotion.
        held: Finished (aborted) requests whose blocks a load in progress writes into.
    """

    def __init__(self, kv: KVCacheManager, requests: dict[str, Request], *, recompute_failed: bool) -> None:
        self.kv = kv
        self.requests = requests
        self.recompute_failed = recompute_failed
        self.holding = FCFSQueue()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.held: set[str] = set()

    def __len__(self) -> int:
        return len(self.holding)

    # -- the scheduling side ----------------------------------------------------------------
    def is_done(self, req: Request) -> bool:
        return req.request_id in self.finished

    def promote(self, req: Request) -> tuple[bool, bool]:
        """A load finished: cache the blocks loaded before the first failure, if any (a
        load that left nothing valid drops its blocks and the request starts over), and
        make the request admissible. The last prompt token is always recomputed, for its
        logits. Returns whether it was in (finished, failed), for an undo."""
        rid = req.request_id
        was = (rid in self.finished, rid in self.failed)
        self.finished.discard(rid)
        self.failed.discard(rid)  # failures already truncated its count
        if req.num_computed_tokens == 0:
            self.kv.free(req)
        else:
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return was

    def restore(self, rid: str, was_finished: bool, was_failed: bool) -> None:
        """Undo :meth:`promote`'s bookkeeping (the request and the KV cache are restored
        by the step's undo)."""
        if was_finished:
            self.finished.add(rid)
        if was_failed:
            self.failed.add(rid)

    def blocks_reserved(self, running: Sequence[Request], max_model_len: int, num_spec_tokens: int,
                        num_lookahead_tokens: int = 0) -> int:
        """Free blocks a new load must leave for the loads and prefills already under way
        to reach their full sequence (plus one speculative step and its lookahead slots)."""
        bs = self.kv.block_size
        extra = 1 + num_spec_tokens + num_lookahead_tokens if num_spec_tokens else 0
        reserved = -(-extra // bs)
        in_flight = [r for r in self.holding if r.status is _LOADING]
        in_flight += [r for r in running if r.is_prefill_chunk]
        for req in in_flight:
            full = min(req.num_tokens, max_model_len) + extra
            reserved += max(-(-full // bs) - self.kv.get_num_blocks(req.request_id), 0)
        return reserved

    # -- ending a load ----------------------------------------------------------------------
    def end(self, req: Request) -> bool:
        """``req`` is finishing while it loads: forget its load. Returns True when its
        blocks must be kept (not freed) because the worker may still write into them;
        they are released when the load's end is reported."""
        rid = req.request_id
        hold = rid not in self.finished
        if hold:
            self.held.add(rid)
        self.finished.discard(rid)
        self.failed.discard(rid)
        return hold

    def on_finished(self, request_ids: Iterable[str]) -> list[Request]:
        """Loads the worker finished: loading requests become admissible. Returns the
        aborted requests that kept their blocks for the load: free them now."""
        release = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is _LOADING:
                self.finished.add(rid)
            elif rid in self.held:
                self.held.discard(rid)
                release.append(req)
        return release

    def on_failed(self, request_ids: Iterable[str]) -> tuple[list[Request], list[Request]]:
        """Whole loads failed: with ``recompute_failed`` the requests start over (their
        blocks are dropped at promotion); otherwise they leave ``holding``.

        Returns:
            (requests to fail, aborted requests whose held blocks can be freed now).
        """
        fail, release = [], []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is not _LOADING:
                if rid in self.held:  # aborted while loading
                    self.held.discard(rid)
                    release.append(req)
                continue
            if self.recompute_failed:
                self.finished.add(rid)  # the worker is done with its blocks
                self.failed.add(rid)
                req.num_computed_tokens = 0
                continue
            self.holding.remove_request(req)
            self.finished.discard(rid)
            fail.append(req)
        return fail, release

    def on_invalid_blocks(self, invalid: set[int], running: Sequence[Request]) -> list[Request]:
        """Find the requests that read blocks whose load failed: loading requests first,
        then running ones in order. Each is truncated to its first bad block not already
        claimed by an earlier request (which recomputes it), or keeps its count before
        the steps in flight if all were claimed; running ones drop the outputs of those
        steps (computed on bad KV). Returns them; with ``recompute_failed`` loading ones
        are marked failed (retried at promotion)."""
        bs = self.kv.block_size
        claimed: set[int] = set()
        affected = []
        loading = [r for r in self.holding if r.status is _LOADING]
        for req in loading + list(running):
            rid = req.request_id
            table = self.kv.get_block_ids(rid)
            before = req.num_computed_tokens - req.num_in_flight_tokens  # before every step in flight
            bad = [i for i in range(min(-(-before // bs), len(table))) if table[i] in invalid]
            if not bad:
                continue
            first = next((i for i in bad if table[i] not in claimed), None)
            claimed.update(table[i] for i in bad)
            req.num_computed_tokens = before if first is None else first * bs
            req.spec_token_ids = []
            if req.status is _RUNNING:  # its outputs in flight were computed on bad KV
                req.num_stale_output_tokens = req.num_in_flight_tokens
                req.stale_drop = True
                req.num_output_placeholders = 0
            affected.append(req)
            if req.status is _LOADING and self.recompute_failed:
                self.failed.add(rid)
        return affected

    def drop_bad(self, reqs: Sequence[Request], invalid: set[int]) -> list[bool]:
        """Policy "fail" for ``reqs`` (from :meth:`on_invalid_blocks`): drop the bad blocks
        of running requests, and what follows them, from the prefix cache; take loading
        ones out of ``holding``. Returns, per request, whether its blocks must be held
        (see :meth:`end`) when the scheduler finishes it."""
        holds = []
        for req in reqs:
            if req.status is _RUNNING:
                table = self.kv.get_block_ids(req.request_id)
                first = next(i for i, b in enumerate(table) if b in invalid)
                self.kv.evict_blocks(table[first:])
                self.finished.discard(req.request_id)
                self.failed.discard(req.request_id)
                holds.append(False)
            else:
                self.holding.remove_request(req)
                holds.append(self.end(req))
        return holds
