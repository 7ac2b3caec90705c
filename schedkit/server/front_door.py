"""The HTTP front door: what a connection may send before the app sees a request.

uvicorn's httptools protocol has no limit of its own on a request's line and headers,
and no timeout for a client that never finishes them. Both grow by ``bytes +=``, one
copy of everything so far per read: the request target in uvicorn's ``on_url``, a
header's value inside httptools (``_current_header_value += val``). A 48 MB request
line was some 750 reads, each copying all before it; the memory grew by as much, and
the event loop stalled for seconds, before authentication could refuse anyone.

:class:`FrontDoorProtocol` is uvicorn's protocol with the head bounded. While a request's
line and headers are arriving it hands the parser at most the bytes the limits leave
(so nothing ever holds more than that), keeps the target in a ``bytearray`` (linear),
counts the headers, and times the head from its first byte (or from the connection's
opening). A request over a limit is answered with OpenAI's error object, 414 (target) or
431 (headers), 408 when too slow, and its connection closed. Bodies are parsed as
uvicorn parses them; the app bounds their size and time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from schedkit.config import ServerConfig
from schedkit.server.protocol import APIError

HEAD_SLACK_BYTES = 1024
"""Bytes of a request head beyond its target and headers: the method, the version, line
ends, the ``": "`` of each header."""
LINGER_S = 2.0
"""After a refusal, how long the server still reads (and drops) what the client sends
before it closes: a client still sending its request then reads the answer, where an
immediate close would reset the connection under it (a "lingering close")."""


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """How much of a request's line and headers the server reads, and for how long
    (the ``server:`` keys of the same names)."""

    max_request_line_bytes: int
    max_header_line_bytes: int
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float

    @classmethod
    def from_config(cls, sc: ServerConfig) -> HeadLimits:
        return cls(sc.max_request_line_bytes, sc.max_header_line_bytes, sc.max_header_bytes,
                   sc.max_headers, sc.header_timeout_s)

    @property
    def head_bytes(self) -> int:
        """Most raw bytes one request head may take: the parser never sees more."""
        return (self.max_request_line_bytes + self.max_header_bytes + 4 * self.max_headers
                + HEAD_SLACK_BYTES)


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """A server's head limits, and what to call with the status of each request refused
    at the door (the app never sees it: it counts it in the metrics)."""

    limits: HeadLimits
    on_refused: Callable[[int], None]


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a head over a limit."""


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded in size, count and
    time. Use :func:`front_door_protocol` for a class with its limits set."""

    door: ClassVar[FrontDoor]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = self.door.limits
        self._in_head = True
        """The parser is between requests or inside a request's line and headers."""
        self._head_left = self.limits.head_bytes
        self._target = bytearray()
        self._refusal: APIError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- the connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:  # refused: what still comes is dropped
            return
        self._unset_keepalive_if_required()
        if not self._in_head:  # a body: parsed as it comes
            self._feed(data)
        elif len(data) <= self._head_left:  # counted first: a request ending in it starts the next afresh
            self._head_left -= len(data)
            self._feed(data)
        else:
            self._feed_head(memoryview(data))
        if (self._in_head and self._head_timer is None and self._linger_timer is None
                and self._head_left < self.limits.head_bytes):
            self._arm_head_timer()  # a head begun and not complete: it has header_timeout_s

    def _feed_head(self, view: memoryview) -> None:
        """Parse ``view`` handing the parser no more of a head than the limits leave."""
        while view:
            if not self._in_head:
                self._feed(view)
                return
            if self._head_left <= 0:
                self._refuse(APIError(431, f"the request's headers exceed {self.limits.max_header_bytes} "
                                      "bytes (server.max_header_bytes)"))
                return
            piece, view = view[:self._head_left], view[self._head_left:]
            self._head_left -= len(piece)
            if not self._feed(piece):
                return

    def _feed(self, data: bytes | memoryview) -> bool:
        """Parse ``data``; False when the connection was answered (or upgraded) instead."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(self._refusal)
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return False
        return True

    # -- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._target = bytearray()

    def on_url(self, url: bytes) -> None:
        self._target += url  # a bytearray grows in place (uvicorn's bytes += copies it all)
        if len(self._target) > self.limits.max_request_line_bytes:
            self._stop(APIError(414, f"the request target exceeds {self.limits.max_request_line_bytes} "
                                "bytes (server.max_request_line_bytes)"))

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._check_headers()
        self._in_head = False
        self.url = bytes(self._target)
        super().on_headers_complete()

    def _check_headers(self) -> None:
        """Stop a request whose headers break a limit (their bytes are bounded already:
        the parser was never handed more than the limits leave)."""
        lim = self.limits
        if len(self.headers) > lim.max_headers:
            self._stop(APIError(431, f"the request has more than {lim.max_headers} headers "
                                "(server.max_headers)"))
        sizes = [len(name) + len(value) for name, value in self.headers]
        longest = max(sizes, default=0)
        if longest > lim.max_header_line_bytes:
            name = self.headers[sizes.index(longest)][0][:64].decode("latin-1")
            self._stop(APIError(431, f"the header {name!r} has {longest} bytes; the limit is "
                                f"{lim.max_header_line_bytes} (server.max_header_line_bytes)"))
        if sum(sizes) > lim.max_header_bytes:
            self._stop(APIError(431, f"the request's headers exceed {lim.max_header_bytes} bytes "
                                "(server.max_header_bytes)"))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_left = self.limits.head_bytes

    # -- refusals ------------------------------------------------------------------------------
    def _stop(self, refusal: APIError) -> None:
        self._refusal = refusal
        raise _Refused(refusal.message)

    def _refuse(self, e: APIError) -> None:
        """Answer ``e`` and close the connection, lingering (:data:`LINGER_S`); while an
        earlier request's response is still being sent on it, close it at once."""
        self._cancel_head_timer()
        if self.transport.is_closing() or self._linger_timer is not None:
            return
        self.door.on_refused(e.status)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = json.dumps(e.body(), separators=(",", ":")).encode()
        head = [STATUS_LINE[e.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_left == self.limits.head_bytes:  # nothing of a request came: just close
            self.transport.close()
            return
        self._refuse(APIError(408, f"the request's line and headers did not arrive within "
                              f"{self.limits.header_timeout_s:g} s (server.header_timeout_s)"))


def front_door_protocol(limits: HeadLimits, on_refused: Callable[[int], None]) -> type[FrontDoorProtocol]:
    """A :class:`FrontDoorProtocol` class with these limits, for ``uvicorn.Config(http=...)``;
    ``on_refused`` is called with the status of each request it refuses."""
    return type("FrontDoorProtocol", (FrontDoorProtocol,), {"door": FrontDoor(limits, on_refused)})
