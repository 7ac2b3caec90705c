"""Structured-output constraints of a request, and the grammar state that enforces them.

:class:`StructuredOutputsParams` is what a client asks for (vLLM's name and fields): a
JSON schema, any JSON object, a regular expression, a choice among strings, or an EBNF
grammar. A backend (``core/structured_output.py``) compiles it into a grammar; each
request then owns a :class:`StructuredOutputGrammar`, a matcher that follows the tokens
the request produced and says which tokens may come next.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint kinds, in the order :attr:`StructuredOutputsParams.kind` checks them."""


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (exactly one field set). Validated at
    construction; a malformed schema or pattern is found when the backend checks it
    (:meth:`StructuredOutputBackend.validate`, when the engine receives the request).

    Args:
        json: A JSON schema, as a dict or as JSON text (kept as compact JSON text, its
            keys in their order: the output follows the order of the properties).
        json_object: Any JSON object (OpenAI's ``response_format: json_object``).
        regex: A regular expression the whole output must match.
        choice: The output is exactly one of these strings.
        grammar: An EBNF grammar (the GBNF dialect of llama.cpp and xgrammar, rule
            ``root`` first).
        disable_any_whitespace: JSON without free whitespace between tokens (compact).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"invalid structured_outputs.{name}={_short(getattr(self, name))}: {why}")

        schema = self.json
        if schema is not None:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise bad("json", f"not JSON text ({e})") from None
            if not isinstance(schema, dict | bool):
                raise bad("json", "must be a JSON schema: an object (dict) or a boolean")
            try:
                text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept
            except (TypeError, ValueError) as e:
                raise bad("json", f"not serializable as JSON ({e})") from None
            object.__setattr__(self, "json", text)
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex", "must be a string")  # "" is a pattern: the empty output
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar", "must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, str | bytes) or not isinstance(choice, Sequence) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        chosen = [k for k in KINDS if _is_set(getattr(self, k))]
        if len(chosen) != 1:
            raise RequestError("structured_outputs must set exactly one of "
                               f"{', '.join(KINDS)}; got {', '.join(chosen) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint: one of :data:`KINDS`."""
        return next(k for k in KINDS if _is_set(getattr(self, k)))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema (canonical JSON), the pattern, the grammar,
        the choices as a JSON list, or "" for any JSON object."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        """What a compiled grammar is cached by: equal keys compile to equal grammars."""
        return self.kind, self.spec, self.disable_any_whitespace

    def describe(self) -> str:
        """``kind`` and the start of its text, for error messages."""
        spec = self.spec
        return f"{self.kind.replace('_', ' ')} {_short(spec)}" if spec else self.kind.replace("_", " ")


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StructuredOutputGrammar(ABC):
    """The matcher of one request: the state of its grammar after the tokens accepted so
    far. Used from the engine-core thread only."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens`` (in order). Returns False, at the first token the
        grammar rejects, leaving the state at the tokens before it."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts from here; the state is
        unchanged."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into ``row`` of the bitmask (bit ``t % 32`` of
        word ``t // 32`` set when token ``t`` is allowed); ``bitmask`` is the backend's
        :meth:`StructuredOutputBackend.bitmask_view` of a :class:`GrammarBitmask`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar reached its end (it accepted a stop token): the request
        finishes with "stop"."""

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (the only continuation it allows), for
        jump-forward decoding; [] when the next token is a real choice. The default
        never jumps."""
        return []


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    """A request's structured-output state, kept on ``Request.structured_output``."""

    params: StructuredOutputsParams
    compiled: Any = None
    """The future of its compiled grammar (set by the manager when the request is added)."""
    grammar: StructuredOutputGrammar | None = None
    """Its matcher, once the grammar compiled (the request then leaves WAITING_FOR_FSM)."""
    error: str | None = None
    """Why the grammar did not compile (the request then finishes with an error)."""
    jump_forward: list[int] = field(default_factory=list)
    """Tokens appended by jump-forward decoding that the runner has not computed yet."""
    budget: Any = None
    """Its per-step budget of matcher work (a ``StepBudget``, set with its matcher)."""
    matcher_s: float = 0.0
    """Seconds its matcher spent accepting tokens since its last bitmask fill."""
