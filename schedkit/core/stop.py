"""The stop check, run after every appended output token."""

from __future__ import annotations

from schedkit.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last token ends it; return whether it stopped.

    Order: EOS, stop token ids, then length (``max_model_len`` or ``max_tokens``). So if
    the max_tokens-th token is EOS the reason is "stop", not "length". ``min_tokens`` does
    not hold back these stops: the sampler masks EOS and stop ids until it is reached.
    """
    last = request.all_token_ids[-1]
    if last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or len(request.output_token_ids) >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
