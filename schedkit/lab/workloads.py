"""Seeded synthetic workloads (the policy lab grows this module)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from schedkit.config import WorkloadConfig


@dataclass(slots=True, frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int


def generate(cfg: WorkloadConfig, vocab_size: int = 32000) -> list[WorkloadRequest]:
    """Requests with Poisson (or evenly spaced, ``fixed``) arrivals and uniform lengths.

    Token ids avoid 0..2 (often special tokens). The same config always gives the same
    requests.
    """
    rng = random.Random(cfg.seed)
    t = 0.0
    reqs = []
    for i in range(cfg.num_requests):
        t += rng.expovariate(cfg.rate) if cfg.kind == "poisson" else 1.0 / cfg.rate
        prompt_len = rng.randint(*cfg.prompt_len)
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        reqs.append(WorkloadRequest(f"req-{i}", t, prompt, rng.randint(*cfg.output_len)))
    return reqs
