"""The ModelRunner protocol every runner implements."""

from __future__ import annotations

from collections.abc import Mapping
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

    def propose_draft_token_ids(self, num_spec_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """Draft tokens for the next step: at most ``num_spec_tokens[rid]`` for each
        request listed (the speculation policy's plan; requests left out get none). A
        request may get fewer, or none (nothing to propose)."""
        ...
