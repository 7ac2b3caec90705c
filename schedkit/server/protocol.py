"""OpenAI request bodies and error objects, validated field by field.

Every field of the OpenAI completions and chat APIs a client library sends is known
here. The ones schedkit implements are typed and range-checked; the ones it does not
(penalties, logit bias, tools...) are accepted only at their neutral value, so a request
that relies on them is answered 400 naming the field instead of being served wrongly.
A field no API has is a 400 too. Types are strict: ``"5"`` is not a number and ``true``
is not an integer.

Structured outputs come as OpenAI's ``response_format`` (``json_object``, ``json_schema``)
or as vLLM's ``structured_outputs`` object; :meth:`_Sampling.structured_outputs_params`
turns either into the engine's :class:`StructuredOutputsParams` (``parse_body`` checks it,
so a malformed constraint is a 400 naming its field). Whether a schema, pattern or grammar
compiles is the engine's to say when it receives the request.
"""

from __future__ import annotations

import functools
import re
import typing
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    create_model,
)

from schedkit.config.workload import SLO_CLASS_NAME
from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.hints import (
    MAX_DEADLINE_S,
    MAX_EXPECTED_OUTPUT_TOKENS,
    MAX_SESSION_ID_CHARS,
    RequestHints,
)
from schedkit.errors import RequestError

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]
_LINE_BREAKING = frozenset({"Cc", "Zl", "Zp"})
"""Unicode categories of the control characters (C0, DEL, C1: NEL among them) and the
line and paragraph separators: each ends a line for ``str.splitlines`` and many log tools."""


def _no_control_characters(value: str) -> str:
    if not value.isprintable() and any(unicodedata.category(c) in _LINE_BREAKING for c in value):
        raise ValueError("must not contain control characters or line separators")
    return value


def _printable(value: str) -> str:
    """The engine's rule for a session id (:meth:`RequestHints.check`), checked here so
    the 400 names the field."""
    if not value.isprintable():
        raise ValueError("must be printable text: no control characters, format characters or "
                         "separators other than the space")
    return value


LabelStr = Annotated[StrictStr, StringConstraints(max_length=256), AfterValidator(_no_control_characters)]
"""Text that becomes a metric label or a log field: no control characters or line
separators (a NUL in a tenant made ``/metrics`` a binary file to grep; a NEL or U+2028
splits its line for ``str.splitlines``)."""


class APIError(Exception):
    """An answer other than 200, with OpenAI's error object as its body.

    Args:
        status: HTTP status.
        message: What was wrong, naming the field or limit.
        param: The offending request field, where there is one.
        headers: Extra response headers (``Retry-After``).
    """

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             408: "RequestTimeoutError", 413: "RequestTooLargeError", 414: "URITooLongError",
             429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: a named JSON schema."""

    name: StrictStr
    schema_: dict[str, Any] = Field(alias="schema")
    """The JSON schema the output must match (``schema`` on the wire)."""
    description: StrictStr | None = None
    strict: StrictBool | None = None
    """Accepted and not needed: the schema is always enforced."""


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` extra field: :class:`StructuredOutputsParams`'
    fields (exactly one constraint; ``null`` is unset)."""

    json_: StrictStr | dict[str, Any] | None = Field(default=None, alias="json")
    """A JSON schema, as an object or as JSON text (``json`` on the wire)."""
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool | None = None

    def fields(self) -> dict[str, Any]:
        """The fields the client set, by :class:`StructuredOutputsParams`' names."""
        values = {"json": self.json_, "json_object": self.json_object, "regex": self.regex,
                  "choice": self.choice, "grammar": self.grammar,
                  "disable_any_whitespace": self.disable_any_whitespace}
        return {k: v for k, v in values.items() if v is not None}


class _Sampling(_Body):
    """Fields the completions and chat APIs share."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1)
    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False
    """vLLM's extension: ``prompt_token_ids`` and each choice's ``token_ids``."""
    # schedkit's policy fields
    user: LabelStr | None = None
    """The tenant: what fairness policies (``vtc``) share service by."""
    priority: StrictInt = Field(default=0, ge=-(2**63), le=2**63 - 1)
    """vLLM's priority: smaller is served first under the ``priority`` policy."""
    ttft_slo_s: FiniteFloat | None = Field(default=None, gt=0)
    """This request's time-to-first-token target (``edf``, admission plugins)."""
    session_id: Annotated[StrictStr, StringConstraints(min_length=1, max_length=MAX_SESSION_ID_CHARS),
                          AfterValidator(_printable)] | None = None
    """A conversation id: with replicas, ``session-affinity`` keeps a session on one
    replica (its history stays in that replica's prefix cache)."""
    slo_class: Annotated[StrictStr, StringConstraints(pattern=f"^{SLO_CLASS_NAME.pattern}$")] | None = None
    """A service class of the config's ``slo_classes``: the request's TTFT and TPOT targets."""
    deadline_s: FiniteFloat | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    """Seconds after its arrival by which the whole answer should be there."""
    expected_output_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_EXPECTED_OUTPUT_TOKENS)
    """The client's prediction of the answer's length (size-aware policies may use it)."""
    # structured outputs
    response_format: ResponseFormat | None = None
    """OpenAI's: ``text`` (no constraint), ``json_object``, or ``json_schema``."""
    structured_outputs: StructuredOutputsBody | None = None
    """vLLM's: a JSON schema, any JSON object, a regex, a choice or an EBNF grammar."""
    _constraint: StructuredOutputsParams | None = PrivateAttr(default=None)
    # accepted only at their neutral value
    frequency_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    min_p: FiniteFloat | None = None
    logit_bias: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def structured_outputs_field(self) -> str | None:
        """The field this request's output constraint came from (``response_format`` or
        ``structured_outputs``), None when it has none."""
        rf = self.response_format
        if rf is not None and rf.type != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs is not None else None

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The constraint :func:`parse_body` built (:meth:`structured_outputs_params`)."""
        return self._constraint

    def hints(self) -> RequestHints:
        """The request's hints (SLO class, deadline, expected length, session)."""
        return RequestHints(self.slo_class, self.deadline_s, self.expected_output_tokens, self.session_id)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint on the output, from ``response_format`` or ``structured_outputs``
        (None without one; ``response_format: {"type": "text"}`` is none).

        Raises:
            APIError: 400 naming the field: both fields constrain the output, a
                ``json_schema`` format without its schema, or a malformed constraint.
        """
        rf, so = self.response_format, self.structured_outputs
        if rf is not None:
            if rf.type == "json_schema" and rf.json_schema is None:
                raise APIError(400, "response_format.json_schema is required when response_format.type "
                               "is 'json_schema'", param="response_format.json_schema")
            if rf.type != "json_schema" and rf.json_schema is not None:
                raise APIError(400, f"response_format.json_schema is only read with response_format.type "
                               f"'json_schema', not {rf.type!r}", param="response_format.json_schema")
        if rf is not None and rf.type != "text":
            if so is not None:
                raise APIError(400, f"response_format (type {rf.type!r}) and structured_outputs both "
                               "constrain the output; send one of them", param="response_format")
            if rf.json_schema is None:  # json_object
                return StructuredOutputsParams(json_object=True)
            try:
                return StructuredOutputsParams(json=rf.json_schema.schema_)
            except RequestError as e:  # a schema with NaN or Infinity in it
                where = "response_format.json_schema.schema"
                raise APIError(400, str(e).replace("structured_outputs.json", where, 1), param=where) from None
            except RecursionError:
                raise APIError(400, "response_format.json_schema.schema is nested too deeply",
                               param="response_format.json_schema.schema") from None
        if so is None:
            return None
        try:
            return StructuredOutputsParams(**so.fields())
        except RequestError as e:
            message = str(e)
            head = "invalid structured_outputs."
            i = message.find(head)
            param = ("structured_outputs." + message[i + len(head):].split("=", 1)[0] if i >= 0
                     else "structured_outputs")
            raise APIError(400, message, param=param) from None
        except RecursionError:
            raise APIError(400, "structured_outputs.json is nested too deeply",
                           param="structured_outputs.json") from None


_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "repetition_penalty": (1.0,),
    "min_p": (0.0,), "logit_bias": ({},),
    "best_of": (1,), "suffix": ("",), "echo": (False,), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
}
"""OpenAI fields schedkit does not implement, and the values that ask nothing of them."""


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this (possibly batched) request, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(part.text for part in c)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[TokenId]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_path(loc: list[Any]) -> str | None:
    """A pydantic location as OpenAI writes a param: ``messages[0].content[1].type``."""
    path = ""
    for x in loc:
        path += f"[{x}]" if isinstance(x, int) else f".{x}" if path else str(x)
    return path or None


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body against ``model``.

    Raises:
        APIError: 400 naming the first field that is wrong and why.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        # Of a union's failures, the deepest names the element that is wrong.
        errors = [(err, [x for x in err["loc"] if not _is_union_tag(x)])
                  for err in e.errors(include_url=False)]
        err, loc = max(errors, key=lambda el: len(el[1]))
        param = _field_path(loc)
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field {param!r}", param=param) from None
        if err["type"] == "missing":
            raise APIError(400, f"{param} is required", param=param) from None
        why = err["msg"].removeprefix("Value error, ")  # our validators' own words
        raise APIError(400, f"{param}: {why} (got {_describe(err.get('input'))})",
                       param=param) from None
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name, None)
        if value is not None and value not in neutral:
            allowed = " or ".join(repr(v) for v in neutral)
            raise APIError(400, f"{name}={_describe(value)} is not supported by schedkit "
                           f"(leave it unset, or send {allowed})", param=name)
    if isinstance(req, _Sampling):
        req._constraint = req.structured_outputs_params()  # a malformed one is a 400 before any work
    return req


def _is_union_tag(x: Any) -> bool:
    """Pydantic puts the union member's name in an error's location: not a field."""
    return isinstance(x, str) and (x.startswith(("list[", "dict[", "function-")) or x in (
        "str", "int", "float", "bool", "none", "ContentPart", "StreamOptions"))



HINT_HEADERS = {
    "x-schedkit-tenant": "user",
    "x-schedkit-priority": "priority",
    "x-schedkit-slo-class": "slo_class",
    "x-schedkit-deadline-s": "deadline_s",
    "x-schedkit-expected-output-tokens": "expected_output_tokens",
    "x-schedkit-ttft-slo-s": "ttft_slo_s",
    "x-schedkit-session-id": "session_id",
}
"""Headers that carry a request's scheduling hints (``header -> body field``): for a
gateway or proxy that tags requests without touching their bodies."""
_NUMERIC_HINTS = {"priority": int, "deadline_s": float, "expected_output_tokens": int, "ttft_slo_s": float}
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A header's number: ASCII digits, an optional sign, point and exponent (Python's
``int`` and ``float`` also take ``1_000``, ``infinity`` or digits of other scripts)."""


def _header_value(headers: Any, header: str) -> str | None:
    """The value of hint ``header``, None when absent.

    Raises:
        APIError: 400 when it comes more than once with different values, or is not
            UTF-8 text (the server decodes header bytes as Latin-1).
    """
    values = headers.getlist(header)
    if not values:
        return None
    if len(set(values)) > 1:
        raise APIError(400, f"header {header} is sent {len(values)} times with different values "
                       f"({', '.join(_describe(v.strip()) for v in values[:4])}): send it once", param=header)
    try:
        return str(values[0]).encode("latin-1").decode("utf-8").strip(" \t")  # HTTP's whitespace only
    except UnicodeError:
        raise APIError(400, f"header {header}: not UTF-8 text (got {_describe(values[0])})",
                       param=header) from None


def apply_hint_headers(req: Any, headers: Any) -> None:
    """Set ``req``'s hint fields from the :data:`HINT_HEADERS` present, validated as the
    body fields are. A body field sent as ``null`` counts as not sent.

    Raises:
        APIError: 400 naming the header: a value the body field would refuse, a header
            sent twice with different values, or a header and a body field that both set
            a hint to different values.
    """
    if not isinstance(req, _Sampling):
        return
    fields_set = req.model_fields_set
    for header, name in HINT_HEADERS.items():
        value: Any = _header_value(headers, header)
        if value is None:
            continue
        convert = _NUMERIC_HINTS.get(name)
        if convert is not None:
            if not (_INTEGER if convert is int else _NUMBER).fullmatch(value):
                raise APIError(400, f"header {header}: {_describe(value)} is not "
                               f"{'an integer' if convert is int else 'a number'}", param=header)
            try:
                value = convert(value)
            except ValueError:  # more digits than Python converts
                raise APIError(400, f"header {header}: {_describe(value)} has too many digits",
                               param=header) from None
        try:
            value = getattr(_hint_model().model_validate({name: value}), name)
        except ValidationError as e:
            why = e.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
            raise APIError(400, f"header {header}: {why} (got {_describe(value)})", param=header) from None
        sent = getattr(req, name)
        if name in fields_set and sent is not None and sent != value:
            raise APIError(400, f"header {header} ({_describe(value)}) and body field {name} "
                           f"({_describe(sent)}) differ: send one", param=header)
        object.__setattr__(req, name, value)


@functools.cache
def _hint_model() -> type[BaseModel]:
    """A model of the hint fields alone, each validated as in a request body (the full
    annotations, constraints included, and the same field settings)."""
    hints = typing.get_type_hints(_Sampling, include_extras=True)
    fields = {name: (hints[name], _Sampling.model_fields[name]) for name in HINT_HEADERS.values()}
    return create_model("HintHeaders", **fields)  # type: ignore[call-overload, no-any-return]
