"""Shortest prompt first: admit the waiting request with the fewest prompt tokens.

An example schedkit policy plugin, installed through the ``schedkit`` entry-point group
and switched on with ``scheduler.policy: spf``. It implements one hook,
``schedkit_create_waiting_queue``; everything else (victim choice, budget, admission)
falls back to the built-in defaults and ``fcfs``.
"""

from __future__ import annotations

import math

from schedkit import KeyedQueue, Request, hookimpl

__all__ = ["ShortestPromptFirst"]
__version__ = "0.1.0"


class ShortestPromptFirst:
    """Orders the waiting queue by ``(num_prompt_tokens, arrival_time, request_id)``.

    Args:
        aging: Prompt tokens forgiven per second of waiting (>= 0, default 0). With
            ``aging=a`` a request that arrived ``t`` seconds before another one ranks as
            if its prompt were ``a * t`` tokens shorter, so long prompts are not starved
            forever. The ranking never changes while requests wait, so the queue stays a
            heap with a fixed key.

    Raises:
        ValueError: ``aging`` is not a finite number >= 0.
    """

    def __init__(self, aging: float = 0.0) -> None:
        if isinstance(aging, bool) or not isinstance(aging, (int, float)):
            raise ValueError(f"aging must be a number, got {aging!r}")
        if not math.isfinite(aging) or aging < 0:
            raise ValueError(f"aging must be a finite number >= 0, got {aging!r}")
        self.aging = float(aging)

    def sort_key(self, request: Request) -> tuple[float, float, str]:
        """The queue key: shorter prompt first, then earlier arrival, then request id."""
        rank = request.num_prompt_tokens + self.aging * request.arrival_time
        return (rank, request.arrival_time, request.request_id)

    @hookimpl
    def schedkit_create_waiting_queue(self) -> KeyedQueue:
        return KeyedQueue(self.sort_key)
