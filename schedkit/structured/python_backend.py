"""A small structured-output backend in pure Python: regular expressions and choices.

It needs no torch and no grammar library, only the third-party ``regex`` module (which
transformers already depends on), whose partial matching says whether a text can still
become a match. The grammar state of a request is the text it has produced so far; the
tokens allowed next are those whose text keeps it a (partial) match, and the stop tokens
once it is a complete match. It is meant for tests, the fake runner and small
vocabularies: a step costs up to one match per vocabulary token for each new state (the
rows are cached by state), which is slow for 100k-token vocabularies. Use xgrammar for
JSON schemas, EBNF grammars and speed.

Tokens are matched as text, so a token whose text is not a whole sequence of characters
(a byte-level BPE piece of a multi-byte character) is never allowed: the backend cannot
produce the characters that only such pieces spell.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.structured_output import (
    DEFAULT_STEP_BUDGET_MS,
    GrammarBitmask,
    StructuredOutputBackend,
)

SUPPORTED_KINDS = ("regex", "choice")
_SPIECE_SPACE = "\u2581"  # SentencePiece's word-start marker
_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence produces


def _regex_module() -> Any:
    try:
        import regex
    except ImportError as e:
        raise ImportError("the python structured-output backend needs the 'regex' package "
                          "(pip install regex; transformers installs it)") from e
    return regex


def choice_pattern(choices: Iterable[str]) -> str:
    """The regular expression matching exactly one of ``choices``."""
    regex = _regex_module()
    return "|".join(regex.escape(c) for c in choices)


class CompiledPattern:
    """A compiled constraint of the python backend: the pattern every output must match.

    Attributes:
        source: The regular expression (a choice is the alternation of its escaped strings).
        pattern: ``source`` compiled by the ``regex`` module.
    """

    __slots__ = ("source", "pattern")

    def __init__(self, source: str, pattern: Any) -> None:
        self.source = source
        self.pattern = pattern

    def __repr__(self) -> str:
        return f"CompiledPattern({self.source!r})"


class _Row:
    """The allowed tokens of one state: the bitmask row and, for jump-forward, the only
    allowed token when there is exactly one."""

    __slots__ = ("words", "count", "only")

    def __init__(self, words: array, count: int, only: int | None) -> None:
        self.words = words
        self.count = count
        self.only = only


class PythonBackend(StructuredOutputBackend):
    """Regex and choice constraints, matched with the ``regex`` module.

    Args:
        token_strings: The text of each token id; None for a token that is never allowed
            (special tokens, pieces that are not whole characters). Stop tokens' entries
            are ignored.
        stop_token_ids: Tokens that end the output; allowed exactly when the text so far is
            a complete match.
        vocab_size: Width of the bitmask (default ``len(token_strings)``); ids from
            ``len(token_strings)`` up are never allowed.
        cache_size: Bitmask rows kept, by (pattern, text so far), least recently used
            dropped first.
        max_jump_forward: The most tokens :meth:`jump_forward_tokens` returns at once.

    Raises:
        ImportError: The ``regex`` module is not installed.
        ValueError: ``vocab_size`` is smaller than the vocabulary or a stop token is
            outside it.
    """

    name = "python"

    def __init__(self, token_strings: Sequence[str | None], stop_token_ids: Iterable[int],
                 vocab_size: int | None = None, *, cache_size: int = 1024,
                 max_jump_forward: int = 64) -> None:
        self._regex = _regex_module()
        n = len(token_strings)
        self.vocab_size = n if vocab_size is None else vocab_size
        if self.vocab_size < n or self.vocab_size < 1:
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the vocabulary ({n} "
                             "tokens)" if self.vocab_size < n else "vocab_size must be >= 1")
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        bad = [t for t in self.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop tokens {bad} are outside the vocabulary (size {self.vocab_size})")
        self.num_words = (self.vocab_size + 31) // 32
        stops = set(self.stop_token_ids)
        self._text: list[str | None] = [None] * self.vocab_size
        by_first: dict[str, list[tuple[int, str]]] = {}
        for tid, text in enumerate(token_strings):
            if tid in stops or not text:  # None, or "" (it would never make progress)
                continue
            self._text[tid] = text
            by_first.setdefault(text[0], []).append((tid, text))
        self._by_first = list(by_first.items())
        stop_words = [0] * self.num_words
        for t in self.stop_token_ids:
            stop_words[t >> 5] |= 1 << (t & 31)
        self._stop_words = stop_words
        self._stops = frozenset(stops)
        self._rows: OrderedDict[tuple[str, str], _Row] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.max_jump_forward = max_jump_forward

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None, *,
                       stop_token_ids: Iterable[int] | None = None, **kwargs: Any) -> PythonBackend:
        """The backend for a transformers tokenizer: each token's text as it reads inside
        a longer text (byte-level BPE's ``Ġ`` and SentencePiece's ``▁`` become spaces);
        special tokens other than the stop tokens, and pieces that are not whole
        characters, are never allowed. The stop tokens are ``stop_token_ids``, by default
        the tokenizer's ``eos_token_id``; ``kwargs`` go to the constructor."""
        strings = token_strings_of(tokenizer, vocab_size)
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [eos] if isinstance(eos, int) else []
        return cls(strings, stop_token_ids, vocab_size if vocab_size is not None else len(strings),
                   **kwargs)

    # -- the backend interface -----------------------------------------------------------
    def default_step_budget_ms(self) -> float:
        """2 ms per 1,000 tokens of vocabulary, at least the common default: a new state
        tries every token (a permissive pattern over 49,152 tokens: about 50 ms)."""
        return max(DEFAULT_STEP_BUDGET_MS, 2.0 * self.vocab_size / 1000)

    def validate(self, params: StructuredOutputsParams) -> None:
        self._pattern(params)

    def compile(self, params: StructuredOutputsParams) -> CompiledPattern:
        return self._pattern(params)

    def _pattern(self, params: StructuredOutputsParams) -> CompiledPattern:
        kind = params.kind
        if kind == "regex":
            assert params.regex is not None
            source = params.regex
        elif kind == "choice":
            source = choice_pattern(params.choice or ())
        else:
            raise ValueError(f"the python backend supports regex and choice; use xgrammar for "
                             f"{kind.replace('_', ' ')} constraints "
                             "(structured_outputs.backend: xgrammar, pip install 'schedkit[paged]')")
        try:
            return CompiledPattern(source, self._regex.compile(source))
        except self._regex.error as e:
            raise ValueError(f"invalid regular expression: {e}") from None

    def new_grammar(self, compiled: Any, max_rollback_tokens: int) -> PythonGrammar:
        if not isinstance(compiled, CompiledPattern):
            raise TypeError(f"the python backend cannot use {type(compiled).__name__} as a grammar")
        return PythonGrammar(self, compiled, max_rollback_tokens)

    # -- for the grammars ----------------------------------------------------------------
    def token_text(self, token: int) -> str | None:
        """The text of ``token``, or None when it is never allowed (stop tokens too)."""
        return self._text[token] if 0 <= token < self.vocab_size else None

    def is_stop(self, token: int) -> bool:
        return token in self._stops

    def row(self, compiled: CompiledPattern, text: str) -> _Row:
        """The allowed tokens after ``text`` (cached)."""
        key = (compiled.source, text)
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._rows.move_to_end(key)
                return row
        row = self._scan(compiled.pattern, text)
        with self._lock:
            self._rows[key] = row
            while len(self._rows) > self._cache_size:
                self._rows.popitem(last=False)
        return row

    def _scan(self, pattern: Any, text: str) -> _Row:
        fullmatch = pattern.fullmatch
        words = [0] * self.num_words
        count = 0
        only: int | None = None
        for first, group in self._by_first:
            if fullmatch(text + first, partial=True) is None:
                continue  # no token starting with this character can follow
            for tid, s in group:
                if len(s) == 1 or fullmatch(text + s, partial=True) is not None:
                    words[tid >> 5] |= 1 << (tid & 31)
                    count += 1
                    only = tid
        if fullmatch(text) is not None:
            for i, w in enumerate(self._stop_words):
                words[i] |= w
            count += len(self.stop_token_ids)
            only = self.stop_token_ids[0] if self.stop_token_ids else only
        unsigned = array("I", words)
        signed = array("i")
        signed.frombytes(unsigned.tobytes())
        return _Row(signed, count, only if count == 1 else None)

    def matches(self, compiled: CompiledPattern, text: str, *, complete: bool) -> bool:
        """Whether ``text`` is a complete match (``complete``) or can still become one."""
        if complete:
            return compiled.pattern.fullmatch(text) is not None
        return compiled.pattern.fullmatch(text, partial=True) is not None

    def clear_cache(self) -> None:
        with self._lock:
            self._rows.clear()

    def shutdown(self) -> None:
        self.clear_cache()


class PythonGrammar(StructuredOutputGrammar):
    """The matcher of one request under the python backend: the text accepted so far and
    the stack of tokens that produced it. Every accepted token can be rolled back (like
    xgrammar's matcher, ``max_rollback_tokens`` is a floor, not a limit)."""

    def __init__(self, backend: PythonBackend, compiled: CompiledPattern, max_rollback_tokens: int) -> None:
        self.backend = backend
        self.compiled = compiled
        self.max_rollback_tokens = max_rollback_tokens
        self.text = ""
        self._history: list[tuple[int, int]] = []  # (token, length of text before it)
        self._terminated = False
        self.num_accepted = 0

    def _step(self, text: str, terminated: bool, token: int) -> tuple[str, bool] | None:
        """The state after ``token``, or None when the grammar rejects it."""
        if terminated:
            return None
        backend = self.backend
        if backend.is_stop(token):
            return (text, True) if backend.matches(self.compiled, text, complete=True) else None
        piece = backend.token_text(token)
        if piece is None:
            return None
        new = text + piece
        return (new, False) if backend.matches(self.compiled, new, complete=False) else None

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        for token in tokens:
            state = self._step(self.text, self._terminated, token)
            if state is None:
                return False
            self._history.append((token, len(self.text)))
            self.text, self._terminated = state
            self.num_accepted += 1
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        text, terminated = self.text, self._terminated
        out: list[int] = []
        for token in tokens:
            state = self._step(text, terminated, token)
            if state is None:
                break
            text, terminated = state
            out.append(token)
        return out

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only "
                             f"{len(self._history)} were accepted")
        _, length = self._history[-num_tokens]
        del self._history[-num_tokens:]
        self.text = self.text[:length]
        self._terminated = False
        self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        assert isinstance(bitmask, GrammarBitmask)
        nw = bitmask.num_words
        start = row * nw
        if self._terminated:
            bitmask.words[start:start + nw] = array("i", bytes(4 * nw))
            return
        words = self.backend.row(self.compiled, self.text).words
        if len(words) == nw:
            bitmask.words[start:start + nw] = words
        else:  # a bitmask wider than the backend's vocabulary: the rest is never allowed
            m = min(nw, len(words))
            bitmask.words[start:start + nw] = words[:m] + array("i", bytes(4 * (nw - m)))

    def is_terminated(self) -> bool:
        return self._terminated

    def jump_forward_tokens(self) -> list[int]:
        """The tokens forced while exactly one token is allowed at a time (up to the stop
        token, which is left to be sampled); the state is unchanged."""
        if self._terminated:
            return []
        text = self.text
        out: list[int] = []
        backend = self.backend
        while len(out) < backend.max_jump_forward:
            only = backend.row(self.compiled, text).only
            if only is None or backend.is_stop(only):
                break
            piece = backend.token_text(only)
            assert piece is not None
            text += piece
            out.append(only)
        return out


def token_strings_of(tokenizer: Any, vocab_size: int | None = None) -> list[str | None]:
    """Each token's text in the middle of a longer text, by id: None for special tokens
    (EOS included: it is the stop token) and for pieces that are not whole characters.
    Covers ``min(len(tokenizer), vocab_size)`` ids."""
    n = len(tokenizer)
    if vocab_size is not None:
        n = min(n, vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    to_string = tokenizer.convert_tokens_to_string
    out: list[str | None] = []
    for tid, piece in enumerate(pieces):
        if tid in special or piece is None:
            out.append(None)
            continue
        out.append(_piece_text(piece, to_string))
    return out


def _piece_text(piece: str, to_string: Any) -> str | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
        try:
            byte = int(piece[3:5], 16)
        except ValueError:
            byte = -1
        if 0 <= byte < 0x80:
            return chr(byte)
        if byte >= 0x80:
            return None  # one byte of a multi-byte character
    try:
        text = to_string([piece])
    except Exception:  # a tokenizer that cannot decode one piece alone
        return None
    if not isinstance(text, str):
        return None
    if piece.startswith(_SPIECE_SPACE) and not text.startswith((" ", _SPIECE_SPACE)):
        text = " " + text  # SentencePiece drops the space of a text's first word
    if not text or (_REPLACEMENT in text and _REPLACEMENT not in piece):
        return None  # decodes to nothing, or is an incomplete UTF-8 sequence
    return text
