"""The xgrammar structured-output backend: JSON schemas, any JSON object, regular
expressions, choices and EBNF grammars, compiled against the model's tokenizer.

This module imports torch and xgrammar; nothing imports it before the first structured
request (the built-in plugin imports it inside its hook).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xgrammar as xgr

from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.structured_output import GrammarBitmask, StructuredOutputBackend

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def _message(e: BaseException) -> str:
    """xgrammar's error text without the C++ log prefix (``[12:00:00] /path/x.cc:94: ``)."""
    return _LOG_PREFIX.sub("", str(e).strip())


def choice_ebnf(choices: Sequence[str]) -> str:
    """The EBNF grammar whose only sentences are ``choices``: ``root ::= "a" | "b"``.

    The literals are JSON string literals (xgrammar's EBNF reads the same escapes: ``\\"``,
    ``\\\\``, ``\\n``, ``\\uXXXX``), with non-ASCII characters written as themselves so
    that characters outside the BMP stay one code point."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend(StructuredOutputBackend):
    """Compiles every kind of constraint with xgrammar.

    Args:
        tokenizer: The model's transformers tokenizer.
        vocab_size: Width of the model's logits (the bitmask), at least the tokenizer's.
        max_threads: Threads xgrammar uses to compile one grammar.
        cache_limit_bytes: Memory xgrammar's own compiled-grammar cache may use (0, the
            default: no such cache, since the manager keeps the compiled grammars in a
            bounded LRU; -1: no limit).
        stop_token_ids: The tokens that end the output (default: xgrammar's reading of
            the tokenizer, its EOS).

    The rows it fills never allow the tokenizer's special tokens other than the stop
    tokens (xgrammar reads a token such as ``<pad>`` as its literal text) nor the ids past
    ``vocab_size`` in the row's last word.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_threads: int = 8,
                 cache_limit_bytes: int = 0, stop_token_ids: Sequence[int] | None = None,
                 json_max_whitespace: int | None = None) -> None:
        self.json_max_whitespace = json_max_whitespace
        """Most whitespace characters between two JSON tokens (None: no limit)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        kwargs: dict[str, Any] = {"vocab_size": vocab_size}
        if stop_token_ids is not None:
            kwargs["stop_token_ids"] = list(stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, **kwargs)
        self.max_threads = max_threads
        # The manager keeps the compiled grammars (an LRU of structured_outputs.cache_size);
        # xgrammar's own cache would keep every schema ever seen unless it is bounded.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                            cache_enabled=cache_limit_bytes != 0,
                                            cache_limit_bytes=cache_limit_bytes)
        stops = set(self.tokenizer_info.stop_token_ids)
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self.never_token_ids = frozenset(t for t in special if t not in stops and 0 <= t < vocab_size)
        """Tokens no grammar allows: the special tokens other than the stop tokens."""
        num_words = (vocab_size + 31) // 32
        keep = [0xFFFFFFFF] * num_words
        for t in [*self.never_token_ids, *range(vocab_size, num_words * 32)]:
            keep[t >> 5] &= ~(1 << (t & 31))
        self._keep: torch.Tensor | None = None
        if any(w != 0xFFFFFFFF for w in keep):
            self._keep = torch.tensor([w - (1 << 32) if w >> 31 else w for w in keep], dtype=torch.int32)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def validate(self, params: StructuredOutputsParams) -> None:
        check_constraint(params)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return compile_constraint(self.compiler, params, self.json_max_whitespace)

    def process_compiler(self) -> ProcessCompiler:
        """Compiles in worker processes: each rebuilds the tokenizer info from its JSON
        and returns compiled grammars as JSON (:meth:`load_compiled` reads them back)."""
        return ProcessCompiler(self.tokenizer_info.serialize_json(), self.json_max_whitespace,
                               self.max_threads)

    def load_compiled(self, payload: Any) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def new_grammar(self, compiled: Any, max_rollback_tokens: int) -> XGrammarGrammar:
        # xgrammar 0.2 rolls back any number of tokens (its max_rollback_tokens is deprecated)
        return XGrammarGrammar(xgr.GrammarMatcher(compiled), self)

    def bitmask_view(self, bitmask: GrammarBitmask) -> torch.Tensor:
        """``bitmask.words`` as an int32 tensor ``[num_rows, num_words]``, sharing its memory."""
        if bitmask.num_rows == 0 or bitmask.num_words == 0:
            return torch.empty((bitmask.num_rows, bitmask.num_words), dtype=torch.int32)
        return torch.frombuffer(bitmask.words, dtype=torch.int32).view(bitmask.num_rows,
                                                                        bitmask.num_words)

    def shutdown(self) -> None:
        self.compiler.clear_cache()


def check_constraint(params: StructuredOutputsParams) -> None:
    """Parse the constraint as xgrammar would; ValueError naming what is wrong (or what
    in a schema xgrammar would not enforce)."""
    kind = params.kind
    if kind == "json":
        problem = unenforced_json_schema_feature(json.loads(params.spec))
        if problem is not None:
            raise ValueError(problem)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(params.spec, any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice or ()))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(_message(e)) from None


def compile_constraint(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams,
                       json_max_whitespace: int | None) -> xgr.CompiledGrammar:
    """The constraint compiled by ``compiler``; ValueError with xgrammar's message."""
    kind = params.kind
    try:
        if kind == "json":
            return compiler.compile_json_schema(
                params.spec, any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=json_max_whitespace)
        if kind == "json_object":  # an object: xgrammar's builtin JSON grammar allows arrays too
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=json_max_whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(params.choice or ()))
        if kind == "grammar":
            return compiler.compile_grammar(params.spec)
    except RuntimeError as e:
        raise ValueError(_message(e)) from None
    raise ValueError(f"xgrammar backend: unknown constraint kind {kind!r}")


class ProcessCompiler:
    """The xgrammar backend's compiler for a worker process (picklable: the tokenizer
    info travels as JSON). Called once there, it returns the process's compile function:
    check, compile, and return the compiled grammar's JSON."""

    def __init__(self, tokenizer_info_json: str, json_max_whitespace: int | None, max_threads: int) -> None:
        self.tokenizer_info_json = tokenizer_info_json
        self.json_max_whitespace = json_max_whitespace
        self.max_threads = max_threads

    def __call__(self) -> Callable[[StructuredOutputsParams], str]:
        info = xgr.TokenizerInfo.deserialize_json(self.tokenizer_info_json)
        compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        json_max_whitespace = self.json_max_whitespace

        def compile_to_json(params: StructuredOutputsParams) -> str:
            check_constraint(params)
            return compile_constraint(compiler, params, json_max_whitespace).serialize_json()

        return compile_to_json


UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "dependentRequired",
                       "dependentSchemas")
"""JSON-schema keywords xgrammar 0.2.9 accepts but does not enforce (output that breaks
them would be served as "stop"): such schemas are refused."""


def unenforced_json_schema_feature(schema: Any, where: str = "schema") -> str | None:
    """What in ``schema`` xgrammar would silently not enforce, or None: the keywords of
    :data:`UNENFORCED_KEYWORDS`, ``uniqueItems: true``, a ``$ref`` outside the schema
    (a file or URL, which xgrammar replaces by "any value"), an ``allOf`` of branches of
    different types, and a ``required`` property that ``properties`` does not define
    (xgrammar never generates it)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_json_schema_feature(item, f"{where}[{i}]")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED_KEYWORDS:
        if key in schema:
            return f"{where}.{key} is not enforced by the xgrammar backend"
    if schema.get("uniqueItems") is True:
        return f"{where}.uniqueItems is not enforced by the xgrammar backend"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        # xgrammar warns and allows any value there: no file or URL is ever fetched
        return (f"{where}.$ref is {ref!r}: the xgrammar backend resolves only references "
                "inside the schema ('#' or '#/...')")
    branches = schema.get("allOf")
    if isinstance(branches, list):
        types = {json.dumps(b.get("type"), sort_keys=True) for b in branches if isinstance(b, dict) and "type" in b}
        if len(types) > 1:
            return f"{where}.allOf combines branches of different types, which the xgrammar backend does not enforce"
    props = schema.get("properties")
    required = schema.get("required")
    if isinstance(required, list) and (isinstance(props, dict) or schema.get("type") == "object"):
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:
            return (f"{where}.required names {missing[0]!r}, which {where}.properties does not define: "
                    "the xgrammar backend cannot generate it")
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            subs = [(f"{where}.{key}.{name}", sub) for name, sub in value.items()]  # names are no keywords
        elif key in ("enum", "const", "default", "examples", "required") or not isinstance(value, dict | list):
            continue
        else:
            subs = [(f"{where}.{key}", value)]
        for path, sub in subs:
            found = unenforced_json_schema_feature(sub, path)
            if found:
                return found
    return None


class XGrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar matcher."""

    def __init__(self, matcher: xgr.GrammarMatcher, backend: XGrammarBackend) -> None:
        self.matcher = matcher
        self.tokenizer = backend.tokenizer
        self.vocab_size = backend.vocab_size
        self._never = backend.never_token_ids
        self._keep = backend._keep
        self.num_accepted = 0

    def _accept(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size or token in self._never or self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        for token in tokens:
            if not self._accept(token):
                return False
            self.num_accepted += 1
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self._accept(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._keep is not None:
            bitmask[row].bitwise_and_(self._keep)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def jump_forward_tokens(self) -> list[int]:
        """The forced continuation (xgrammar's jump-forward string), tokenized, cut to the
        prefix the grammar accepts; the state is unchanged."""
        if self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return self.validate_tokens(tokens)
