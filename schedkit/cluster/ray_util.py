"""Ray, imported only when asked for: ``import schedkit`` and every command that does not
use Ray work without it installed (it is the ``cluster`` extra)."""

from __future__ import annotations

import importlib
import logging
import socket
from types import ModuleType

from schedkit.errors import ConfigError

INSTALL_HINT = "pip install -e '.[cluster]' (a checkout) or pip install 'schedkit[cluster]'"


def require_ray(what: str = "this command") -> ModuleType:
    """The ``ray`` module.

    Args:
        what: What needs Ray, for the message (``"schedkit compare --ray"``).

    Raises:
        ConfigError: Ray is not installed (or fails to import); the message says how to
            install it.
    """
    try:
        return importlib.import_module("ray")
    except ImportError as e:
        raise ConfigError(f"{what} needs Ray, which is not installed ({e}): {INSTALL_HINT}") from None


def init_ray(address: str | None = None) -> bool:
    """Connect this process to Ray.

    Args:
        address: A running cluster's address (``host:port``, ``ray://host:port``, or
            ``auto`` for the one ``RAY_ADDRESS`` or ``ray start`` names). None starts a
            new local cluster on this machine (no dashboard, Ray's logging quiet).

    Returns:
        Whether this call connected: then the caller's ``ray.shutdown()`` disconnects (and
        stops the local cluster it started). False when this process was already
        connected (by its caller, a notebook, a test): leave that connection alone.

    Raises:
        ConfigError: Ray is missing, or the cluster at ``address`` cannot be reached.
    """
    ray = require_ray("Ray (--ray, replicas.backend: ray)")
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.ERROR, "ignore_reinit_error": True}
    if address is None:
        ray.init(address="local", include_dashboard=False, **quiet)
        return True
    _check_reachable(address)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ConfigError(f"Ray cluster {address!r}: cannot connect ({e}; a cluster with token "
                          "authentication, Ray's default, also needs RAY_AUTH_MODE=token and its "
                          "token here)") from e
    return True


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once on a ``host:port`` nobody listens at (``ray.init`` retries a dead
    address for about 13 minutes before it gives up)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"Ray cluster {address!r}: cannot connect ({e.strerror or e})") from None
