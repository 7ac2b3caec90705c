"""A disaggregated request on real replicas: its prefill on one engine, its KV carried to
another, its decode there (docs/cluster.md#disaggregation).

The front end (:class:`~schedkit.cluster.front.ClusterClient`) sends the prefill replica
a copy of the request that asks for one token and keeps its prompt's KV (``kv_send``).
When the copy finishes, :func:`hand_off` moves the prompt's full blocks over the two
connections the front end already has, the replicas' own ZMQ transport, local
processes and Ray actors alike (:mod:`schedkit.engine.kv_handoff` has the steps): the
decode replica first reserves room, and says which leading blocks its prefix cache
holds, which are not sent; while it has no room the prefill replica keeps its blocks
and the front end asks again (backpressure); the payload goes from one to the other;
the prefill replica frees its blocks. Then the request itself, unchanged, goes to the
decode replica, which loads the blocks at the step that admits it, computes the rest of
the prompt (at least its last token, whose logits give the first output token, sampled
there as a colocated engine would) and decodes. The prefill copy's own token is not
used.

Failures fall back to the colocated path: the prefill replica dies, fails the copy or
stalls past ``replicas.transfer_timeout_s`` on one call of the hand-off, and the decode
replica computes the prompt itself; the decode replica dies, and the request is
re-routed whole like any request without a token. Whatever was kept or reserved for
the request is released on both sides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from schedkit.engine.client import AsyncEngineClient
from schedkit.errors import EngineDeadError, SchedkitError

log = logging.getLogger("schedkit.cluster")

ROOM_POLL_S = 0.005
"""How soon the front end asks a decode replica without room again (doubling, up to
:data:`ROOM_POLL_MAX_S`)."""
ROOM_POLL_MAX_S = 0.1


@dataclass(slots=True)
class HandoffStats:
    """The front end's KV hand-offs so far (``stats()["kv_transfer"]``).

    Attributes:
        num_handoffs: Hand-offs whose KV reached the decode replica.
        num_blocks: Blocks sent.
        num_blocks_held: Leading blocks the decode replica held already (not sent).
        num_bytes: Payload bytes sent.
        seconds: Time from the prefill's end to the decode replica holding the KV,
            summed over the hand-offs (the waits for room included).
        num_room_waits: Times a decode replica had no room yet (the prefill replica
            kept its blocks meanwhile).
        fallbacks: Requests whose prompt the decode replica computed itself, by why:
            ``prefill_died``, ``prefill_failed``, ``timeout``, ``transfer_error``.
    """

    num_handoffs: int = 0
    num_blocks: int = 0
    num_blocks_held: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_room_waits: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"num_handoffs": self.num_handoffs, "num_blocks": self.num_blocks,
                "num_blocks_held": self.num_blocks_held, "num_bytes": self.num_bytes,
                "seconds": self.seconds, "num_room_waits": self.num_room_waits,
                "fallbacks": dict(self.fallbacks)}


class Cleanups:
    """Best-effort calls that must run even when the request's task is cancelled (a
    release, a cancel): each runs as a task of its own, kept until it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, call: Coroutine[Any, Any, Any], what: str) -> None:
        task = asyncio.ensure_future(call)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, what))

    def _done(self, task: asyncio.Task[Any], what: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            if not isinstance(e, EngineDeadError):  # a dead replica freed everything already
                log.warning("%s failed: %s: %s", what, type(e).__name__, e)

    async def wait(self, timeout: float) -> None:
        """Let the calls still running end, for at most ``timeout`` seconds: a release
        is best effort, and a replica that never answers must not stall a close. Those
        left are cancelled."""
        if not self._tasks:
            return
        _, left = await asyncio.wait(set(self._tasks), timeout=timeout)
        if left:
            log.warning("%d best-effort KV release(s) did not end within %.1f s; given up", len(left), timeout)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)


async def hand_off(prefill: AsyncEngineClient, decode: AsyncEngineClient, request_id: str,
                   params: dict[str, Any], num_prompt_tokens: int, timeout_s: float,
                   stats: HandoffStats, cleanups: Cleanups) -> str | None:
    """Move a finished prefill's KV (its ``kv_transfer_params``) from ``prefill`` to
    ``decode``; None once the decode replica has it, else why it does not (a
    ``fallbacks`` key, or ``decode_died``): the decode replica then computes the prompt.
    The prefill replica's blocks are released either way."""
    t0 = time.perf_counter()
    hashes = list(params.get("block_hashes", ()))
    num_blocks = len(params.get("block_ids", ()))
    reserved = done = False
    try:
        delay = ROOM_POLL_S
        while True:
            held = await asyncio.wait_for(decode.call_utility("kv_reserve", request_id, hashes, num_prompt_tokens),
                                          timeout_s)
            if held is not None:
                break
            stats.num_room_waits += 1
            if prefill.dead is not None:  # its blocks are gone with it
                return _fallback(stats, "prefill_died")
            await asyncio.sleep(delay)
            delay = min(2 * delay, ROOM_POLL_MAX_S)
        reserved = True
        first = min(held, num_blocks)
        payload = await asyncio.wait_for(prefill.call_utility("kv_export", request_id, first), timeout_s)
        await asyncio.wait_for(decode.call_utility("kv_import", request_id, first, payload), timeout_s)
        done = True
        stats.num_handoffs += 1
        stats.num_blocks += num_blocks - first
        stats.num_blocks_held += first
        stats.num_bytes += len(payload.get("data", b""))
        stats.seconds += time.perf_counter() - t0
        return None
    except TimeoutError:
        log.warning("request %r: a KV hand-off call took over %.1f s; its decode replica computes the "
                    "prompt instead", request_id, timeout_s)
        return _fallback(stats, "timeout")
    except EngineDeadError:
        if decode.dead is not None:
            return "decode_died"
        return _fallback(stats, "prefill_died")
    except SchedkitError as e:  # an engine refused a call: a mismatch between replicas
        log.warning("request %r: the KV hand-off failed (%s); its decode replica computes the prompt",
                    request_id, e)
        return _fallback(stats, "transfer_error")
    finally:
        if prefill.dead is None:
            cleanups.spawn(prefill.call_utility("kv_release", request_id), f"request {request_id!r}: kv_release")
        if reserved and not done and decode.dead is None:
            cleanups.spawn(decode.call_utility("kv_cancel", request_id), f"request {request_id!r}: kv_cancel")


def _fallback(stats: HandoffStats, why: str) -> str:
    stats.fallbacks[why] += 1
    return why
