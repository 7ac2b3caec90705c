"""Fair share across tenants with a virtual token counter (Sheng et al., OSDI'24)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping

from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput
from schedkit.core.queues import BaseRequestQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_number, check_positive_map

__all__ = ["VirtualTokenCounter", "VTCQueue"]


class VTCQueue(BaseRequestQueue):
    """Per-tenant FIFOs; the head of the backlogged tenant with the smallest counter
    goes first (ties: the earlier enqueued head).

    Counters hold *served* service, charged at step end. A popped request's prompt
    tokens not yet charged count as in-flight debt (``input_weight`` each) until they
    are: selection compares ``counter + debt``, which is the paper's counter (it charges
    the whole prompt at admission), so one step cannot hand every admission to the same
    tenant. Debt is dropped when the request comes back (preempted, skipped) or ends.
    """

    def __init__(self, input_weight: float, output_weight: float,
                 tenant_weights: Mapping[str, float]) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tenant_weights = dict(tenant_weights)
        self.counters: dict[str, float] = {}
        """Virtual counters: weighted service per tenant plus the lifts it was given."""
        self.served: dict[str, float] = {}
        """Weighted service per tenant (divided by the tenant's weight), without lifts."""
        self._queues: dict[str, deque[Request]] = {}  # backlogged tenants only
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._reqs: dict[str, Request] = {}
        self._charged_prompt: dict[str, int] = {}
        self._debt: dict[str, int] = {}
        self._tenant_debt: dict[str, float] = {}
        self._last_left: str | None = None
        self._finished: list[Request] = []
        self._len = 0

    # -- accounting ----------------------------------------------------------------------
    def _w(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def effective(self, tenant: str) -> float:
        """The tenant's counter plus the weighted prompt debt of its admitted requests."""
        return (self.counters.get(tenant, 0.0)
                + self.input_weight * self._tenant_debt.get(tenant, 0.0) / self._w(tenant))

    def _set_debt(self, req: Request, tokens: int) -> None:
        rid, t = req.request_id, req.tenant
        old = self._debt.pop(rid, 0)
        if tokens > 0:
            self._debt[rid] = tokens
        self._tenant_debt[t] = self._tenant_debt.get(t, 0.0) + tokens - old

    def _lift(self, tenant: str) -> None:
        """A tenant that becomes backlogged starts no lower than the least backlogged
        tenant (or, with none, the tenant that left the queue last): idle time earns no
        credit."""
        if self._queues:
            floor = min(self.effective(t) for t in self._queues)
        elif self._last_left is not None and self._last_left != tenant:
            floor = self.effective(self._last_left)
        else:
            floor = self.counters.get(tenant, 0.0)
        debt = self.input_weight * self._tenant_debt.get(tenant, 0.0) / self._w(tenant)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor - debt)

    def charge(self, scheduler_output: SchedulerOutput,
               outputs: Mapping[int, EngineCoreOutputs]) -> None:
        """Charge one step: prompt tokens computed (each at most once per request, so
        recomputation after a preemption is free) and output tokens generated."""
        reqs, charged = self._reqs, self._charged_prompt
        num_scheduled = scheduler_output.num_scheduled_tokens
        starts = [(n.req_id, n.num_computed_tokens) for n in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        starts += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        w_in = self.input_weight
        for rid, start in starts:
            req = reqs.get(rid)
            if req is None:
                continue
            end = min(start + num_scheduled.get(rid, 0), req.num_prompt_tokens)
            done = charged.get(rid, 0)
            if end > done:
                charged[rid] = end
                self._add(req.tenant, w_in * (end - max(start, done)))
                if rid in self._debt:
                    self._set_debt(req, req.num_prompt_tokens - end)
        w_out = self.output_weight
        for group in outputs.values():
            for out in group.outputs:
                req = reqs.get(out.request_id)
                if req is not None and out.new_token_ids:
                    self._add(req.tenant, w_out * len(out.new_token_ids))
        self._purge()

    def _add(self, tenant: str, cost: float) -> None:
        cost /= self._w(tenant)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        self.served[tenant] = self.served.get(tenant, 0.0) + cost

    def finished(self, req: Request) -> None:
        self._finished.append(req)
        self._set_debt(req, 0)

    def _purge(self) -> None:
        for req in self._finished:
            rid = req.request_id
            if self._reqs.get(rid) is req:
                del self._reqs[rid]
                self._charged_prompt.pop(rid, None)
                self._seq.pop(rid, None)
        self._finished.clear()

    # -- queue ---------------------------------------------------------------------------
    def _select(self) -> str:
        seq = self._seq
        return min(self._queues, key=lambda t: (self.effective(t), seq[self._queues[t][0].request_id]))

    def add(self, request: Request) -> None:
        rid, tenant = request.request_id, request.tenant
        self._reqs[rid] = request
        self._seq[rid] = self._next_seq
        self._next_seq += 1
        if tenant not in self._queues:
            self._lift(tenant)
            self._queues[tenant] = deque()
        self._queues[tenant].append(request)
        self._len += 1

    def peek(self) -> Request:
        return self._queues[self._select()][0]

    def pop(self) -> Request:
        tenant = self._select()
        q = self._queues[tenant]
        req = q.popleft()
        if not q:
            del self._queues[tenant]
            self._last_left = tenant
        self._len -= 1
        self._set_debt(req, req.num_prompt_tokens - self._charged_prompt.get(req.request_id, 0))
        return req

    def prepend_request(self, request: Request) -> None:
        self._set_debt(request, 0)
        self._reqs.setdefault(request.request_id, request)
        self._seq.setdefault(request.request_id, -1)
        self._queues.setdefault(request.tenant, deque()).appendleft(request)
        self._len += 1

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        for tenant in [t for t, q in self._queues.items() if any(id(r) in drop for r in q)]:
            q = deque(r for r in self._queues[tenant] if id(r) not in drop)
            self._len -= len(self._queues[tenant]) - len(q)
            if q:
                self._queues[tenant] = q
            else:
                del self._queues[tenant]

    def __len__(self) -> int:
        return self._len


    def __iter__(self) -> Iterator[Request]:
        """Serving order if no step ended meanwhile: each pick adds its prompt debt."""
        heads = {t: list(q) for t, q in self._queues.items()}
        pos = dict.fromkeys(heads, 0)
        eff = {t: self.effective(t) for t in heads}
        seq = self._seq
        order = []
        while heads:
            t = min(heads, key=lambda u: (eff[u], seq.get(heads[u][pos[u]].request_id, -1)))
            req = heads[t][pos[t]]
            order.append(req)
            eff[t] += self.input_weight * max(
                0, req.num_prompt_tokens - self._charged_prompt.get(req.request_id, 0)) / self._w(t)
            pos[t] += 1
            if pos[t] == len(heads[t]):
                del heads[t]
        return iter(order)


class VirtualTokenCounter:
    """Fair share of service across tenants (``request.tenant``) with virtual token
    counters: VTC from Sheng et al., "Fairness in Serving Large Language Models", OSDI'24.

    Each tenant has a counter of the service it received,
    ``input_weight * prompt tokens computed + output_weight * output tokens generated``,
    divided by its weight (``tenant_weights``, default 1). Counters are charged in
    ``schedkit_on_step_end`` from the step's plan (prompt tokens scheduled, read against
    each request's computed-token count) and its outputs (tokens generated). Recomputing a
    prompt after a preemption is not charged again, nor are prefix-cache hits. The queue
    admits the oldest request of the backlogged tenant (one with waiting requests) whose
    counter is smallest. A preempted request goes back to the head of its tenant's FIFO,
    so it is readmitted before every later request of its tenant (its prompt is not
    charged again). When a tenant becomes backlogged again its counter is lifted to
    the minimum over backlogged tenants (or, when none is, to the counter of the tenant
    that left the queue last), as in the paper, so being idle earns no credit.

    Defining property: while two tenants are both backlogged, the difference of their
    (weighted) service stays bounded by a constant of the order of the largest request's
    cost times the batch size, whatever their send rates; under FCFS a tenant sending
    more gets proportionally more and the difference grows without bound.

    Hooks: ``schedkit_create_waiting_queue`` (a :class:`VTCQueue`),
    ``schedkit_on_step_end`` (charging), ``schedkit_on_request_finished`` (cleanup, done
    at the next step end because the step's last tokens are charged after it). One
    plugin object serves one scheduler.

    Args:
        input_weight: Cost of one prompt token (>= 0, default 1.0, the paper's w_p).
        output_weight: Cost of one output token (>= 0, default 2.0, the paper's w_q).
        tenant_weights: ``tenant -> share weight`` (> 0; unlisted tenants weigh 1).

    Raises:
        ValueError: A setting is out of range (or both weights are 0); the message names
            it and its value.
    """

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        self.input_weight = check_number("input_weight", input_weight)
        self.output_weight = check_number("output_weight", output_weight)
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("input_weight and output_weight must not both be 0, got 0 and 0")
        self.tenant_weights = check_positive_map("tenant_weights", tenant_weights, str)
        self.queue: VTCQueue | None = None

    @property
    def counters(self) -> dict[str, float]:
        """Virtual counters per tenant (empty before the scheduler is built)."""
        return self.queue.counters if self.queue is not None else {}

    @property
    def served(self) -> dict[str, float]:
        """Weighted service per tenant, without lifts (empty before the scheduler is built)."""
        return self.queue.served if self.queue is not None else {}

    @hookimpl
    def schedkit_create_waiting_queue(self) -> VTCQueue:
        self.queue = VTCQueue(self.input_weight, self.output_weight, self.tenant_weights)
        return self.queue

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: SchedulerOutput,
                             outputs: dict[int, EngineCoreOutputs]) -> None:
        if self.queue is not None:
            self.queue.charge(scheduler_output, outputs)

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        if self.queue is not None:
            self.queue.finished(request)
