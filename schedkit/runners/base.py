"""The ModelRunner protocol every runner implements."""

from __future__ import annotations

from typing import Protocol

from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput


class ModelRunner(Protocol):
    """Executes scheduled steps. Runs in the engine-core process (or its worker)."""

    def initialize(self, num_blocks: int, block_size: int) -> int:
        """Prepare the KV cache; returns the number of blocks actually available."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the sampled tokens per scheduled request."""
        ...

    def propose_draft_token_ids(self, num_spec_tokens: int) -> dict[str, list[int]]:
        """Draft tokens for the next step of each request that just sampled (may be empty)."""
        ...
