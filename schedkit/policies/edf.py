"""Earliest deadline first on TTFT deadlines, with admission control for hopeless requests."""

from __future__ import annotations

from collections.abc import Mapping

from schedkit.core.hooks import AdmissionDecision, Rejection
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import Request, RequestStatus
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_number, check_positive_map, readmission_rank

__all__ = ["EarliestDeadlineFirst"]

ON_MISS = ("reject", "skip", "admit")
_WAITING = RequestStatus.WAITING


class EarliestDeadlineFirst:
    """Serve the waiting request whose TTFT deadline comes first; refuse hopeless ones.

    A request's deadline is ``arrival_time + slo``, where ``slo`` is the request's own
    ``ttft_slo_s`` when its client set one (the HTTP server's ``ttft_slo_s`` field),
    else ``slo_by_priority[request.priority]`` when that priority is listed, else
    ``ttft_slo_s``. ``arrival_time`` must be on the scheduler's clock (it is for
    requests the engine holds until their arrival, and in the simulator).

    A request that has never run is *hopeless* when
    ``now + prefill_s_per_token * num_prompt_tokens > deadline``: it can no longer get
    its first token in time. At the head of the queue it is then, by ``on_miss``:

    * ``reject``: finished at once (finish reason "abort", stop_reason "rejected"), with
      a ``Rejection`` whose reason gives the SLO, the wait and the estimate;
    * ``skip``: skipped this step and moved behind every request that can still meet
      its deadline (a second tier, itself in deadline order); it is admitted when it
      reaches the head of that tier, i.e. when no on-time request waits, so it is
      delayed, never dropped;
    * ``admit``: admitted anyway (pure EDF ordering, no admission control).

    Preempted requests are never refused: they already ran, and their deadline, which a
    preemption does not change, puts them ahead of every later arrival of their SLO
    class (and, once passed, ahead of every request with a later deadline); among equal
    deadlines a preempted request goes first
    (:func:`~schedkit.policies.common.readmission_rank`).

    Defining property: requests are admitted in deadline order (arrival order when all
    share one SLO, so EDF differs from FCFS only with per-priority SLOs or rejections);
    with ``reject`` every admitted request was admitted no later than its deadline (less
    the estimate), and capacity is not spent on requests that would miss anyway, which
    raises SLO attainment under overload.

    Hooks: ``schedkit_create_waiting_queue`` (a heap on ``(tier, deadline, readmission
    rank, arrival, id)``), ``schedkit_admit_request`` (the check above; None, i.e. no
    objection, otherwise), ``schedkit_on_request_finished`` (forgets skipped requests).

    Args:
        ttft_slo_s: Default TTFT SLO in seconds (> 0, default 1.0).
        slo_by_priority: ``priority -> SLO seconds`` overrides (each > 0; default none).
        on_miss: ``reject`` (default), ``skip`` or ``admit``.
        prefill_s_per_token: Estimated prefill seconds per prompt token, subtracted from
            the slack (>= 0, default 0: refuse only once the deadline has passed).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, ttft_slo_s: float = 1.0, slo_by_priority: Mapping[int, float] | None = None,
                 on_miss: str = "reject", prefill_s_per_token: float = 0.0) -> None:
        self.ttft_slo_s = check_number("ttft_slo_s", ttft_slo_s, strict=True)
        self.slo_by_priority = check_positive_map("slo_by_priority", slo_by_priority, int)
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {'|'.join(ON_MISS)}, got {on_miss!r}")
        self.on_miss = on_miss
        self.prefill_s_per_token = check_number("prefill_s_per_token", prefill_s_per_token)
        self._late: set[str] = set()

    def slo(self, request: Request) -> float:
        """The request's TTFT SLO: its own ``ttft_slo_s`` when the client set one, else
        the priority's, else the default."""
        slo = request.ttft_slo_s
        return self.slo_by_priority.get(request.priority, self.ttft_slo_s) if slo is None else slo

    def deadline(self, request: Request) -> float:
        """``arrival_time`` plus the request's TTFT SLO (``slo``)."""
        return request.arrival_time + self.slo(request)

    def is_hopeless(self, request: Request, now: float) -> bool:
        """True if even an immediate admission would miss the deadline (by the estimate)."""
        est = self.prefill_s_per_token * request.num_prompt_tokens
        return now + est > self.deadline(request)

    def sort_key(self, request: Request) -> tuple[int, float, int, float, str]:
        late = request.status is _WAITING and request.request_id in self._late
        return (int(late), self.deadline(request), readmission_rank(request), request.arrival_time,
                request.request_id)

    @hookimpl
    def schedkit_create_waiting_queue(self) -> KeyedQueue:
        self._late = set()
        return KeyedQueue(self.sort_key)

    @hookimpl
    def schedkit_admit_request(self, request: Request, now: float) -> AdmissionDecision | Rejection | None:
        if self.on_miss == "admit" or request.status is not _WAITING:
            return None
        rid = request.request_id
        if rid in self._late:
            return None  # head of the late tier: no on-time request is waiting
        if not self.is_hopeless(request, now):
            return None
        if self.on_miss == "reject":
            est = self.prefill_s_per_token * request.num_prompt_tokens
            return Rejection(f"its TTFT deadline cannot be met: SLO {self.slo(request):g} s, waited "
                             f"{max(now - request.arrival_time, 0.0):.3f} s, estimated prefill "
                             f"{est:.3f} s for {request.num_prompt_tokens} prompt tokens")
        # Skipped requests are popped and re-inserted after this step, by the new key.
        self._late.add(rid)
        return AdmissionDecision.SKIP

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        self._late.discard(request.request_id)
