"""Grammar compile worker processes, forked from a zygote.

The zygote (:func:`main`, started as ``python -c`` :data:`_ZYGOTE_MAIN` ``MODULE...``) imports the
modules once (a backend's: xgrammar with torch takes seconds), then forks
one worker for each Unix-socket path it reads on stdin. A worker connects to that path,
sends its pid, receives its compiler factory (pickled), calls it, then compiles each
constraint it receives until the connection closes. Starting a worker is a fork
(milliseconds), so a worker killed at its compile timeout is replaced at once; the
zygote is a fresh interpreter (not multiprocessing), so the caller's ``__main__`` is
never imported again and scripts need no ``if __name__ == "__main__"`` guard.

The zygote exits when its stdin closes (its engine is gone); a worker when its
connection closes. :class:`Zygote` is the engine process's side.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
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


_ZYGOTE_MAIN = "import sys; from schedkit.core.compile_worker import main; main(sys.argv[1:])"
"""The zygote's program (its arguments: the modules to preload)."""


def main(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops them (Ctrl-C reaches the group)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        if os.fork() == 0:
            code = 0
            try:
                _worker(path)
            except BaseException:
                code = 1
            finally:
                os._exit(code)



class Zygote:
    """The process the workers are forked from (:mod:`schedkit.core.compile_worker`),
    started with the first worker; ``fork`` asks it for one more.

    Args:
        preload: Modules it imports once (the backend's).
        start_timeout_s: Longest wait for a worker to connect (the first waits for the
            zygote's imports).
    """

    def __init__(self, preload: tuple[str, ...], start_timeout_s: float) -> None:
        self.preload = preload
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._count = 0

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its pid and its connection.

        Raises:
            OSError: The zygote is gone or the worker did not connect in time.
        """
        with self._lock:
            proc = self._started()
            self._count += 1
            # The socket's folder lives only while the worker connects (0700: this user
            # only), so an engine that dies without stop() leaves nothing in /tmp.
            with tempfile.TemporaryDirectory(prefix="schedkit-grammar-") as folder:
                path = os.path.join(folder, f"w{self._count}.sock")
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    server.bind(path)
                    server.listen(1)
                    assert proc.stdin is not None
                    proc.stdin.write(path + "\n")
                    proc.stdin.flush()
                    sock = self._accept(server, proc, self.start_timeout_s)
                finally:
                    server.close()
        conn = Connection(sock.detach())
        return conn.recv(), conn

    def _started(self) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Not ``-m``: the package imports this module first, and runpy warns about that.
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_MAIN, *self.preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        return self.proc

    @staticmethod
    def _accept(server: socket.socket, proc: subprocess.Popen[str], timeout_s: float) -> socket.socket:
        """The worker's connection; the first waits for the zygote's imports."""
        server.settimeout(0.1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                if proc.poll() is not None:
                    raise OSError(f"the grammar compile zygote exited (code {proc.returncode})") from None
                continue
            sock.settimeout(None)
            return sock
        raise OSError(f"no grammar compile worker connected within {timeout_s:g} s")

    def stop(self) -> None:
        with self._lock:
            if self.proc is not None:
                with contextlib.suppress(OSError):
                    assert self.proc.stdin is not None
                    self.proc.stdin.close()  # it exits; so do idle workers
                try:
                    self.proc.wait(2)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None


if __name__ == "__main__":
    main(sys.argv[1:])
