"""Built-in defaults for the decisions every policy shares (vLLM V1's behaviour).

Registered ``trylast`` so that any other plugin's answer wins.
"""

from __future__ import annotations

from schedkit.core.hooks import AdmissionDecision
from schedkit.hookspecs import hookimpl


@hookimpl(trylast=True)
def schedkit_step_token_budget(max_num_batched_tokens: int) -> int:
    return max_num_batched_tokens


@hookimpl(trylast=True)
def schedkit_prefill_chunk_limit(threshold: int) -> int | None:
    return threshold if threshold > 0 else None


@hookimpl(trylast=True)
def schedkit_admit_request() -> AdmissionDecision:
    return AdmissionDecision.ADMIT
