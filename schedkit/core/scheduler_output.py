"""Turn one step's decisions (StepState) into the SchedulerOutput the runner reads."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from schedkit.core.request import Request
from schedkit.core.step_state import StepState
from schedkit.kv.kv_cache_manager import KVCacheManager


def build_scheduler_output(st: StepState, kv: KVCacheManager, running: Sequence[Request],
                           preempted_ids: set[str], finished_ids: set[str], step: int) -> SchedulerOutput:
    """Assemble the output with pre-advance ``num_computed_tokens`` values.

    New requests carry their whole block table; running requests only the blocks
    allocated this step (None if none); resumed requests their whole (new) table and
    their tokens, since the runner dropped them at preemption. ``num_output_tokens``
    counts the tokens of steps still in flight too (async scheduling).
    """
    new_reqs = [
        NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                       list(kv.get_block_ids(req.request_id)), req.num_computed_tokens,
                       list(req.output_token_ids), req.tenant)
        for req in st.new_reqs
    ]
    cached = CachedRequestData()
    req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
    num_computed, num_output = cached.num_computed_tokens, cached.num_output_tokens
    appended = cached.appended_token_ids
    for req, blocks in zip(st.running_reqs, st.running_new_blocks, strict=True):
        so = req.structured_output
        if so is not None and so.jump_forward:
            appended[req.request_id] = list(so.jump_forward)
        req_ids.append(req.request_id)
        new_block_ids.append(blocks or None)
        num_computed.append(req.num_computed_tokens)
        num_output.append(len(req.output_token_ids) + req.num_output_placeholders)
    for req in st.resumed_reqs:
        rid = req.request_id
        req_ids.append(rid)
        cached.resumed_req_ids.add(rid)
        new_block_ids.append(list(kv.get_block_ids(rid)))
        num_computed.append(req.num_computed_tokens)
        num_output.append(len(req.output_token_ids))
        cached.resumed_token_ids[rid] = list(req.all_token_ids)
    common = (kv.get_num_common_prefix_blocks(running[0].request_id, len(running))
              if len(running) > 1 else 0)
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=st.num_scheduled,
        total_num_scheduled_tokens=sum(st.num_scheduled.values()),
        scheduled_spec_decode_tokens=st.spec_tokens,
        num_common_prefix_blocks=[common],
        preempted_req_ids=preempted_ids,
        finished_req_ids=finished_ids,
        step=step,
    )
