"""Who may talk to an engine: CurveZMQ keys made for each launch, and the engine's guard.

Every engine socket is a CurveZMQ server. The process that launches an engine makes a
fresh set of :class:`EngineKeys` (the engine's key pair and one client key pair), hands
the engine its part on stdin (never on a command line, never in a file) and keeps the
client part for its own connections. In the engine, :class:`EngineGuard` answers the ZAP
requests of its sockets, admitting only that client key, and counts every handshake its
sockets refuse: no key, a wrong key, or something that does not speak ZMTP at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from schedkit.engine.logs import RateLimitedLog

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's authentication requests (RFC 27)."""
ZAP_DOMAIN = b"schedkit"
REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""Monitor events that mean a peer was refused at the handshake."""
REFUSED_LOG_INTERVAL_S = 10.0
"""At most one log line per this many seconds about refused connections."""


@dataclass(frozen=True, slots=True, repr=False)
class EngineKeys:
    """The CurveZMQ keys of one engine launch (Z85 text, 40 bytes each).

    The launcher holds all four; the engine gets :meth:`engine_part` (its secret key and
    the client's public key), so its ``client_secret`` is empty.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> EngineKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def engine_part(self) -> dict[str, str]:
        """What the engine process needs (sent on its stdin, or to a Ray actor)."""
        return {"server_secret": self.server_secret.decode(), "client_public": self.client_public.decode()}

    @classmethod
    def from_engine_part(cls, part: dict[str, str]) -> EngineKeys:
        secret = part["server_secret"].encode()
        return cls(zmq.curve_public(secret), secret, part["client_public"].encode(), b"")

    def __repr__(self) -> str:
        return f"EngineKeys(server_public={self.server_public.decode()!r}, <secrets hidden>)"

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before it connects) a CurveZMQ client of this launch's engine."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class EngineGuard:
    """The engine side: curve-server options for its ROUTER sockets, a ZAP handler that
    admits only the launch's client key, and ``num_refused`` (handshakes refused).

    Create it before any socket binds (libzmq asks the context's ZAP handler during each
    handshake), :meth:`protect` each socket before it binds, then run :meth:`run` on a
    thread of its own; it closes its sockets when ``stop`` is set.
    """

    def __init__(self, ctx: zmq.Context[Any], keys: EngineKeys, log: Any) -> None:
        self.keys = keys
        self.num_refused = 0
        self._allowed = zmq.utils.z85.decode(keys.client_public)
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._names: dict[zmq.Socket[Any], str] = {}
        """Each socket's monitor -> the socket's name."""
        self._log = RateLimitedLog(log, REFUSED_LOG_INTERVAL_S)

    def protect(self, sock: zmq.Socket[Any], name: str) -> None:
        """Make ``sock`` (before it binds) a CurveZMQ server whose refusals are counted."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.zap_domain = ZAP_DOMAIN
        monitor = sock.get_monitor_socket(REFUSED_EVENTS)
        self._names[monitor] = name

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        for sock in (self._zap, *self._names):
            poller.register(sock, zmq.POLLIN)
        try:
            while not stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self._zap:
                        self._answer(sock.recv_multipart())
                    else:
                        self._refused(self._names[sock], recv_monitor_message(sock))
        finally:
            for sock in (self._zap, *self._names):
                sock.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        """Admit the launch's client key, refuse anything else (its count comes from the
        socket's monitor, which also sees the refusals that never reach ZAP)."""
        version, request_id, _domain, _address, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and credentials[:1] == [self._allowed]
        status = (b"200", b"OK") if ok else (b"400", b"unknown client key")
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def _refused(self, name: str, event: dict[str, Any]) -> None:
        self.num_refused += 1
        kind = "wrong client key" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "no or wrong key"
        self._log.warning("refused a connection to the engine's %s socket (%s)", name, kind)
