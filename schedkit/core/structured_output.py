"""Structured outputs in the scheduler: grammar compilation off the engine thread, the
per-step token bitmask, and the backend interface a plugin can replace.

A structured request's constraint is first checked against the size limits on the
engine thread (cheap: its length, a JSON schema's nesting depth; see
:mod:`schedkit.core.grammar_limits`); the backend's ``validate`` and ``compile`` then run
on the manager's :class:`~schedkit.core.compile_pool.CompilePool` (worker processes when
the backend can ship its compiler to one, threads otherwise), with a timeout, behind a
bounded queue fair between clients. The request waits in ``WAITING_FOR_FSM`` (without
blocking the queue) until its grammar is ready; a request that leaves while it waits
cancels its compile when nobody else waits for it. Compiled grammars are cached by their
constraint (:attr:`StructuredOutputsParams.key`), so a schema seen before is ready at
once. Every step, the scheduler lists the structured requests that sample and the
manager fills one bitmask row per sampled position (speculative positions included) from
each request's matcher, timing each request's grammar work against its per-step budget.

Backends come from the ``schedkit_create_structured_output_backend`` hook (built in:
``xgrammar``, and ``python``, a small regex/choice backend without torch).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

from schedkit.config import StructuredOutputsConfig
from schedkit.core.compile_pool import (
    CompileFailed,
    CompilePool,
    CompileQueueFull,
    CompileTimeout,
    ProcessCompilerFactory,
)
from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.grammar_limits import StepBudget, constraint_limit_error
from schedkit.core.request import Request
from schedkit.errors import EngineBusyError, RequestError

GRAMMAR_OVER_BUDGET = "grammar_over_budget"
"""The stop reason of a request failed for going over ``structured_outputs.step_budget_ms``."""


class GrammarFailure(NamedTuple):
    """Why a structured request fails in this step, and its stop reason (None: the
    backend's fault, not the request's)."""

    why: str
    stop_reason: str | None = None


log = logging.getLogger("schedkit.structured_output")

DEFAULT_STEP_BUDGET_MS = 10.0
"""A backend's per-step matcher budget unless it says otherwise: xgrammar fills a
SmolLM2-sized row in well under a millisecond, an ambiguous grammar's in seconds."""


@dataclass(slots=True)
class GrammarBitmask:
    """Allowed tokens of one step: ``num_rows`` rows of ``num_words`` 32-bit words, bit
    ``t % 32`` of word ``t // 32`` of a row set when token ``t`` may be sampled there.
    ``words`` is flat and row-major (``array('i')``): a runner views it without a copy
    (``torch.frombuffer``)."""

    num_rows: int
    num_words: int
    words: array

    @classmethod
    def allocate(cls, num_rows: int, vocab_size: int) -> GrammarBitmask:
        num_words = (vocab_size + 31) // 32
        return cls(num_rows, num_words, array("i", [-1]) * (num_rows * num_words))

    def allows(self, row: int, token: int) -> bool:
        word = token >> 5
        if word >= self.num_words:
            return False
        return bool((self.words[row * self.num_words + word] >> (token & 31)) & 1)

    def allowed(self, row: int) -> list[int]:
        """The token ids row ``row`` allows (for tests and the fake runner)."""
        base = row * self.num_words
        out = []
        for w in range(self.num_words):
            bits = self.words[base + w] & 0xFFFFFFFF
            while bits:
                low = bits & -bits
                out.append(w * 32 + low.bit_length() - 1)
                bits ^= low
        return out


class StructuredOutputBackend(ABC):
    """Compiles constraints into grammars for one tokenizer. ``validate`` and ``compile``
    run on the manager's compile workers (threads, or processes when
    :meth:`process_compiler` says how); everything else on the engine thread.

    Attributes:
        name: Shown in logs and errors.
        vocab_size: Width of the bitmask (the model's logits), at least the tokenizer's.
    """

    name: str = "backend"
    vocab_size: int

    def validate(self, params: StructuredOutputsParams) -> None:
        """Check a constraint before compiling it (a schema that is no schema, a pattern
        that does not parse), on a compile worker, under the compile timeout (it may be
        as costly as parsing the constraint). Raise ValueError naming what is wrong; the
        default checks nothing."""
        return None

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile a constraint (on a compile worker thread, after :meth:`validate`;
        thread-safe). Raise on failure; the message is the request's error."""

    def process_compiler(self) -> ProcessCompilerFactory | None:
        """How to check and compile in a worker process, which the manager can kill at
        the compile timeout or when no request waits any more; None (the default):
        :meth:`validate` and :meth:`compile` run on threads of the engine process, which
        cannot be stopped (see :mod:`schedkit.core.compile_pool`).

        Returns:
            A picklable factory, called once in each worker process, returning a function
            that validates and compiles a constraint (ValueError naming what is wrong)
            and returns a picklable value for :meth:`load_compiled`.
        """
        return None

    def load_compiled(self, payload: Any) -> Any:
        """The compiled grammar from what a worker process's compile function returned
        (runs in the engine process, on a compile worker's thread)."""
        return payload

    @abstractmethod
    def new_grammar(self, compiled: Any, max_rollback_tokens: int) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar, able to roll back that many tokens."""

    def bitmask_view(self, bitmask: GrammarBitmask) -> Any:
        """What :meth:`StructuredOutputGrammar.fill_bitmask` writes into (by default the
        bitmask itself; xgrammar's backend wraps its words in a tensor)."""
        return bitmask

    def default_step_budget_ms(self) -> float:
        """The per-step matcher budget of one request when the config sets none
        (``structured_outputs.step_budget_ms``): what a legitimate grammar's fill and
        accepts may cost here, with room to spare."""
        return DEFAULT_STEP_BUDGET_MS

    def shutdown(self) -> None:
        """Release the backend's resources."""
        return None


BackendFactory = Callable[[], StructuredOutputBackend]


class StructuredOutputManager:
    """Args:
        backend_factory: Builds the backend on first use (a backend may import torch);
            raises RequestError when structured outputs cannot be served.
        num_workers: Compile workers (processes or threads, see the module doc).
        cache_size: Compiled grammars kept (least recently used dropped first).
        max_rollback_tokens: Speculative tokens a matcher must be able to undo.
        jump_forward: Jump-forward decoding (``structured_outputs.jump_forward``).
        limits: The limits of ``structured_outputs`` (compile timeout and queue, constraint
            size, per-step budget); their defaults when None.
    """

    def __init__(self, backend_factory: BackendFactory, *, num_workers: int = 2,
                 cache_size: int = 256, max_rollback_tokens: int = 0, jump_forward: bool = False,
                 limits: StructuredOutputsConfig | None = None) -> None:
        self._factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._num_workers = num_workers
        self.limits = limits or StructuredOutputsConfig()
        self._pool: CompilePool | None = None
        self._cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.RLock()  # a compile that already failed calls back under it
        self.max_rollback_tokens = max_rollback_tokens
        self.jump_forward = jump_forward
        """Append the tokens a grammar forces without sampling them (jump-forward decoding)."""
        self.num_compiled = 0
        """Grammars compiled (cache misses)."""
        self.num_failed = 0
        """Compilations that failed, timeouts included (counted from the workers)."""
        self.num_failure_events = 0
        """Compile failures requests learned of: failed compilations, and requests given a
        cached timeout (the scheduler then looks for the requests to fail)."""
        self.num_cache_hits = 0
        self.num_refused = 0
        """Constraints refused before compiling: over a size limit, or the queue full."""
        self.num_over_budget = 0
        """Requests failed for costing more than their per-step budget."""

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (a failed build is tried again by the next
        structured request).

        Raises:
            RequestError: The backend cannot be built (no tokenizer, xgrammar missing, a
                plugin that raised).
        """
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    @property
    def step_budget_ms(self) -> float:
        """One request's per-step matcher budget: ``structured_outputs.step_budget_ms``,
        else the backend's default."""
        configured = self.limits.step_budget_ms
        return configured if configured is not None else self.backend.default_step_budget_ms()

    @property
    def num_timeouts(self) -> int:
        """Compiles stopped at ``structured_outputs.compile_timeout_s``."""
        return self._pool.num_timeouts if self._pool is not None else 0

    @property
    def num_cancelled(self) -> int:
        """Compiles cancelled because every request waiting for them left."""
        return self._pool.num_cancelled if self._pool is not None else 0

    def add_request(self, request: Request) -> None:
        """Check the request's constraint against the size limits and queue its compile
        (or take it from the cache, or join the same constraint's compile).

        Raises:
            RequestError: The backend is unavailable, the constraint is over a limit, or
                the compile queue is full; the message names the limit's config key.
        """
        so = request.structured_output
        assert so is not None
        rid = request.request_id
        why = constraint_limit_error(so.params, self.limits)
        if why is not None:
            self.num_refused += 1
            raise RequestError(f"request {rid!r}: {why}", request_id=rid)
        so.compiled = self._compiled(request)  # builds the backend first: RequestError if unavailable

    def _compiled(self, request: Request) -> Future[Any]:
        so = request.structured_output
        assert so is not None
        key = so.params.key
        rid = request.request_id
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and fut.done() and _is_reusable(fut):
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                if fut.exception() is not None:  # a timeout: this request fails at once
                    self.num_failure_events += 1
                return fut
            try:
                fut = self._compile_pool().submit(key, so.params, (request.client_index, request.tenant), rid)
            except CompileQueueFull as e:
                self.num_refused += 1
                limits = self.limits
                raise EngineBusyError(
                    f"request {rid!r}: the grammar compile queue is full ({e}: "
                    f"structured_outputs.max_queued_compiles = {limits.max_queued_compiles}, "
                    f"max_queued_compiles_per_client = {limits.max_queued_compiles_per_client}); "
                    "retry later", request_id=rid) from None
            if self._cache.get(key) is fut:  # joined the same constraint's compile
                self.num_cache_hits += 1
                return fut
            fut.add_done_callback(self._count_failure)
            self.num_compiled += 1
            self._cache[key] = fut
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile_pool(self) -> CompilePool:
        if self._pool is None:
            backend = self.backend
            factory = backend.process_compiler()
            limits = self.limits
            self._pool = CompilePool(
                functools.partial(_check_and_compile, backend), num_workers=self._num_workers,
                timeout_s=limits.compile_timeout_s, max_queued=limits.max_queued_compiles,
                max_queued_per_owner=limits.max_queued_compiles_per_client, process_compiler=factory,
                load=backend.load_compiled, preload=(type(factory).__module__,) if factory is not None else ())
        return self._pool

    def _count_failure(self, fut: Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            with self._lock:
                self.num_failed += 1
                self.num_failure_events += 1

    def release(self, request: Request) -> None:
        """The request left (finished, aborted): a compile nobody else waits for is
        cancelled, stopped if it runs."""
        so = request.structured_output
        if so is None or so.compiled is None or so.compiled.done() or self._pool is None:
            return
        self._pool.release(so.params.key, request.request_id)

    def check_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled; builds its matcher the first time.
        A failed compilation sets ``structured_output.error`` and answers False."""
        so = request.structured_output
        assert so is not None
        if so.grammar is not None:
            return True
        if so.error is not None or not so.compiled.done():
            return False
        err = self._compile_error(so.compiled)
        if err is None:
            try:
                grammar = self.backend.new_grammar(so.compiled.result(), self.max_rollback_tokens)
                if self._allows_nothing(grammar):
                    err = "no output satisfies it (no token can start it)"
                elif request.output_token_ids and not grammar.accept_tokens(request.request_id,
                                                                             request.output_token_ids):
                    err = "the outputs it brought from another engine do not satisfy it"
                else:
                    so.grammar = grammar
                    so.budget = StepBudget(self.step_budget_ms / 1e3)
                    return True
            except Exception as e:  # the backend's bug: this request fails, not the step
                log.exception("structured-output backend %s raised in new_grammar", self.backend.name)
                err = f"new_grammar raised {type(e).__name__}: {e}"
        so.error = (f"request {request.request_id!r}: the {so.params.describe()} does not "
                    f"compile ({self.backend.name}): {err}")
        return False

    @staticmethod
    def _compile_error(fut: Future[Any]) -> str | None:
        if fut.cancelled():
            return "compilation cancelled (the engine is shutting down)"
        e = fut.exception()
        if e is None:
            return None
        if isinstance(e, CompileTimeout | CompileFailed):
            return str(e)
        return f"{type(e).__name__}: {e}"

    def _allows_nothing(self, grammar: StructuredOutputGrammar) -> bool:
        """Whether a fresh matcher allows no first token (a pattern that matches nothing)."""
        if grammar.is_terminated():
            return False
        probe = GrammarBitmask.allocate(1, self.backend.vocab_size)
        grammar.fill_bitmask(self.backend.bitmask_view(probe), 0)
        return not any(probe.words)

    def compiling(self, request: Request) -> bool:
        """Whether the request's grammar is still being compiled."""
        so = request.structured_output
        return so is not None and so.grammar is None and so.error is None and not so.compiled.done()

    def grammar_bitmask(self, requests: dict[str, Request], rows: dict[str, int],
                        spec_tokens: dict[str, list[int]], num_rows: int
                        ) -> tuple[GrammarBitmask, dict[str, GrammarFailure]]:
        """The step's bitmask: for each structured request, its row for the next token
        and one after each of its scheduled drafts (the matcher advances over the draft
        to fill the next row, then rolls back). A draft placeholder (-1) or a draft the
        grammar rejects leaves the rows after it unconstrained: the runner's verification
        rejects that draft anyway. Also returns the requests to fail, with why: their
        grammar raised, or went over its per-step budget (their rows allow every token)."""
        backend = self.backend
        bitmask = GrammarBitmask.allocate(num_rows, backend.vocab_size)
        view = backend.bitmask_view(bitmask)
        failed: dict[str, GrammarFailure] = {}
        for rid, row in rows.items():
            req = requests.get(rid)
            try:
                t0 = time.perf_counter()
                self._fill_rows(req, rid, row, spec_tokens.get(rid, ()), view)
                over = self._over_budget(req, time.perf_counter() - t0)
            except Exception:  # the backend's bug: this request fails, not the step
                log.exception("request %r: its grammar raised filling the bitmask", rid)
                failed[rid] = GrammarFailure("the structured-output backend raised filling its grammar's "
                                             "bitmask (logged)")
                continue
            if over is not None:
                self.num_over_budget += 1
                log.warning("request %r: %s; failing it", rid, over)
                failed[rid] = GrammarFailure(f"request {rid!r}: {over}", GRAMMAR_OVER_BUDGET)
        return bitmask, failed

    @staticmethod
    def _over_budget(req: Request | None, fill_s: float) -> str | None:
        """Add the step's fill to the request's matcher work since its last fill (its
        accepted tokens); why it must fail, or None."""
        so = req.structured_output if req is not None else None
        if so is None or so.budget is None:
            return None
        work_s, so.matcher_s = so.matcher_s + fill_s, 0.0
        return so.budget.record(work_s)

    @staticmethod
    def _fill_rows(req: Request | None, rid: str, row: int, drafts: Iterable[int], view: Any) -> None:
        """One request's rows: its next token, then one after each draft it accepts."""
        so = req.structured_output if req is not None else None
        grammar = so.grammar if so is not None else None
        if grammar is None or grammar.is_terminated():
            return  # finished while the step was planned: any token (it is dropped)
        grammar.fill_bitmask(view, row)
        advanced = 0
        try:
            for draft in drafts:
                if draft < 0 or not grammar.accept_tokens(rid, (draft,)):
                    break
                advanced += 1
                row += 1
                if grammar.is_terminated():
                    break
                grammar.fill_bitmask(view, row)
        finally:
            if advanced:
                grammar.rollback(advanced)

    def validate_drafts(self, request: Request, drafts: Iterable[int]) -> list[int]:
        """The drafts up to the first one the request's grammar rejects."""
        so = request.structured_output
        drafts = list(drafts)
        if so is None or so.grammar is None or not drafts:
            return drafts
        return so.grammar.validate_tokens(drafts)

    def shutdown(self) -> None:
        """Cancel the compiles and stop the workers (their processes killed), then shut
        the backend down."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._backend is not None:
            self._backend.shutdown()


def _check_and_compile(backend: StructuredOutputBackend, params: StructuredOutputsParams) -> Any:
    """A compile thread's job: the backend's check, then its compilation."""
    backend.validate(params)
    return backend.compile(params)


def _is_reusable(fut: Future[Any]) -> bool:
    """A settled compile whose result a new request may take: it succeeded, or it timed
    out (the same constraint would time out again: refused at once). Other failures are
    compiled again."""
    if fut.cancelled():
        return False
    e = fut.exception()
    return e is None or isinstance(e, CompileTimeout)

