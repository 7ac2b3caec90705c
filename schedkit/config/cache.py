"""The ``cache`` section: the paged KV cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schedkit.config.base import StrictModel

MAX_NUM_BLOCKS = 1 << 24
"""16.7M blocks: 268M tokens of 16-token blocks, over 20x what fits in an H200 for a
0.5B model; the pool's bookkeeping is a Python object per block, so more would only
exhaust the host's memory."""


class CacheConfig(StrictModel):
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block."""
    num_blocks: int = Field(default=2048, ge=2, le=MAX_NUM_BLOCKS)
    """Blocks in the pool, including the reserved null block 0."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches (prefix caching)."""
    hash_algo: Literal["xxhash", "sha256"] = "xxhash"
    """Block-hash algorithm for prefix caching."""
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of blocks kept free when admitting waiting requests while others run."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    """When a KV connector reports a failed asynchronous load: start the request over
    (recompute) or finish it with an error (fail)."""
    enable_kv_events: bool = False
    """Publish KV cache events (blocks stored, removed, cache cleared). The router turns
    it on in every replica: its prefix-affinity view of each engine is built from them."""
