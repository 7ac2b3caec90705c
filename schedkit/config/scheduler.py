"""The ``scheduler`` section: the step budget, the limits and the policy."""

from __future__ import annotations

from pydantic import Field, model_validator

from schedkit.config.base import StrictModel


class SchedulerConfig(StrictModel):
    policy: str = "fcfs"
    """fcfs, priority, or the entry-point name of an installed policy plugin."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Token budget of one step."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most requests running at once."""
    max_model_len: int = Field(default=2048, ge=2)
    """Longest sequence (prompt + output) a request may reach."""
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    """Per-request cap on prefill tokens per step when other requests exist (0 = off)."""
    long_prefill_token_threshold_adaptive: bool = False
    """Raise that cap to an equal share of the budget (max_num_batched_tokens divided by
    the running and waiting requests) when the share is larger."""
    max_num_active_seqs: int | None = Field(default=None, ge=1)
    """Admit waiting requests only while fewer than this many run (<= max_num_seqs;
    None: max_num_seqs). Running requests are never preempted for it."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit the budget whole."""
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    """Draft tokens per request per step (n-gram style, no lookahead slots)."""
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if blocks for its whole current sequence are free."""
    async_scheduling: bool = False
    """Schedule step t+1 while step t runs (vLLM's AsyncScheduler): decode requests are
    scheduled again before their sampled token is known, with output placeholders. With
    num_speculative_tokens the runner proposes the drafts inside each step (draft
    models and EAGLE heads; n-gram and suffix decoding need it off)."""
    max_voluntary_preemptions: int = Field(default=4, ge=0)
    """Most running requests a policy may preempt voluntarily at the start of one step
    (``schedkit_select_voluntary_preemptions``; 0: the hook is never called)."""

    @model_validator(mode="after")
    def _check_limits(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs ({self.max_num_active_seqs}) must be <= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"<= max_model_len ({self.max_model_len})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        if self.num_speculative_tokens and self.max_num_batched_tokens <= self.num_speculative_tokens:
            raise ValueError("max_num_batched_tokens must exceed num_speculative_tokens")
        return self
