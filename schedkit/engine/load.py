"""An engine's load as the router sees it: what a load report carries.

The engine process sends these figures to the cluster front end in its
:class:`~schedkit.engine.messages.LoadReport`; the cluster simulation reads them after
each replica's step. Both hand them to :meth:`schedkit.cluster.router.Router.update_load`,
and the router's latency predictor (:mod:`schedkit.cluster.latency`) works from them.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from schedkit.core.request import Request
from schedkit.core.scheduler import Scheduler

__all__ = ["MAX_LISTED_PREFILLS", "LoadFigures", "load_figures"]

MAX_LISTED_PREFILLS = 256
"""The most requests still in their prompt a load report lists one by one."""


class LoadFigures(NamedTuple):
    """One engine's load (the router's :class:`~schedkit.core.routing.ReplicaState`
    fields of the same names)."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_prefill_tokens: int = 0
    """Prompt tokens its waiting and running requests have still to compute (a resumed
    request's outputs too: it recomputes them)."""
    num_prefill_requests: int = 0
    """Requests with such tokens."""
    prefill_attention: float = 0.0
    """Their prefill attention work left: the sum of ``left * (computed + left / 2)``."""
    num_context_tokens: int = 0
    """KV positions its running requests past their prompt hold (their computed tokens)."""
    decode_tokens_left: tuple[int, ...] = ()
    """For each of those requests, the most output tokens it may still make, ascending."""
    prefill_queue: tuple[tuple[int, int, int], ...] = ()
    """The first :data:`MAX_LISTED_PREFILLS` requests still in their prompt, in the order
    the scheduler takes them (running first, then waiting): (prompt tokens left, tokens
    computed, output tokens to make)."""


def load_figures(scheduler: Scheduler, *, detail: bool = True) -> LoadFigures:
    """The scheduler's load now; without ``detail`` only the queue lengths and KV usage
    (the rest 0: cheaper, for a router that predicts no latency)."""
    running, waiting = scheduler.running, scheduler.waiting
    usage = scheduler.kv_cache_manager.usage
    if not detail:
        return LoadFigures(len(waiting), len(running), usage)
    tokens = num_prefill = context = 0
    attention = 0.0
    lefts: list[int] = []
    queue: list[tuple[int, int, int]] = []
    prefilling: list[Request] = []
    for req in running:
        if req.num_tokens - req.num_computed_tokens > 1 or not req.output_token_ids:
            prefilling.append(req)
        else:  # past its prompt
            context += req.num_computed_tokens
            lefts.append(_outputs_left(req))
    for req in itertools.chain(prefilling, waiting):  # still in their prompt (or recomputing)
        computed = req.num_computed_tokens
        left = req.num_tokens - computed
        tokens += left
        num_prefill += 1
        attention += left * (computed + left / 2)
        if len(queue) < MAX_LISTED_PREFILLS:
            queue.append((left, computed, _outputs_left(req)))
    lefts.sort()
    return LoadFigures(len(waiting), len(running), usage, tokens, num_prefill, attention, context,
                       tuple(lefts), tuple(queue))


def _outputs_left(req: Request) -> int:
    """The most output tokens ``req`` may still make: ``max_tokens``, or its
    ``expected_output_tokens`` hint within it, less those it made (at least 1)."""
    most = req.max_tokens
    expected = req.hints.expected_output_tokens
    if expected is not None and expected < most:
        most = expected
    return max(most - len(req.output_token_ids), 1)
