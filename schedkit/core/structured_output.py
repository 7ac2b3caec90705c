"""Structured outputs in the scheduler: grammar compilation in the background, the
per-step token bitmask, and the backend interface a plugin can replace.

The manager compiles each structured request's grammar on a thread pool; the request
waits in ``WAITING_FOR_FSM`` (without blocking the queue) until its grammar is ready.
Compiled grammars are cached by their constraint (:attr:`StructuredOutputsParams.key`),
so a schema seen before is ready at once. Every step, the scheduler lists the
structured requests that sample and the manager fills one bitmask row per sampled
position (speculative positions included) from each request's matcher.

Backends come from the ``schedkit_create_structured_output_backend`` hook (built in:
``xgrammar``, and ``python``, a small regex/choice backend without torch).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.request import Request
from schedkit.errors import RequestError

log = logging.getLogger("schedkit.structured_output")


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
    """Compiles constraints into grammars for one tokenizer. ``compile`` runs on the
    manager's threads (it must be thread-safe); everything else on the engine thread.

    Attributes:
        name: Shown in logs and errors.
        vocab_size: Width of the bitmask (the model's logits), at least the tokenizer's.
    """

    name: str = "backend"
    vocab_size: int

    def validate(self, params: StructuredOutputsParams) -> None:
        """Check a constraint cheaply when its request arrives (a schema that is no
        schema, a pattern that does not parse). Raise ValueError naming what is wrong;
        the default checks nothing (compilation errors then fail the request later)."""
        return None

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile a constraint (on a worker thread). Raise on failure; the message is
        the request's error."""

    @abstractmethod
    def new_grammar(self, compiled: Any, max_rollback_tokens: int) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar, able to roll back that many tokens."""

    def bitmask_view(self, bitmask: GrammarBitmask) -> Any:
        """What :meth:`StructuredOutputGrammar.fill_bitmask` writes into (by default the
        bitmask itself; xgrammar's backend wraps its words in a tensor)."""
        return bitmask

    def shutdown(self) -> None:
        """Release the backend's resources."""
        return None


BackendFactory = Callable[[], StructuredOutputBackend]


class StructuredOutputManager:
    """Args:
        backend_factory: Builds the backend on first use (a backend may import torch);
            raises RequestError when structured outputs cannot be served.
        num_workers: Compile threads.
        cache_size: Compiled grammars kept (least recently used dropped first).
        max_rollback_tokens: Speculative tokens a matcher must be able to undo.
        jump_forward: Jump-forward decoding (``structured_outputs.jump_forward``).
    """

    def __init__(self, backend_factory: BackendFactory, *, num_workers: int = 2,
                 cache_size: int = 256, max_rollback_tokens: int = 0, jump_forward: bool = False) -> None:
        self._factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.RLock()  # a compile that already failed calls back under it
        self.max_rollback_tokens = max_rollback_tokens
        self.jump_forward = jump_forward
        """Append the tokens a grammar forces without sampling them (jump-forward decoding)."""
        self.num_compiled = 0
        """Grammars compiled (cache misses)."""
        self.num_failed = 0
        """Compilations that failed (counted from the worker threads)."""
        self.num_cache_hits = 0

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

    def add_request(self, request: Request) -> None:
        """Check the request's constraint and start compiling it (or take it from the
        cache).

        Raises:
            RequestError: The backend is unavailable or refuses the constraint.
        """
        so = request.structured_output
        assert so is not None
        backend = self.backend
        params = so.params
        try:
            backend.validate(params)
        except (ValueError, TypeError) as e:
            raise RequestError(f"request {request.request_id!r}: the {params.describe()} does not "
                               f"compile ({backend.name}): {e}", request_id=request.request_id) from None
        except Exception as e:  # the backend's bug: refuse this request, keep serving
            log.exception("structured-output backend %s raised in validate", backend.name)
            raise RequestError(f"request {request.request_id!r}: the structured-output backend "
                               f"{backend.name} raised checking the {params.describe()}: "
                               f"{type(e).__name__}: {e}", request_id=request.request_id) from None
        so.compiled = self._compiled(params)

    def _compiled(self, params: StructuredOutputsParams) -> Future[Any]:
        key = params.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_workers, thread_name_prefix="schedkit-grammar")
            fut = self._pool.submit(self.backend.compile, params)
            fut.add_done_callback(self._count_failure)
            self.num_compiled += 1
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _count_failure(self, fut: Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                self.num_failed += 1

    def check_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled; builds its matcher the first time.
        A failed compilation sets ``structured_output.error`` and answers False."""
        so = request.structured_output
        assert so is not None
        if so.grammar is not None:
            return True
        if so.error is not None or not so.compiled.done():
            return False
        err = None if not so.compiled.cancelled() else "compilation cancelled (the engine is shutting down)"
        if err is None and so.compiled.exception() is not None:
            e = so.compiled.exception()
            err = f"{type(e).__name__}: {e}"
        if err is None:
            try:
                grammar = self.backend.new_grammar(so.compiled.result(), self.max_rollback_tokens)
                if self._allows_nothing(grammar):
                    err = "no output satisfies it (no token can start it)"
                else:
                    so.grammar = grammar
                    return True
            except Exception as e:  # the backend's bug: this request fails, not the step
                log.exception("structured-output backend %s raised in new_grammar", self.backend.name)
                err = f"new_grammar raised {type(e).__name__}: {e}"
        so.error = (f"request {request.request_id!r}: the {so.params.describe()} does not "
                    f"compile ({self.backend.name}): {err}")
        return False

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
                        spec_tokens: dict[str, list[int]], num_rows: int) -> tuple[GrammarBitmask, list[str]]:
        """The step's bitmask: for each structured request, its row for the next token
        and one after each of its scheduled drafts (the matcher advances over the draft
        to fill the next row, then rolls back). A draft placeholder (-1) or a draft the
        grammar rejects leaves the rows after it unconstrained: the runner's verification
        rejects that draft anyway. Also returns the requests whose grammar raised (their
        rows allow every token; the engine fails them)."""
        backend = self.backend
        bitmask = GrammarBitmask.allocate(num_rows, backend.vocab_size)
        view = backend.bitmask_view(bitmask)
        failed = []
        for rid, row in rows.items():
            try:
                self._fill_rows(requests.get(rid), rid, row, spec_tokens.get(rid, ()), view)
            except Exception:  # the backend's bug: this request fails, not the step
                log.exception("request %r: its grammar raised filling the bitmask", rid)
                failed.append(rid)
        return bitmask, failed

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()

