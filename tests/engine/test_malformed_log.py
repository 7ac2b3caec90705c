"""The engine's log line about malformed messages is rate limited."""

from __future__ import annotations

import logging
import threading

from schedkit.engine.auth import EngineKeys
from schedkit.engine.logs import RateLimitedLog
from schedkit.engine.process import EngineCoreProc


def test_rate_limited_log_counts_what_it_suppresses(caplog):
    now = [100.0]
    logger = logging.getLogger("schedkit.test.ratelimit")
    limited = RateLimitedLog(logger, 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for i in range(5):
            limited.warning("bad message %d", i)
        now[0] += 10.0
        limited.warning("bad message %d", 5)
        limited.warning("bad message %d", 6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad message 0", "bad message 5 (4 more suppressed in the last 10 s)"]
    assert limited.suppressed == 1


def test_malformed_messages_are_counted_but_logged_at_most_once_per_interval(tmp_path, small_config,
                                                                             caplog):
    proc = EngineCoreProc(small_config(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out",
                          EngineKeys.generate())
    try:
        with caplog.at_level(logging.WARNING, logger="schedkit.engine"):
            for _ in range(50):  # a flood, well within one interval
                proc._malformed("garbage")
            logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
            assert len(logged) == 1 and proc.num_malformed == 50
            limiter = proc._malformed_log
            later = limiter.clock() + limiter.interval
            limiter.clock = lambda: later  # the interval has passed
            proc._malformed("garbage")
        logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert len(logged) == 2 and "49 more suppressed" in logged[1]
        assert proc.num_malformed == 51
    finally:
        proc._in_sock.close(0)
        proc._out_sock.close(0)
        stop = threading.Event()
        stop.set()
        proc.guard.run(stop)  # closes its own sockets
        proc.ctx.term()


def test_an_observer_raising_every_step_is_logged_once_per_interval(caplog):
    """The engine keeps serving through a raising schedkit_on_step_end; its error is
    logged once, not once per step (the requests still finish)."""
    from schedkit import hookimpl
    from schedkit.config import config_from_dict
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore

    class Broken:
        @hookimpl
        def schedkit_on_step_end(self):
            raise RuntimeError("observer down")

    engine = EngineCore(config_from_dict({"runner": {"kind": "fake"}}), extra_plugins=[Broken()])
    for i in range(3):
        engine.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20), arrival_time=0.0))
    finished = []
    with caplog.at_level(logging.ERROR, logger="schedkit.engine"):
        while engine.has_requests():
            for group in engine.step().values():
                finished += [o.request_id for o in group.outputs if o.finish_reason == "length"]
    assert sorted(finished) == ["r0", "r1", "r2"] and engine.num_steps >= 20
    lines = [r.getMessage() for r in caplog.records if "observer down" in r.getMessage()]
    assert len(lines) == 1


class _RefusesEveryone:
    @staticmethod
    def schedkit_admit_request(request):
        raise RuntimeError(f"no room for {request.request_id}")


def test_a_hook_raising_for_every_request_fails_each_but_logs_one_line(small_config, caplog):
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore
    from schedkit.hookspecs import hookimpl

    plugin = _RefusesEveryone()
    plugin.schedkit_admit_request = hookimpl(plugin.schedkit_admit_request)
    engine = EngineCore(small_config(), extra_plugins=[plugin])
    with caplog.at_level(logging.ERROR, logger="schedkit.engine"):
        for i in range(30):
            engine.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))
        errors = {}
        while engine.has_requests():
            for outs in engine.step().values():
                errors.update({o.request_id: o.error for o in outs.outputs if o.error})
    assert len(errors) == 30 and all("schedkit_admit_request" in e and "no room for" in e
                                     for e in errors.values())
    logged = [r for r in caplog.records if "no room for" in r.getMessage()]
    assert len(logged) == 1  # the rest within the interval are suppressed
