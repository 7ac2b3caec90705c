"""The OpenAI completions and chat endpoints over one :class:`AsyncLLM`.

One HTTP request becomes one engine request per prompt and choice (``n > 1`` runs as
separate requests), with the engine id ``<id>[-<k>]-<random>``: the client's id (its
``X-Request-Id`` or a new one) first, so logs match, and unique even when a client
reuses its id. Each runs as a task that turns the engine's token
deltas into text (:class:`TextStream`: stop strings are found here, and a request whose
stop string appeared is aborted in the engine) and puts its events on one queue; the
endpoint reads that queue to build a JSON answer or a stream of server-sent events.

Nothing is sent before the first event: a request the admission policy rejects, or one
the engine refuses, is answered with its HTTP error (429, 400) even when it asked to
stream. Errors after the first byte of a stream arrive as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from schedkit.config import Config
from schedkit.core.request import SamplingParams
from schedkit.core.structured_output import GRAMMAR_OVER_BUDGET
from schedkit.errors import EngineBusyError, EngineDeadError, RequestError
from schedkit.llm import AsyncLLM, RequestOutput
from schedkit.server.metrics import ServerMetrics
from schedkit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
)
from schedkit.server.text import TextStream
from schedkit.structured.plugin import NO_TOKENIZER

log = logging.getLogger("schedkit.server")

MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 512
"""Stop strings are searched on every delta, on the event loop: bounded, so one request
cannot slow every stream."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` one request may send (each choice copies them into the engine)."""
SHORT_TEXT_CHARS = 4096
"""Texts (a prompt, a chat's contents) up to this long are tokenized on a thread of their
own, so a short request never waits behind long ones (``server.tokenizer_threads``)."""


def request_id_from_header(value: str | None, prefix: str) -> str:
    """The client's ``X-Request-Id`` (printable ASCII, at most 256 characters) or a new id.

    Raises:
        APIError: 400 for an empty, too long or non-printable header.
    """
    if value is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not value or len(value) > MAX_REQUEST_ID_LEN or not all(32 < ord(c) < 127 for c in value):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
                       "characters without spaces", param="X-Request-Id")
    return value


ASCII_WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
OTHER_WHITESPACE = "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
"""With :data:`ASCII_WHITESPACE`, every character ``str.isspace`` calls whitespace."""


_ASCII_WHITESPACE_BYTES = ASCII_WHITESPACE.encode()


def _whitespace_count(text: str) -> int:
    """The whitespace characters in ``text``, in C loops that make no object per word
    (``str.split`` on 8 MB of words took 0.36 s; this, 10 ms, or 80 ms for text that is
    not ASCII)."""
    if text.isascii():
        return len(text) - len(text.encode("ascii").translate(None, _ASCII_WHITESPACE_BYTES))
    return sum(map(text.count, ASCII_WHITESPACE + OTHER_WHITESPACE))


@dataclass(frozen=True, slots=True)
class TextBound:
    """How many characters a text may have and still fit ``max_model_len`` tokens, so that
    a longer one is refused before tokenizing it (a text of megabytes holds a tokenizer
    thread for seconds). No token of the vocabulary stands for more than ``token_chars``
    characters, so a text of more than ``max_model_len * token_chars`` characters has
    more than ``max_model_len`` tokens. With a tokenizer that drops whitespace (splits
    on it, or folds runs of it), whitespace is not counted.
    """

    max_model_len: int
    token_chars: int
    """The longest token's length in characters (a byte-level token's length in bytes)."""
    skips_whitespace: bool
    """The tokenizer turns whitespace into fewer tokens than ``token_chars`` allows."""

    WHITESPACE_PROBES: ClassVar[tuple[str, ...]] = (" " * 64, "\n" * 64, "\t" * 64, "\u3000" * 64)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> TextBound | None:
        """The bound of a transformers tokenizer (None without one, or without a vocabulary)."""
        vocab = getattr(tokenizer, "get_vocab", None)
        if tokenizer is None or vocab is None:
            return None
        token_chars = max(map(len, vocab()), default=0)
        if token_chars < 1:
            return None
        skips = any(len(tokenizer.encode(p, add_special_tokens=False)) * token_chars < len(p)
                    for p in cls.WHITESPACE_PROBES)
        return cls(max_model_len, token_chars, skips)

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.token_chars

    def check(self, texts: Sequence[str], param: str) -> None:
        """Raises:
            APIError: 400 naming ``param`` when ``texts`` together cannot fit.
        """
        count = sum(map(len, texts))
        if count <= self.max_chars:
            return
        what = "characters"
        if self.skips_whitespace:
            count -= sum(map(_whitespace_count, texts))
            if count <= self.max_chars:
                return
            what = "characters besides whitespace"
        raise APIError(400, f"{param}: {count} {what} cannot fit this model's context of "
                       f"{self.max_model_len} tokens (scheduler.max_model_len): no token of its "
                       f"tokenizer stands for more than {self.token_chars} characters", param=param)


@dataclass(slots=True)
class Choice:
    """One engine request: a prompt's k-th choice."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextStream
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: APIError | None = None
    started: bool = False
    """Its task began running (a task cancelled before that never runs its own cleanup)."""
    constraint_field: str | None = None
    """The body field its structured-output constraint came from (for 400s)."""


@dataclass(slots=True)
class Event:
    """A choice's new text (and ids), or its end (``done``), or its failure (``error``)."""

    choice: Choice
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """Set on the choice's last text event (or on ``done`` when it ended without one)."""
    stop_reason: int | str | None = None
    done: bool = False
    error: APIError | None = None


async def _run_on(pool: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on one of ``pool``'s threads, awaited from the loop."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))


class Server:
    """What the endpoints share: the engine client, tokenizer, config, metrics, limits."""

    def __init__(self, config: Config, llm: AsyncLLM, tokenizer: Any, metrics: ServerMetrics,
                 model_name: str, model_eos_ids: Sequence[int] = ()) -> None:
        self.config = config
        self.llm = llm
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_name = model_name
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.runner.vocab_size if tokenizer is None else max(
            config.runner.vocab_size, len(tokenizer))
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id: int | None = eos if isinstance(eos, int) else config.runner.eos_token_id
        self.extra_eos_ids = tuple(t for t in model_eos_ids if t != self.eos_token_id)
        """The model's other end tokens (config.json / generation_config.json, e.g. an
        end-of-turn token besides the tokenizer's EOS): stop tokens unless ignore_eos."""
        self.draining = False
        self.tasks: set[asyncio.Task[None]] = set()
        """One task per engine request (choice) in flight."""
        self.num_unstarted = 0
        """Choices whose task has not run yet (with flow control: not at the door yet)."""
        self._short_texts = ThreadPoolExecutor(1, thread_name_prefix="schedkit-tokenizer-short")
        self._long_texts = ThreadPoolExecutor(config.server.tokenizer_threads,
                                              thread_name_prefix="schedkit-tokenizer")
        self._bodies = ThreadPoolExecutor(1, thread_name_prefix="schedkit-body")
        self.text_bound = TextBound.of(tokenizer, self.max_model_len)
        """The longest text that can fit ``max_model_len`` (None without a tokenizer)."""

    # -- prompts -------------------------------------------------------------------------
    def _need_tokenizer(self, what: str, param: str = "prompt") -> Any:
        if self.tokenizer is None:
            hint = "; send token ids" if param == "prompt" else ""
            raise APIError(400, f"{what} needs a tokenizer, and this model has none "
                           f"(set model.tokenizer){hint}", param=param)
        return self.tokenizer

    async def off_loop(self, fn: Any, *args: Any, size: int, **kwargs: Any) -> Any:
        """Run tokenizer work of ``size`` (characters or token ids) on a tokenizer thread:
        a long prompt or chat template must not stall every stream on the event loop, and
        a short one has a thread of its own (:data:`SHORT_TEXT_CHARS`)."""
        lane = self._short_texts if size <= SHORT_TEXT_CHARS else self._long_texts
        return await _run_on(lane, fn, *args, **kwargs)

    async def in_body_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` (a large body's decoding and validation) on the body thread."""
        return await _run_on(self._bodies, fn, *args)

    def check_text_fits(self, texts: Sequence[str], param: str) -> None:
        """Refuse, before tokenizing, text too long to ever fit ``max_model_len`` tokens.

        Raises:
            APIError: 400 naming ``param``, the length and ``scheduler.max_model_len``.
        """
        if self.text_bound is not None:
            self.text_bound.check(texts, param)

    async def tokenize(self, text: str, param: str = "prompt", what: str = "a text prompt",
                       **kwargs: Any) -> list[int]:
        """Token ids of ``text``, checked to fit first (``kwargs`` go to the tokenizer's
        ``encode``).

        Raises:
            APIError: 400 without a tokenizer (naming ``what`` needs one) or for a text
                too long to fit ``max_model_len``.
        """
        tok = self._need_tokenizer(what, param)
        self.check_text_fits([text], param)
        return list(await self.off_loop(tok.encode, text, size=len(text), **kwargs))

    async def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a text or token-id prompt, checked against the vocabulary.

        Raises:
            APIError: 400 for text without a tokenizer or too long to fit
                ``max_model_len``, an empty prompt or an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            ids = await self.tokenize(prompt, param)
        else:
            ids = prompt
            self.check_token_ids(ids, param)
        if not ids:
            raise APIError(400, f"{param} is empty", param=param)
        return ids

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Raises:
            APIError: 400 naming the first id outside the vocabulary (``param[i]``).
        """
        bad = next((i for i, t in enumerate(ids) if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}[{bad}] = {ids[bad]} is not a token of this model "
                           f"(vocabulary size {self.vocab_size})", param=f"{param}[{bad}]")

    async def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """The chat template applied to ``messages``, tokenized.

        Raises:
            APIError: 400 without a tokenizer or a chat template.
        """
        tok = self._need_tokenizer("chat", "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        contents = [c["content"] for c in convo]
        self.check_text_fits(contents, "messages")
        size = sum(map(len, contents))
        try:
            text = await self.off_loop(tok.apply_chat_template, convo, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, size=size)
        except ImportError as e:  # the server's installation lacks jinja2: not the client's fault
            raise APIError(500, f"the chat template cannot run on this server: {e}") from None
        except Exception as e:  # a template that raises on this conversation (jinja's raise_exception)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        ids = await self.off_loop(tok.encode, text, add_special_tokens=False, size=len(text))
        return await self.encode(list(ids), "messages")

    # -- limits --------------------------------------------------------------------------
    def _max_tokens(self, prompt_len: int, max_tokens: int | None, param: str,
                    prompt_param: str = "prompt") -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise self._prompt_too_long(prompt_len, prompt_param)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(400, f"{param}={max_tokens} plus the prompt's {prompt_len} tokens "
                           f"exceeds this model's context of {self.max_model_len} tokens "
                           "(scheduler.max_model_len)", param=param)
        return max_tokens

    def _prompt_too_long(self, prompt_len: int, param: str) -> APIError:
        return APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                        f"{self.max_model_len} tokens (scheduler.max_model_len), so at most "
                        f"{self.max_model_len - 1} fit with one output token", param=param)

    def refuse_by_length(self, model: type[Any], body: dict[str, Any]) -> None:
        """Refuse a decoded body that the limits refuse by the length of one of its lists
        alone, before validating each element (for a list the size of the body limit,
        seconds of work): a token-id prompt of ``max_model_len`` ids or more, more
        completions than the pending limit holds, more stop strings or stop token ids
        than allowed, more chat messages than ``max_model_len`` (each is at least one
        token), more ids to detokenize than ``max_model_len``.

        Raises:
            APIError: 400 naming the field and its limit.
        """
        m = self.max_model_len
        if model is CompletionRequest:
            self._refuse_long_prompts(body.get("prompt"))
        if model in (CompletionRequest, ChatCompletionRequest):
            stop, ids = body.get("stop"), body.get("stop_token_ids")
            if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
                raise _too_many_stop_strings()
            if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
                raise _too_many_stop_token_ids(len(ids))
        messages = body.get("messages") if model in (ChatCompletionRequest, TokenizeRequest) else None
        if isinstance(messages, list) and len(messages) > m:
            raise APIError(400, f"messages: {len(messages)} messages cannot fit this model's context of "
                           f"{m} tokens (scheduler.max_model_len); each takes at least one", param="messages")
        tokens = body.get("tokens") if model is DetokenizeRequest else None
        if isinstance(tokens, list) and len(tokens) > m:
            raise APIError(400, f"tokens: {len(tokens)} ids; at most {m} are decoded at once "
                           "(scheduler.max_model_len)", param="tokens")

    def _refuse_long_prompts(self, prompt: Any) -> None:
        """Raises:
            APIError: 400 for a batch of more prompts than the pending limit holds, or a
                token-id prompt of ``max_model_len`` ids or more (by its length alone).
        """
        if not isinstance(prompt, list) or not prompt:
            return
        if not isinstance(prompt[0], (list, str)):  # one token-id prompt
            if len(prompt) >= self.max_model_len:
                raise self._prompt_too_long(len(prompt), "prompt")
            return
        self.check_never_fits(len(prompt), "prompt")
        for i, p in enumerate(prompt):
            if isinstance(p, list) and len(p) >= self.max_model_len:
                raise self._prompt_too_long(len(p), f"prompt[{i}]" if len(prompt) > 1 else "prompt")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model")

    def check_capacity(self, n: int, num_prompts: int, param: str) -> None:
        """Refuse, before any work, a request of ``num_prompts`` prompts x ``n`` choices
        that the limits can never take (400), or that finds the server full now (503).
        Called before :meth:`make_choices`.

        Raises:
            APIError: 400 over ``server.max_n`` or ``server.max_pending_requests`` alone;
                503 as :meth:`start` would.
        """
        if n > self.config.server.max_n:
            raise APIError(400, f"n={n} exceeds the limit of {self.config.server.max_n} "
                           "(server.max_n)", param="n")
        self._admit(num_prompts * n, param)

    def check_never_fits(self, count: int, param: str | None) -> None:
        """Raises:
            APIError: 400 for ``count`` engine requests the pending limit can never hold
                (waiting cannot help, so no ``Retry-After``).
        """
        limit = self.config.server.max_pending_requests
        if count > limit:
            raise APIError(400, f"this request asks for {count} completions (prompts x n); the "
                           f"server takes at most {limit} at a time (server.max_pending_requests)",
                           param=param)

    def _admit(self, count: int, param: str | None = None) -> None:
        self.check_never_fits(count, param)
        limit = self.config.server.max_pending_requests
        if self.draining:
            raise APIError(503, "the server is shutting down",
                           headers={"Retry-After": str(self.config.server.retry_after_s)})
        if not self.llm_alive():
            raise APIError(503, "the engine is not running")
        in_flight = self.num_pending - self.num_held
        if in_flight + count > limit:
            raise APIError(503, f"too many pending requests: {in_flight} in flight, this "
                           f"request adds {count}, the limit is {limit} (server.max_pending_requests)",
                           headers={"Retry-After": str(self.config.server.retry_after_s)})

    @property
    def num_pending(self) -> int:
        """Engine requests (choices) in flight, those held at the front door included."""
        return len(self.tasks)

    @property
    def num_held(self) -> int:
        """Choices at the front door (``flow_control``): held there, or on their way (a
        burst's tasks run only after every request in it was admitted). The door's
        ``max_queued`` bounds them, not ``max_pending_requests``, so a tenant flooding
        the door meets its limit, which refuses the tenant holding the most, instead of
        filling the pending limit for everyone."""
        flow = getattr(self.llm, "flow", None)
        return flow.num_queued + self.num_unstarted if flow is not None else 0

    def llm_alive(self) -> bool:
        return self.llm.is_alive()

    # -- choices -------------------------------------------------------------------------
    def make_choices(self, req: _Sampling, request_id: str, prompts: list[list[int]],
                     max_tokens: int | None, max_tokens_param: str) -> list[Choice]:
        stop = req.stop_strings()
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_STRING_LEN for x in stop):
            raise _too_many_stop_strings()
        if req.stop_token_ids:
            if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise _too_many_stop_token_ids(len(req.stop_token_ids))
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer, and this model has none; "
                           "use stop_token_ids", param="stop")
        structured = req.constraint  # built once by parse_body, shared by every choice (frozen)
        single = len(prompts) == 1 and req.n == 1
        choices = []
        for p, ids in enumerate(prompts):
            # the field the prompt came from: a chat's messages, or one prompt of a batch
            prompt_param = ("messages" if isinstance(req, ChatCompletionRequest)
                            else f"prompt[{p}]" if len(prompts) > 1 else "prompt")
            limit = self._max_tokens(len(ids), max_tokens, max_tokens_param, prompt_param)
            for k in range(req.n):
                index = p * req.n + k
                seed = req.seed if req.seed is None or k == 0 else (req.seed + k) % 2**63
                try:
                    params = SamplingParams(
                        max_tokens=limit, min_tokens=req.min_tokens,
                        stop_token_ids=tuple(req.stop_token_ids or ())
                        + (() if req.ignore_eos else self.extra_eos_ids), ignore_eos=req.ignore_eos,
                        eos_token_id=self.eos_token_id,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p,
                        top_k=-1 if req.top_k is None else req.top_k, seed=seed,
                        structured_outputs=structured)
                except RequestError as e:
                    raise APIError(400, str(e), param=_param_of(str(e))) from None
                text = TextStream(self.tokenizer, ids, stop=stop,
                                  include_stop=req.include_stop_str_in_output,
                                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens)
                # The engine's id carries the client's and a random suffix: a client may
                # reuse its X-Request-Id while the engine still winds the old one down.
                suffix = uuid.uuid4().hex[:8]
                rid = f"{request_id}-{suffix}" if single else f"{request_id}-{index}-{suffix}"
                choices.append(Choice(index, rid, ids, params, text,
                                      constraint_field=req.structured_outputs_field()))
        return choices

    def check_hints(self, req: Any) -> None:
        """Refuse an SLO class the config does not name (400 naming ``slo_class``)."""
        name = getattr(req, "slo_class", None)
        if name is not None and name not in self.config.slo_classes:
            known = ", ".join(sorted(self.config.slo_classes)) or "none: the config names no slo_classes"
            raise APIError(400, f"slo_class {name!r} is not one of the server's SLO classes ({known})",
                           param="slo_class")

    def start(self, choices: list[Choice], req: _Sampling, arrival: float | None = None,
              ) -> tuple[asyncio.Queue[Event], list[asyncio.Task[None]]]:
        """Send every choice to the engine; their events arrive on the returned queue.
        ``arrival`` (``time.perf_counter()``, default now) is when the HTTP request came:
        the latencies recorded count from it.

        Raises:
            APIError: 503 while draining, with the engine gone, or over the pending limit.
        """
        self._admit(len(choices))
        queue: asyncio.Queue[Event] = asyncio.Queue()
        tenant = req.user if req.user is not None else "default"
        tasks = []
        for c in choices:
            self.num_unstarted += 1
            task = asyncio.create_task(self._run(c, queue, tenant, req, arrival))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            task.add_done_callback(functools.partial(self._never_started, c, queue))
            tasks.append(task)
        return queue, tasks

    def _never_started(self, c: Choice, queue: asyncio.Queue[Event], _: object = None) -> None:
        """The bookkeeping of a choice whose task was cancelled before it ran (its client
        left at once): nothing reached the engine."""
        if not c.started:
            self.num_unstarted -= 1
            c.finish_reason = "abort"
            queue.put_nowait(Event(c, finish_reason="abort", done=True))

    async def _run(self, c: Choice, queue: asyncio.Queue[Event], tenant: str, req: _Sampling,
                   arrival: float | None = None) -> None:
        c.started = True
        self.num_unstarted -= 1
        start = time.perf_counter() if arrival is None else arrival
        first: float | None = None
        last = start
        metrics = None
        told_end = False
        try:
            gen: Any = self.llm.generate(c.prompt_token_ids, c.params, request_id=c.request_id,
                                         priority=req.priority, tenant=tenant, ttft_slo_s=req.ttft_slo_s,
                                         hints=req.hints())
            async with aclosing(gen):
                async for out in gen:
                    now = time.perf_counter()
                    if out.output_token_ids:
                        if first is None:
                            first = now
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                    ev = self._apply(c, out)
                    if out.metrics is not None:
                        metrics = out.metrics
                    if ev.text or ev.token_ids or ev.finish_reason is not None:
                        queue.put_nowait(ev)
                        told_end = ev.finish_reason is not None
                    if c.finish_reason is not None:
                        break  # a stop string: closing the generator aborts it in the engine
        except EngineBusyError as e:  # a bounded queue of the engine is full: retry later
            c.error = APIError(429, _without_request_id(str(e), c.request_id),
                               headers={"Retry-After": str(self.config.server.retry_after_s)})
        except RequestError as e:  # refused when the engine received it
            message = _without_request_id(str(e), c.request_id)
            # a schema, pattern or grammar that does not compile: name the field it came from
            param = (req.structured_outputs_field()
                     if "does not compile" in message or message.startswith(NO_TOKENIZER) else None)
            c.error = APIError(400, message, param=param)
        except EngineDeadError as e:
            c.error = APIError(503, f"the engine died: {e}")
        except asyncio.CancelledError:
            c.finish_reason = c.finish_reason or "abort"
            raise
        except Exception as e:  # a bug here must not leave the HTTP request hanging
            log.exception("request %s failed in the server", c.request_id)
            c.error = APIError(500, f"internal error ({type(e).__name__}); see the server log")
        finally:
            if c.error is None and c.finish_reason is None:
                c.finish_reason = "abort"
            told = told_end or c.error is not None
            # An abort (drain, disconnect) still hands out the text held back for stop strings.
            queue.put_nowait(Event(c, "" if told else c.text.finish(),
                                   finish_reason=None if told else c.finish_reason,
                                   done=True, error=c.error))
            if c.error is None:
                queue_time = None
                if metrics is not None and metrics.first_scheduled_time is not None:
                    queue_time = max(metrics.first_scheduled_time - metrics.arrival_time, 0.0)
                self.metrics.request_finished(
                    finish_reason=str(c.finish_reason), tenant=tenant,
                    num_prompt_tokens=len(c.prompt_token_ids),
                    num_output_tokens=len(c.text.output_token_ids),
                    ttft=None if first is None else first - start,
                    e2e=time.perf_counter() - start, queue_time=queue_time,
                    max_tokens=c.params.max_tokens, n=req.n, engine=metrics,
                    slo_class=getattr(req, "slo_class", None))

    def _apply(self, c: Choice, out: RequestOutput) -> Event:
        """Fold one engine delta into the choice; returns the event to send."""
        n_before = len(c.text.output_token_ids)
        c.num_cached_tokens = max(c.num_cached_tokens, out.num_cached_tokens)
        text = c.text.add(out.output_token_ids)
        if c.text.stopped:
            c.finish_reason, c.stop_reason = "stop", c.text.stop_reason
        elif out.finished:
            text += c.text.finish()
            if out.finish_reason == "error" and _constraint_failed(out, n_before):
                # the client's mistake, found after the request was accepted
                c.error = APIError(400, _without_request_id(out.error or "the constraint does not compile",
                                                            c.request_id),
                                   param=c.constraint_field)
            elif out.finish_reason == "error":
                c.error = APIError(500, f"the request failed in the engine: {out.error}")
            elif out.finish_reason == "abort" and out.stop_reason == "rejected":
                c.error = self._rejected(out.rejected_by, out.rejection_reason)
            else:
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return Event(c, text, c.text.output_token_ids[n_before:], c.finish_reason, c.stop_reason,
                     error=c.error)

    def _rejected(self, plugin: str | None, reason: str | None) -> APIError:
        by = f" (plugin {plugin!r})" if plugin else ""
        why = reason or ("the plugin gave no reason: the request cannot be served in time or over "
                         "its quota; retry later or with a looser ttft_slo_s")
        return APIError(429, f"rejected by the scheduling policy's admission control{by}: {why}",
                        headers={"Retry-After": str(self.config.server.retry_after_s)})

    def close(self) -> None:
        for pool in (self._short_texts, self._long_texts, self._bodies):
            pool.shutdown(wait=False, cancel_futures=True)

    def abort_all(self) -> None:
        """Cancel every choice in flight (their engine requests are aborted)."""
        for task in list(self.tasks):
            task.cancel()


def _too_many_stop_strings() -> APIError:
    return APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings of at most "
                    f"{MAX_STOP_STRING_LEN} characters each", param="stop")


def _too_many_stop_token_ids(count: int) -> APIError:
    return APIError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {count}",
                    param="stop_token_ids")


def _constraint_failed(out: RequestOutput, num_tokens_before: int) -> bool:
    """Whether a request failed for its output constraint: it failed to compile (or
    matches nothing) before any token, or its matcher went over its per-step budget."""
    return ((out.stop_reason == "grammar_compile_failed" and not num_tokens_before)
            or out.stop_reason == GRAMMAR_OVER_BUDGET)


def _without_request_id(message: str, request_id: str) -> str:
    """An engine error without its ``request 'id' failed: `` / ``request 'id': `` prefixes:
    the engine's id of a choice (the HTTP id plus a suffix) is no business of the client."""
    return (message.removeprefix(f"request {request_id!r} failed: ")
            .removeprefix(f"request {request_id!r}: "))


def _param_of(message: str) -> str | None:
    """The field a SamplingParams error names (``invalid sampling value NAME=...``)."""
    head = "invalid sampling value "
    i = message.find(head)
    return message[i + len(head):].split("=", 1)[0] if i >= 0 else None


# -- answers -----------------------------------------------------------------------------
def usage(choices: Sequence[Choice], prompts: Sequence[list[int]]) -> dict[str, Any]:
    """OpenAI's usage object: each prompt counted once, every choice's output tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.text.output_token_ids) for c in choices)
    per_prompt = max(len(choices) // max(len(prompts), 1), 1)
    cached = sum(c.num_cached_tokens for c in choices[::per_prompt])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Generation:
    """One HTTP generation request in progress: its choices and their event queue."""

    def __init__(self, server: Server, kind: str, request_id: str, req: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], choices: list[Choice], arrival: float | None = None) -> None:
        self.server = server
        self.kind = kind  # "completion" or "chat"
        self.id = request_id
        self.req = req
        self.prompts = prompts
        self.choices = choices
        self.created = int(time.time())
        self.queue, self.tasks = server.start(choices, req, arrival)
        self.open = len(choices)
        self.pending: list[Event] = []

    async def next_event(self) -> Event | None:
        """The next event (None once every choice is done)."""
        if self.pending:
            return self.pending.pop(0)
        if not self.open:
            return None
        ev = await self.queue.get()
        if ev.done:
            self.open -= 1
        return ev

    async def first(self) -> None:
        """Wait for the first sign of life; raise its error if it is one (nothing is sent yet).

        Raises:
            APIError: The first event was a failure (a rejection, a refused request).
        """
        ev = await self.next_event()
        if ev is None:
            return
        if ev.error is not None:
            self.cancel()
            raise ev.error
        self.pending.append(ev)

    def cancel(self) -> None:
        """Abort the choices still running (their tasks close their engine streams)."""
        for task in self.tasks:
            task.cancel()

    # -- whole answers -------------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        texts = {c.index: "" for c in self.choices}
        ids: dict[int, list[int]] = {c.index: [] for c in self.choices}
        while (ev := await self.next_event()) is not None:
            if ev.error is not None:
                self.cancel()
                raise ev.error
            texts[ev.choice.index] += ev.text
            ids[ev.choice.index].extend(ev.token_ids)
        out = []
        for c in self.choices:
            item: dict[str, Any]
            if self.kind == "chat":
                item = {"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                        "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            else:
                item = {"index": c.index, "text": texts[c.index], "logprobs": None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                item["token_ids"] = ids[c.index]
                item["prompt_token_ids"] = c.prompt_token_ids
            out.append(item)
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": out,
                "usage": usage(self.choices, self.prompts)}

    # -- streams -------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage_obj: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
                "id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage_obj is not None or self._continuous:
            body["usage"] = usage_obj
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    @property
    def _continuous(self) -> bool:
        so = self.req.stream_options
        return so is not None and so.continuous_usage_stats

    def _ready_events(self) -> list[Event]:
        """Events already waiting (taken without blocking)."""
        out = []
        while self.pending:
            out.append(self.pending.pop(0))
        while self.open:
            try:
                ev = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if ev.done:
                self.open -= 1
            out.append(ev)
        return out

    @staticmethod
    def _merge(events: list[Event]) -> list[Event]:
        """One event per choice (in order of first appearance): a client that reads slower
        than the engine writes gets the deltas that piled up as one chunk, as vLLM's
        output collector merges them. An error is kept as it is and ends the list."""
        merged: dict[int, Event] = {}
        for ev in events:
            if ev.error is not None:
                return [*merged.values(), ev]
            m = merged.get(ev.choice.index)
            if m is None:
                merged[ev.choice.index] = Event(ev.choice, ev.text, list(ev.token_ids),
                                                ev.finish_reason, ev.stop_reason)
            else:
                m.text += ev.text
                m.token_ids.extend(ev.token_ids)
                if ev.finish_reason is not None and m.finish_reason is None:
                    m.finish_reason, m.stop_reason = ev.finish_reason, ev.stop_reason
        return list(merged.values())

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per choice delta, usage last when asked, [DONE]."""
        chat = self.kind == "chat"
        started: set[int] = set()
        ended: set[int] = set()
        try:
            while (first := await self.next_event()) is not None:
                chunks = []
                failed = False
                for ev in self._merge([first, *self._ready_events()]):
                    c = ev.choice
                    if ev.error is not None:
                        chunks.append(b"data: " + json.dumps(ev.error.body(), separators=(",", ":")).encode() + b"\n\n")
                        failed = True
                        break
                    if c.index in ended or not (ev.text or ev.token_ids or ev.finish_reason):
                        continue
                    if chat:
                        delta: dict[str, Any] = {}
                        if c.index not in started:
                            started.add(c.index)
                            delta["role"] = "assistant"
                        if ev.text or "role" in delta:
                            delta["content"] = ev.text
                        item: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None,
                                                "finish_reason": None}
                    else:
                        item = {"index": c.index, "text": ev.text, "logprobs": None, "finish_reason": None}
                    if ev.finish_reason is not None:
                        ended.add(c.index)
                        item["finish_reason"] = ev.finish_reason
                        item["stop_reason"] = ev.stop_reason
                    if self.req.return_token_ids:
                        item["token_ids"] = ev.token_ids
                    chunks.append(self._chunk([item], usage(self.choices, self.prompts)
                                              if self._continuous else None))
                if chunks:
                    yield b"".join(chunks)
                if failed:
                    self.cancel()
                    break
            else:
                so = self.req.stream_options
                if so is not None and so.include_usage:
                    yield self._chunk([], usage(self.choices, self.prompts))
            yield b"data: [DONE]\n\n"
        finally:
            self.cancel()
