"""Preemption-victim policies."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl

__all__ = ["LeastComputedFirst"]


class LeastComputedFirst:
    """Preempt the running request with the fewest computed tokens.

    schedkit preempts by recomputation: the victim's KV blocks are freed and its
    ``num_computed_tokens`` tokens are computed again when it resumes. Choosing the
    request with the fewest computed tokens therefore wastes the least work; ties go to
    the latest admitted request, as in FCFS. The requester itself may be chosen (it is
    in ``running``), which ends the scheduling of running requests for the step.

    Defining property: each preemption discards the least computed work available, so
    the total of recomputed tokens is lower than FCFS's "latest admitted" choice on
    workloads where a late-admitted request has already computed much (a long prompt)
    while an earlier one has computed little.

    Hooks: ``schedkit_select_preemption_victim`` only; composes with any ordering policy.
    Takes no settings.
    """

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request]) -> Request:
        victim = running[-1]
        fewest = victim.num_computed_tokens
        for req in reversed(running):  # latest admitted first, so ties go to it
            if req.num_computed_tokens < fewest:
                victim, fewest = req, req.num_computed_tokens
        return victim
