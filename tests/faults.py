"""Fault injection for the failure-path property tests: a plugin that implements every
per-step hook and the waiting queue (its methods and its key function), and raises at
random calls; it also preempts running requests voluntarily now and then. It records which requests each raise concerned, so a test can check that
only those fail. The invariants are the test kit's ``assert_scheduler_consistent``.

:class:`SlowGrammars` is a structured-output backend whose grammars are slow, for some
requests, in their compile, their bitmask fill or their token accept."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from schedkit import AdmissionDecision, hookimpl
from schedkit.core.grammar import StructuredOutputGrammar
from schedkit.core.queues import FCFSQueue, KeyedQueue
from schedkit.core.request import Request
from schedkit.core.structured_output import StructuredOutputBackend

QUEUE_METHODS = ("add", "peek", "pop", "prepend_request", "prepend_requests", "remove_request",
                 "remove_requests", "__iter__", "key")
HOOKS = ("schedkit_step_token_budget", "schedkit_select_voluntary_preemptions",
         "schedkit_select_preemption_victim",
         "schedkit_prefill_chunk_limit", "schedkit_admit_request", "schedkit_on_step_end",
         "schedkit_on_request_finished", "schedkit_num_speculative_tokens")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    """Raises at a call with probability ``rate`` (0 never raises: the control run).

    A raise that concerns no request (budget, peek, pop, batch prepends ...) fails the
    step; the injector never does that twice in a row, so the engine's rule "three
    failed steps in a row fail everything" never triggers and every failure can be
    traced to the requests a raise concerned (``touched``).
    """

    def __init__(self, seed: int, rate: float, keyed: bool) -> None:
        self.rng = random.Random(seed)
        self.defer_rng = random.Random(seed + 1)
        self.preempt_rng = random.Random(seed + 2)
        self.spec_rng = random.Random(seed + 3)
        self.num_voluntary = 0
        """Running requests it preempted voluntarily."""
        self.rate = rate
        self.keyed = keyed
        self.touched: set[str] = set()
        self.raised: Counter[str] = Counter()
        self._stepwide_last = False
        self._stepwide_now = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No faults inside (while a test reads the scheduler's state)."""
        rate, self.rate = self.rate, 0.0
        try:
            yield
        finally:
            self.rate = rate

    def maybe_raise(self, where: str, request: Request | None = None) -> None:
        if not self.rate or self.rng.random() >= self.rate:
            return
        if request is None:
            if self._stepwide_last or self._stepwide_now:
                return
            self._stepwide_now = True
        else:
            self.touched.add(request.request_id)
        self.raised[where] += 1
        raise InjectedFault(f"injected fault in {where}"
                            + (f" for {request.request_id}" if request else ""))

    def _new_step(self) -> None:
        self._stepwide_last, self._stepwide_now = self._stepwide_now, False

    # -- hooks -----------------------------------------------------------------------
    @hookimpl
    def schedkit_create_waiting_queue(self):
        return FaultyQueue(self)

    @hookimpl
    def schedkit_step_token_budget(self):
        self._new_step()
        self.maybe_raise("schedkit_step_token_budget")

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running, max_preemptions):
        self.maybe_raise("schedkit_select_voluntary_preemptions")
        if self.preempt_rng.random() < 0.05:  # a voluntary preemption now and then
            self.num_voluntary += 1
            return [self.preempt_rng.choice(list(running))]
        return None

    @hookimpl
    def schedkit_select_preemption_victim(self, request):
        self.maybe_raise("schedkit_select_preemption_victim", request)

    @hookimpl
    def schedkit_prefill_chunk_limit(self, request):
        self.maybe_raise("schedkit_prefill_chunk_limit", request)

    @hookimpl
    def schedkit_admit_request(self, request):
        self.maybe_raise("schedkit_admit_request", request)
        if self.defer_rng.random() < 0.1:  # skipped requests go back with prepend_requests
            return AdmissionDecision.SKIP
        return None

    @hookimpl
    def schedkit_num_speculative_tokens(self, running, num_speculative_tokens):
        # Its raise fails nothing (the next step goes without drafts), but it counts as
        # step-wide so that it never hides the step's own raise.
        self.maybe_raise("schedkit_num_speculative_tokens")
        if self.spec_rng.random() < 0.5:  # drafts for some requests, not others
            return {r.request_id: self.spec_rng.randint(0, num_speculative_tokens) for r in running}
        return None

    @hookimpl
    def schedkit_on_step_end(self):
        self.maybe_raise("schedkit_on_step_end")

    @hookimpl
    def schedkit_on_request_finished(self, request):
        self.maybe_raise("schedkit_on_request_finished", request)


class FaultyQueue:
    """FCFS, or (``keyed``) a heap on a key function that raises too."""

    def __init__(self, faults: FaultInjector) -> None:
        self.faults = faults
        self.inner = KeyedQueue(self._key) if faults.keyed else FCFSQueue()
        self._in_batch = False

    def _key(self, req: Request) -> tuple[float, str]:
        # Inside a batch prepend the error cannot name the request: the step fails as a
        # whole, so it counts as a step-wide raise.
        self.faults.maybe_raise("key", None if self._in_batch else req)
        return (req.arrival_time, req.request_id)

    def add(self, request: Request) -> None:
        self.faults.maybe_raise("add", request)
        self.inner.add(request)

    def peek(self) -> Request:
        self.faults.maybe_raise("peek")
        return self.inner.peek()

    def pop(self) -> Request:
        self.faults.maybe_raise("pop")
        return self.inner.pop()

    def prepend_request(self, request: Request) -> None:
        self.faults.maybe_raise("prepend_request", request)
        self.inner.prepend_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.faults.maybe_raise("prepend_requests")
        self._in_batch = True
        try:
            self.inner.prepend_requests(requests)
        finally:
            self._in_batch = False

    def remove_request(self, request: Request) -> None:
        self.faults.maybe_raise("remove_request", request)
        self.inner.remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.faults.maybe_raise("remove_requests")
        self.inner.remove_requests(requests)

    def __len__(self) -> int:
        return len(self.inner)

    def __bool__(self) -> bool:
        return bool(self.inner)

    def __iter__(self) -> Iterator[Request]:
        self.faults.maybe_raise("__iter__")
        return iter(self.inner)


SLOW_GRAMMAR_FAULTS = ("slow-compile", "slow-fill", "slow-accept")
SLOW_GRAMMAR_LIMITS = {"backend": "slow-faults", "compile_timeout_s": 0.1, "step_budget_ms": 5.0}
"""The ``structured_outputs`` section the slow grammars exceed."""


class SlowGrammars:
    """A structured-output backend (``structured_outputs.backend: slow-faults``) whose
    grammars allow every token, so a structured request's tokens are those it would have
    without its constraint. The constraint ``regex="slow-compile"`` compiles for 0.3 s,
    past :data:`SLOW_GRAMMAR_LIMITS`' timeout; ``slow-fill`` and ``slow-accept`` spend 15
    ms in each fill or accept, past its step budget; ``regex="ok"`` is fast."""

    @hookimpl
    def schedkit_create_structured_output_backend(self, config):
        return SlowGrammarBackend() if config.backend == "slow-faults" else None


class SlowGrammarBackend(StructuredOutputBackend):
    name = "slow-faults"
    vocab_size = 1000

    def compile(self, params):
        if params.regex == "slow-compile":
            time.sleep(0.3)
        return params.regex

    def new_grammar(self, compiled, max_rollback_tokens):
        return AnyTokenGrammar(compiled)


class AnyTokenGrammar(StructuredOutputGrammar):
    def __init__(self, fault: str) -> None:
        self.fault = fault

    def accept_tokens(self, request_id, tokens):
        if self.fault == "slow-accept":
            time.sleep(0.015)
        return True

    def validate_tokens(self, tokens):
        return list(tokens)

    def rollback(self, num_tokens):
        pass

    def fill_bitmask(self, bitmask, row):
        if self.fault == "slow-fill":
            time.sleep(0.015)
        # the row is allocated allowing every token

    def is_terminated(self):
        return False
