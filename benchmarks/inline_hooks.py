"""FCFS with every hook inlined as a plain method: the baseline for the hook-layer cost.

Same decisions as the built-in defaults + fcfs plugins, without pluggy or the facade.
"""

from __future__ import annotations

from schedkit.core.hooks import AdmissionDecision
from schedkit.core.queues import FCFSQueue


class InlineFCFSHooks:
    def create_waiting_queue(self, *, scheduler_config, kv_cache_manager, clock):
        return FCFSQueue()

    has_voluntary_preemptions = False

    def select_voluntary_preemptions(self, *, running, waiting, max_num_running, kv_cache_usage, now,
                                     max_preemptions):
        return []

    def select_preemption_victim(self, *, running, request):
        return running[-1]

    def prefill_chunk_limit(self, *, request, num_new_tokens, threshold):
        return threshold if threshold > 0 else None

    def step_token_budget(self, *, max_num_batched_tokens, running, waiting, kv_cache_usage, step):
        return max_num_batched_tokens

    def num_speculative_tokens(self, *, running, num_speculative_tokens, step):
        return {}

    def admit_request(self, *, request, num_running, kv_cache_usage, now):
        return AdmissionDecision.ADMIT

    def create_kv_connector(self, *, role, config):
        return None

    def create_structured_output_backend(self, *, config, tokenizer, vocab_size, eos_token_ids):
        return None

    def on_step_end(self, *, scheduler_output, outputs, stats, now):
        return None

    def on_request_finished(self, *, request, now):
        return None
