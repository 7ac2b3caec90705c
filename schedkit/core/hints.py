"""What a client tells the scheduler about a request beyond its tokens: its SLO class,
a deadline, how long it expects the answer to be, the conversation it belongs to.

Hints travel with the request from the front door (OpenAI body fields or
``x-schedkit-*`` headers, :meth:`schedkit.llm.AsyncLLM.generate`) over the wire to the
engine, where every hook sees them as ``request.hints``; the router's hooks see them on
``RouteRequest.hints``. They are advice: the bundled policies that read one say so, and
nothing in the mechanism depends on them. Tenant and priority are hints too, but older
than this module, and stay the request's own fields (``request.tenant``,
``request.priority``).

An SLO class is a name from the config's ``slo_classes`` (YAML) with TTFT and TPOT
targets; the engine fills ``request.ttft_slo_s`` and ``request.tpot_slo_s`` from it
where the request did not set them, and refuses a class the config does not name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from schedkit.config.workload import SLO_CLASS_NAME
from schedkit.errors import RequestError

__all__ = ["MAX_DEADLINE_S", "MAX_EXPECTED_OUTPUT_TOKENS", "NO_HINTS", "RequestHints", "hints_from_wire"]

MAX_DEADLINE_S = 7 * 86400.0
"""The longest deadline a request may carry (a week)."""
MAX_EXPECTED_OUTPUT_TOKENS = 2**31 - 1
MAX_SESSION_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class RequestHints:
    """A request's hints (every field optional).

    Attributes:
        slo_class: A name from the config's ``slo_classes``: the request's TTFT and TPOT
            targets, and the class its attainment is counted under.
        deadline_s: Seconds after its arrival by which the request should have finished
            (its whole answer): a deadline policy's input.
        expected_output_tokens: The client's prediction of the answer's length (agent
            frameworks know it); size-based policies may read it instead of
            ``max_tokens``.
        session_id: The conversation (or agent session) it belongs to: the router keeps a
            session on one replica (``session-affinity``).
    """

    slo_class: str | None = None
    deadline_s: float | None = None
    expected_output_tokens: int | None = None
    session_id: str | None = None

    def check(self, request_id: str) -> RequestHints:
        """Return ``self`` after checking each field's type and range.

        Raises:
            RequestError: Naming the field and the value that is wrong.
        """
        def bad(name: str, what: str) -> RequestError:
            return RequestError(f"request {request_id!r}: {name} must be {what}, got "
                                f"{getattr(self, name)!r}", request_id=request_id)

        if self.slo_class is not None and not (isinstance(self.slo_class, str) and SLO_CLASS_NAME.fullmatch(self.slo_class)):
            raise bad("slo_class", "a name of 1-64 letters, digits, '_', '.', ':' or '-'")
        d = self.deadline_s
        if d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool)
                                  and 0.0 < d <= MAX_DEADLINE_S and math.isfinite(d)):
            raise bad("deadline_s", f"a number of seconds > 0 and at most {MAX_DEADLINE_S:g}")
        n = self.expected_output_tokens
        if n is not None and not (type(n) is int and 0 <= n <= MAX_EXPECTED_OUTPUT_TOKENS):
            raise bad("expected_output_tokens", "a whole number of tokens >= 0")
        s = self.session_id
        if s is not None and not (isinstance(s, str) and 0 < len(s) <= MAX_SESSION_ID_CHARS
                                  and s.isprintable()):
            raise bad("session_id", f"a printable string of 1-{MAX_SESSION_ID_CHARS} characters")
        return self

    def to_wire(self) -> dict[str, Any]:
        """The fields that are set (the wire form)."""
        return {k: v for k in self.__slots__ if (v := getattr(self, k)) is not None}

    def __bool__(self) -> bool:
        return any(getattr(self, k) is not None for k in self.__slots__)


NO_HINTS = RequestHints()


def hints_from_wire(fields: Any, request_id: str) -> RequestHints:
    """Rebuild (and check) hints from their wire form (:meth:`RequestHints.to_wire`).

    Raises:
        RequestError: Not a map, an unknown field, or a field of the wrong type or range.
    """
    if not fields:
        return NO_HINTS
    if not isinstance(fields, dict):
        raise RequestError(f"request {request_id!r}: hints must be a map of hint names to values, "
                           f"got {fields!r}", request_id=request_id)
    unknown = sorted(str(k) for k in fields if k not in RequestHints.__slots__)
    if unknown:
        raise RequestError(f"request {request_id!r}: unknown hints {unknown}; known: "
                           f"{', '.join(RequestHints.__slots__)}", request_id=request_id)
    return RequestHints(**fields).check(request_id)
