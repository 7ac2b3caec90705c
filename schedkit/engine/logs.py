"""Log lines that a misbehaving client or plugin could repeat every step, rate-limited."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """Logs at most one line per ``interval`` seconds; the next line logged says how many
    were suppressed in between."""

    def __init__(self, logger: logging.Logger, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self.clock = logger, interval, clock
        self.suppressed = 0
        self._next = float("-inf")

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self.log(logging.ERROR, msg, *args)

    def log(self, level: int, msg: str, *args: Any) -> None:
        now = self.clock()
        if now < self._next:
            self.suppressed += 1
            return
        if self.suppressed:
            msg += f" ({self.suppressed} more suppressed in the last {self.interval:g} s)"
            self.suppressed = 0
        self.logger.log(level, msg, *args)
        self._next = now + self.interval
