"""The waiting queue as the scheduler sees it: the policy's queue behind a guard.

A policy's queue is plugin code (its methods, and the key functions a
:class:`~schedkit.core.queues.KeyedQueue` calls), so anything it raises becomes a
:class:`PluginError` naming the plugin that created the queue, the method, and the
request the call was about. Other attributes are read through to the policy's queue.

The guard also keeps the set of request ids it holds, so its length (which the
scheduler reads outside a step too, in ``has_requests`` and the step statistics) never
runs plugin code: a request is in once an ``add`` or ``prepend`` returned, and out once
``pop`` returned it or a ``remove`` returned.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from schedkit.core.queues import RequestQueue
from schedkit.core.request import Request
from schedkit.errors import PluginError

log = logging.getLogger("schedkit.scheduler")

_HOOK = "schedkit_create_waiting_queue"


class GuardedQueue:
    """Delegates the :class:`RequestQueue` methods to ``policy_queue``.

    Attributes:
        policy_queue: The queue the plugin's ``schedkit_create_waiting_queue`` returned.
        plugin: That plugin's name.
    """

    __slots__ = ("policy_queue", "plugin", "errors", "_ids", "_peeked", "_suspect")

    def __init__(self, policy_queue: RequestQueue, plugin: str | None,
                 errors: Counter[tuple[str, str]] | None = None) -> None:
        self.policy_queue = policy_queue
        self.plugin = plugin
        self.errors: Counter[tuple[str, str]] = Counter() if errors is None else errors
        """Where its errors are counted, by ``(plugin, hook)`` (the facade's counter)."""
        self._ids: set[str] = set()
        self._peeked: Request | None = None
        self._suspect: str | None = None

    def _error(self, method: str, e: Exception, request: Request | None = None) -> PluginError:
        qname = type(self.policy_queue).__name__
        rid = request.request_id if request is not None else None
        about = f" for request {rid!r}" if rid is not None else ""
        self.errors[(self.plugin or "unknown", _HOOK)] += 1
        return PluginError(
            f"plugin {self.plugin!r}: its waiting queue ({qname}.{method}) raised{about}: "
            f"{type(e).__name__}: {e}", plugin=self.plugin, hook=f"{_HOOK} ({qname}.{method})",
            request_id=rid)

    def add(self, request: Request) -> None:
        self._peeked = None
        try:
            self.policy_queue.add(request)
        except Exception as e:
            raise self._error("add", e, request) from e
        self._ids.add(request.request_id)

    def peek(self) -> Request:
        """The head, checked. A request the queue does not hold (a duplicate, one never
        added) is dropped with a logged error, if ``pop`` gives that same object. Any
        other wrong answer (None, a request ``pop`` does not give) fails the step; if the
        queue lies again while that real head is still waiting, the error names that
        request, so it fails alone. If the queue runs dry while requests it was given
        are unaccounted for, it lost them: the error names them (``lost_request_ids``)."""
        for _ in range(len(self._ids) + 2):
            try:
                req = self.policy_queue.peek()
            except Exception as e:
                err = self._error("peek", e)
                if self._ids and self._policy_len() == 0:
                    err.lost_request_ids = sorted(self._ids)
                    self._ids.clear()
                raise err from e
            if isinstance(req, Request) and req.request_id in self._ids:
                self._peeked = req
                return req
            head = self._real_head()
            if head is req:
                log.error("plugin %r: its waiting queue (%s) answered %r, which it does not hold "
                          "(a duplicate or a request never added); dropped", self.plugin,
                          type(self.policy_queue).__name__, req)
                continue
            self.policy_queue.prepend_request(head)
            again = self._suspect == head.request_id
            self._suspect = head.request_id
            raise self._error("peek", ValueError(f"answered {req!r} while its head is {head!r}"),
                              head if again else None)
        raise self._error("peek", ValueError("keeps answering requests it does not hold"))

    def _real_head(self) -> Request:
        """Pop what the queue really has at its head (the caller puts it back or drops it)."""
        try:
            head = self.policy_queue.pop()
        except Exception as e:
            raise self._error("pop", e) from e
        if not isinstance(head, Request):
            raise self._error("pop", TypeError(f"returned {head!r}, not a request"))
        return head

    def pop(self) -> Request:
        """The head that ``peek`` answered. A queue whose ``pop`` gives another request
        is corrected: that one goes back (if the queue holds it) and the peeked one is
        removed, with a logged error."""
        peeked, self._peeked = self._peeked, None
        try:
            req = self.policy_queue.pop()
        except Exception as e:
            raise self._error("pop", e) from e
        if peeked is not None and req is not peeked:
            log.error("plugin %r: its waiting queue (%s) popped %r after peeking %r; corrected",
                      self.plugin, type(self.policy_queue).__name__, req, peeked)
            try:
                if isinstance(req, Request) and req.request_id in self._ids:
                    self.policy_queue.prepend_request(req)
                self.policy_queue.remove_requests([peeked])
            except Exception as e:
                raise self._error("pop", e, peeked) from e
            req = peeked
        if not isinstance(req, Request) or req.request_id not in self._ids:
            raise self._error("pop", ValueError(f"returned {req!r}, which it does not hold"))
        self._ids.discard(req.request_id)
        if req.request_id == self._suspect:  # served after all: the lie was transient
            self._suspect = None
        return req

    def _policy_len(self) -> int:
        try:
            return len(self.policy_queue)
        except Exception:
            return -1

    def prepend_request(self, request: Request) -> None:
        self._peeked = None
        try:
            self.policy_queue.prepend_request(request)
        except Exception as e:
            raise self._error("prepend_request", e, request) from e
        self._ids.add(request.request_id)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._peeked = None
        requests = list(requests)
        try:
            self.policy_queue.prepend_requests(requests)
        except Exception as e:
            raise self._error("prepend_requests", e) from e
        self._ids.update(r.request_id for r in requests)

    def remove_request(self, request: Request) -> None:
        self._peeked = None
        try:
            self.policy_queue.remove_request(request)
        except Exception as e:
            raise self._error("remove_request", e, request) from e
        self._ids.discard(request.request_id)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self._peeked = None
        requests = list(requests)
        try:
            self.policy_queue.remove_requests(requests)
        except Exception as e:
            raise self._error("remove_requests", e) from e
        self._ids.difference_update(r.request_id for r in requests)

    def __len__(self) -> int:
        return len(self._ids)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._ids

    def __iter__(self) -> Iterator[Request]:
        try:
            yield from self.policy_queue
        except Exception as e:
            raise self._error("__iter__", e) from e

    def __getattr__(self, name: str) -> Any:
        if name in GuardedQueue.__slots__:  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.policy_queue, name)

    def __repr__(self) -> str:
        return f"GuardedQueue({self.policy_queue!r}, plugin={self.plugin!r})"
