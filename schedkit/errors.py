"""Typed errors. Resource exhaustion is a return value (``None``), bugs are asserts,
and user, config and plugin mistakes raise one of these."""

from __future__ import annotations


class SchedkitError(Exception):
    """Base class of every error schedkit raises on purpose."""


class ConfigError(SchedkitError, ValueError):
    """A configuration file or value is invalid. The message names key, value and file."""


class PluginError(SchedkitError):
    """A plugin failed to load, validate, or raised inside a hook.

    Attributes:
        plugin: The plugin's registered name (or None when unknown).
        hook: The hook name involved (or None at load time).
    """

    def __init__(self, message: str, *, plugin: str | None = None, hook: str | None = None,
                 request_id: str | None = None):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
        self.request_id = request_id
        """The request the hook was deciding about, when there was one."""
        self.outputs: dict | None = None
        """Raised by an observer after a step was applied: that step's outputs, per client."""
        self.finished_requests: list | None = None
        """Raised by an observer of ``finish_requests``: the requests that did finish."""
        self.lost_request_ids: list[str] = []
        """Requests the scheduler could not put back in their queue while undoing the
        failed step (its queue raised again); they fail too."""

    @property
    def request_ids(self) -> list[str]:
        """Every request this error fails: ``request_id``, then the lost ones."""
        ids = [self.request_id] if self.request_id is not None else []
        return ids + [r for r in self.lost_request_ids if r != self.request_id]


class RequestError(SchedkitError, ValueError):
    """A request was rejected: bad prompt, bad sampling values, duplicate id, too long.

    Attributes:
        request_id: The id of the rejected request.
    """

    def __init__(self, message: str, *, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class EngineBusyError(RequestError):
    """A request refused because one of the engine's bounded queues is full right now
    (the grammar compile queue): the engine is saturated, the request is not at fault;
    the same request may succeed later (the HTTP server answers 429 with Retry-After)."""


class RouteRefusedError(EngineBusyError):
    """A request the router refused to route (a ``schedkit_router_admit`` plugin answered
    REFUSE): no replica can serve it as its SLO class asks right now. The HTTP server
    answers 429 with Retry-After, as for any busy engine; the message names the plugin,
    the request's SLO class and the reason.

    Attributes:
        plugin: The router plugin that refused it.
        slo_class: The request's SLO class (None when it has none).
        reason: The plugin's reason.
    """

    def __init__(self, message: str, *, request_id: str | None = None, plugin: str = "",
                 slo_class: str | None = None, reason: str = ""):
        super().__init__(message, request_id=request_id)
        self.plugin = plugin
        self.slo_class = slo_class
        self.reason = reason


class EngineDeadError(SchedkitError):
    """The engine-core process died; every pending client call raises this."""


class ReplayError(SchedkitError):
    """A counterfactual replay cannot be run as asked: a change that does not apply at its
    step (a victim that is not running there), a step outside the recording, or a replay
    that left the recorded decisions before the step it changes.

    Attributes:
        request_id: The request the error is about, when there is one.
    """

    def __init__(self, message: str, *, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class RecordingError(ReplayError, ValueError):
    """A recording file is malformed; the message starts with ``file:line``.

    Attributes:
        path: The file.
        line: Its line (1-based) at fault, or None for the file as a whole.
    """

    def __init__(self, path: str, line: int | None, message: str):
        super().__init__(f"{path}{'' if line is None else f':{line}'}: {message}")
        self.path = path
        self.line = line


class ReplayDivergenceError(ReplayError):
    """The replay made another decision than the recording at a step it was to reproduce.

    Attributes:
        step: The first step that differs.
        differences: What differed: ``{key: (recorded, replayed)}`` for the step's
            ``scheduled``, ``new``, ``resumed``, ``preempted`` and ``finished``.
    """

    def __init__(self, message: str, *, step: int, differences: dict[str, tuple[object, object]]):
        super().__init__(message)
        self.step = step
        self.differences = differences


class ForeignProfileWarning(UserWarning):
    """A simulator cost-model profile fitted on another machine (its step times were
    measured there); it loads all the same. The message names both machines."""
