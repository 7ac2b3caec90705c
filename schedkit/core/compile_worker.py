"""Grammar compile worker processes, forked from a zygote.

``python -m schedkit.core.compile_worker MODULE...`` is the zygote: it imports the
modules once (a backend's: xgrammar with torch takes seconds), says ``ready``, then forks
one worker for each Unix-socket path it reads on stdin. A worker connects to that path,
sends its pid, receives its compiler factory (pickled), calls it, then compiles each
constraint it receives until the connection closes. Starting a worker is a fork
(milliseconds), so a worker killed at its compile timeout is replaced at once; the
zygote is a fresh interpreter (not multiprocessing), so the caller's ``__main__`` is
never imported again and scripts need no ``if __name__ == "__main__"`` guard.

The zygote exits when its stdin closes (its engine is gone); a worker when its
connection closes.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any


def connect(path: str) -> Connection:
    """A worker's connection to the engine process's socket ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return Connection(sock.detach())


def serve(conn: Connection, factory: Any) -> None:
    """Compile what arrives until the connection closes. Answers ("ok", result),
    ("invalid", message) for a constraint the backend refuses (ValueError, TypeError),
    or ("error", message)."""
    compile_fn = factory()
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", compile_fn(params))
        except (ValueError, TypeError) as e:
            reply = ("invalid", str(e))
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


def _worker(path: str) -> None:
    os.close(0)  # stdin is the zygote's
    conn = connect(path)
    conn.send(os.getpid())
    try:
        factory = conn.recv()
    except (EOFError, OSError):
        return
    serve(conn, factory)


def main(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops them (Ctrl-C reaches the group)
    print("ready", flush=True)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        sys.stdout.flush()
        if os.fork() == 0:
            code = 0
            try:
                _worker(path)
            except BaseException:
                code = 1
            finally:
                os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
