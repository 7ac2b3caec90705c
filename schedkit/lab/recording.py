"""Recordings: every scheduling decision of a run, one JSON object a line.

A recording is what :mod:`schedkit.lab.replay` replays. It holds, in this order:

* a ``header``: ``{"type": "header", "format": "schedkit-recording", "version": 1,
  "kind": "engine" | "cluster", "config": {...}, "num_blocks": N, "virtual_clock": bool}``
  (the whole config the run used, the KV blocks its engine really had, whether its clock
  was virtual: the fake or simulated runner; and ``run_steps``, the engine steps it took);
* one ``request`` line per request, in arrival order: ``id``, ``arrival_time`` (seconds
  after the start), ``step`` (engine recordings: the step it joined, i.e. it was in the
  scheduler when that step was scheduled), ``max_tokens``, ``priority``, ``tenant``, its
  outcome (``num_output_tokens``, ``finish_reason``, ``metrics``: its arrival, first
  admission, first token and finish times, cached, recomputed tokens and preemptions) and
  last its ``prompt_token_ids``;
* engine recordings: one ``step`` line per step, numbered from 1 as the scheduler numbers
  them, with the step-log fields of the vLLM oracle (``../shared/oracle``):
  ``scheduled`` as ``[id, start, n]`` in the order the step scheduled them (running
  requests first), ``new``, ``resumed``, ``preempted`` and ``finished`` as ``[id, reason]``;
  plus ``rejected`` (the requests its admission plugin rejected), ``clock`` (the engine clock, seconds after the start, when the step's turn came),
  ``end`` (when its output was processed) and ``in_flight`` (steps in flight when it was
  scheduled; 0 without async scheduling). The oracle's ``compare_logs.py`` diffs two
  recordings as it diffs two step logs;
* cluster recordings: one ``route`` line per routing decision, numbered from 1 in arrival
  order: ``{"type": "route", "decision": i, "id": ..., "replica": j}``.

A path ending in ``.gz`` is read and written gzipped. :func:`read_recording` checks every
line and raises :class:`~schedkit.errors.RecordingError` naming ``file:line`` and what is
wrong.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from schedkit.config import Config, config_from_dict
from schedkit.errors import ConfigError, RecordingError
from schedkit.lab.metrics import RequestMetrics
from schedkit.lab.workloads import WorkloadRequest

FORMAT = "schedkit-recording"
VERSION = 1
KINDS = ("engine", "cluster")
DECISIONS = ("scheduled", "new", "resumed", "preempted", "rejected", "finished")
"""The fields of a step that are decisions (what a replay must reproduce)."""
METRICS = ("arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
           "num_cached_tokens", "num_preemptions", "num_recomputed_tokens")
"""The per-request figures a recording keeps (times in seconds after the start)."""


@dataclass(slots=True)
class RequestRecord:
    """One request of a recording: what was asked, when, and how it ended."""

    request_id: str
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    tenant: str = "default"
    step: int | None = None
    """The step it joined (engine recordings), None if unknown."""
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    metrics: dict[str, Any] | None = None
    """:data:`METRICS` of the recorded run."""

    def workload_request(self) -> WorkloadRequest:
        return WorkloadRequest(self.request_id, self.arrival_time, list(self.prompt_token_ids),
                               self.max_tokens, self.tenant, self.priority)


@dataclass(slots=True)
class StepRecord:
    """One engine step: its decisions and when it ran."""

    step: int
    scheduled: list[tuple[str, int, int]]
    new: list[str]
    resumed: list[str]
    preempted: list[str]
    finished: list[tuple[str, str]]
    rejected: list[str] = field(default_factory=list)
    """Requests the step's admission plugin rejected (they end in the first output after
    it: with async scheduling, the previous step's ``finished``)."""
    clock: float = 0.0
    end: float = 0.0
    in_flight: int = 0

    def decisions(self) -> dict[str, list[Any]]:
        return {k: list(getattr(self, k)) for k in DECISIONS}

    @property
    def admitted(self) -> set[str]:
        """Requests the step admitted: new ones and resumed ones."""
        return {*self.new, *self.resumed}


@dataclass(slots=True)
class Recording:
    """A recorded run (module docstring)."""

    kind: str
    config: Config
    num_blocks: int
    virtual_clock: bool
    requests: list[RequestRecord]
    steps: list[StepRecord] = field(default_factory=list)
    routes: list[tuple[str, int]] = field(default_factory=list)
    """Cluster recordings: (request id, replica) per routing decision, in order."""
    run_steps: int = 0
    """Engine steps the run took (a cluster: every replica's)."""
    path: str | None = None

    @property
    def num_steps(self) -> int:
        """Steps (engine recordings) or routing decisions (cluster recordings)."""
        return len(self.steps) if self.kind == "engine" else len(self.routes)

    def step(self, number: int) -> StepRecord:
        return self.steps[number - 1]

    def write(self, path: str | Path) -> None:
        """Write the recording (gzipped when ``path`` ends with ``.gz``)."""
        with _open(str(path), "wt") as f:
            for obj in self._lines():
                f.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def _lines(self) -> Iterator[dict[str, Any]]:
        yield {"type": "header", "format": FORMAT, "version": VERSION, "kind": self.kind,
               "config": self.config.model_dump(mode="json"), "num_blocks": self.num_blocks,
               "virtual_clock": self.virtual_clock, "run_steps": self.run_steps}
        for r in self.requests:
            yield {"type": "request", "id": r.request_id, "arrival_time": r.arrival_time,
                   "step": r.step, "max_tokens": r.max_tokens, "priority": r.priority,
                   "tenant": r.tenant, "num_output_tokens": r.num_output_tokens,
                   "finish_reason": r.finish_reason, "metrics": r.metrics,
                   "prompt_token_ids": r.prompt_token_ids}
        for s in self.steps:
            yield {"type": "step", "step": s.step, **s.decisions(), "clock": s.clock,
                   "end": s.end, "in_flight": s.in_flight}
        for i, (rid, replica) in enumerate(self.routes, 1):
            yield {"type": "route", "decision": i, "id": rid, "replica": replica}


def metrics_record(m: RequestMetrics) -> dict[str, Any]:
    """The :data:`METRICS` of one request."""
    return {k: getattr(m, k) for k in METRICS}


def _open(path: str, mode: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


# -- reading --------------------------------------------------------------------------------

class _Line:
    """One parsed line and where it is, for checks that name ``file:line``."""

    __slots__ = ("path", "number", "obj")

    def __init__(self, path: str, number: int, obj: dict[str, Any]) -> None:
        self.path, self.number, self.obj = path, number, obj

    def error(self, message: str) -> RecordingError:
        return RecordingError(self.path, self.number, message)

    def get(self, key: str, kind: str, *, optional: bool = False) -> Any:
        """The value of ``key``, checked: kind is one of int, number, str, bool, ids (a
        list of strings), tokens (a non-empty list of ints >= 0), object, list."""
        if key not in self.obj or self.obj[key] is None:
            if optional:
                return None
            raise self.error(f"{self.obj.get('type')} line: missing {key!r}")
        value = self.obj[key]
        if not _is(value, kind):
            raise self.error(f"{self.obj.get('type')} line: {key} must be {_KIND_TEXT[kind]}, "
                             f"got {_short(value)}")
        return value


_KIND_TEXT = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
              "ids": "a list of request ids", "tokens": "a non-empty list of token ids (integers >= 0)",
              "object": "an object", "list": "a list"}


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return type(value) is int
    if kind == "number":
        return type(value) in (int, float)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "ids":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "tokens":
        return isinstance(value, list) and bool(value) and all(type(v) is int and v >= 0 for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return isinstance(value, list)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."


def read_recording(path: str | Path) -> Recording:
    """Read and check a recording.

    Raises:
        RecordingError: A line that is not JSON, not a known kind of line, misses a field
            or has one of the wrong type, a header that is not a schedkit recording (or an
            invalid config), a step out of order or naming an unknown request; the
            message starts with ``file:line``.
    """
    path = str(path)
    try:
        with _open(path, "rt") as f:
            lines = list(_parse(path, f))
    except OSError as e:  # a damaged .gz is an OSError too (BadGzipFile)
        raise RecordingError(path, None, f"cannot read it ({e.strerror or e})") from None
    except (EOFError, zlib.error) as e:
        raise RecordingError(path, None, f"cut short: the compressed file ends early ({e})") from None
    if not lines:
        raise RecordingError(path, None, "empty: a recording starts with a header line")
    rec = _header(lines[0])
    known: set[str] = set()
    for line in lines[1:]:
        kind = line.obj.get("type")
        if kind == "request":
            rec.requests.append(_request(line, known))
        elif kind == "step" and rec.kind == "engine":
            rec.steps.append(_step(line, known, len(rec.steps) + 1))
        elif kind == "route" and rec.kind == "cluster":
            rec.routes.append(_route(line, known, len(rec.routes) + 1, rec.config.replicas.count))
        elif kind == "header":
            raise line.error("a second header line")
        else:
            raise line.error(f"unknown line type {_short(kind)} in this {rec.kind} recording "
                             f"(expected request, {'step' if rec.kind == 'engine' else 'route'})")
    rec.path = path
    rec.run_steps = rec.run_steps or len(rec.steps)
    _check_complete(rec)
    return rec


FINISHED = ("length", "stop")
"""A recorded outcome that says the request ran to its end, in a step of the recording."""


def _check_complete(rec: Recording) -> None:
    """A recording cut short (lines lost at its end) is refused: a cluster recording routes
    every request; in an engine recording, every request that finished did so in one of
    its steps."""
    path = rec.path or "<recording>"
    if not rec.requests:
        raise RecordingError(path, None, "holds no request line")
    if rec.kind == "cluster":
        routed = {rid for rid, _ in rec.routes}
        missing = [r.request_id for r in rec.requests if r.request_id not in routed]
        if missing:
            raise RecordingError(path, None, f"{len(missing)} of its {len(rec.requests)} requests have no route "
                                 f"line (e.g. {missing[0]!r}): the recording is cut short")
        return
    ended = {rid for s in rec.steps for rid, _ in s.finished} | {rid for s in rec.steps for rid in s.rejected}
    missing = [r.request_id for r in rec.requests if r.finish_reason in FINISHED and r.request_id not in ended]
    if missing:
        raise RecordingError(path, None, f"{len(missing)} requests that finished end in none of its "
                             f"{len(rec.steps)} steps (e.g. {missing[0]!r}): the recording is cut short")


def _parse(path: str, f: IO[str]) -> Iterator[_Line]:
    for number, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecordingError(path, number, f"not JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
            raise RecordingError(path, number, "each line must be a JSON object with a \"type\"")
        yield _Line(path, number, obj)


def _header(line: _Line) -> Recording:
    if line.obj.get("type") != "header" or line.obj.get("format") != FORMAT:
        raise line.error(f"not a schedkit recording: the first line must be a header with "
                         f"\"format\": \"{FORMAT}\"")
    if line.obj.get("version") != VERSION:
        raise line.error(f"recording version {_short(line.obj.get('version'))}; this schedkit reads "
                         f"version {VERSION}")
    kind = line.get("kind", "str")
    if kind not in KINDS:
        raise line.error(f"header: kind must be one of {', '.join(KINDS)}, got {_short(kind)}")
    try:
        config = config_from_dict(line.get("config", "object"), source=f"{line.path}:{line.number} config")
    except ConfigError as e:
        raise line.error(f"header: invalid config: {e}") from None
    num_blocks = line.get("num_blocks", "int")
    if num_blocks < 2:
        raise line.error(f"header: num_blocks must be at least 2, got {num_blocks}")
    return Recording(kind, config, num_blocks, line.get("virtual_clock", "bool"), [],
                     run_steps=line.get("run_steps", "int", optional=True) or 0)


def _request(line: _Line, known: set[str]) -> RequestRecord:
    rid = line.get("id", "str")
    if not rid or rid in known:
        raise line.error(f"request id {_short(rid)} is empty or repeats an earlier one")
    arrival = line.get("arrival_time", "number")
    max_tokens = line.get("max_tokens", "int")
    step = line.get("step", "int", optional=True)
    if not 0 <= arrival < math.inf or max_tokens < 1 or (step is not None and step < 1):
        raise line.error(f"request {rid!r}: arrival_time must be finite and >= 0, max_tokens >= 1 and "
                         f"step >= 1, got {arrival}, {max_tokens}, {step}")
    metrics = line.get("metrics", "object", optional=True)
    if metrics is not None and (set(metrics) != set(METRICS) or not all(
            v is None or type(v) in (int, float) for v in metrics.values())):
        raise line.error(f"request {rid!r}: metrics must hold exactly {', '.join(METRICS)} (numbers or null)")
    known.add(rid)
    return RequestRecord(rid, float(arrival), line.get("prompt_token_ids", "tokens"), max_tokens,
                         line.get("priority", "int", optional=True) or 0,
                         line.get("tenant", "str", optional=True) or "default", step,
                         line.get("num_output_tokens", "int", optional=True),
                         line.get("finish_reason", "str", optional=True), metrics)


def _step(line: _Line, known: set[str], expected: int) -> StepRecord:
    number = line.get("step", "int")
    if number != expected:
        raise line.error(f"step {number} where step {expected} should come (steps are numbered "
                         "from 1, one line each, in order)")
    scheduled = line.get("scheduled", "list")
    if not all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str)
               and type(x[1]) is int and type(x[2]) is int and x[1] >= 0 and x[2] >= 1 for x in scheduled):
        raise line.error(f"step {number}: scheduled must be a list of [request id, start >= 0, tokens >= 1]")
    finished = line.get("finished", "list")
    if not all(isinstance(x, list) and len(x) == 2 and all(isinstance(v, str) for v in x) for x in finished):
        raise line.error(f"step {number}: finished must be a list of [request id, reason]")
    ids = {"new": line.get("new", "ids"), "resumed": line.get("resumed", "ids"),
           "preempted": line.get("preempted", "ids"),
           "rejected": line.get("rejected", "ids", optional=True) or []}
    named = [x[0] for x in scheduled] + [x[0] for x in finished] + [r for v in ids.values() for r in v]
    unknown = sorted(set(named) - known)
    if unknown:
        raise line.error(f"step {number} names requests with no request line before it: {unknown[:5]}")
    in_flight = line.get("in_flight", "int", optional=True) or 0
    return StepRecord(number, [(a, b, c) for a, b, c in scheduled], ids["new"], ids["resumed"],
                      ids["preempted"], [(a, b) for a, b in finished], ids["rejected"],
                      float(line.get("clock", "number", optional=True) or 0.0),
                      float(line.get("end", "number", optional=True) or 0.0), in_flight)


def _route(line: _Line, known: set[str], expected: int, num_replicas: int) -> tuple[str, int]:
    number = line.get("decision", "int")
    if number != expected:
        raise line.error(f"routing decision {number} where decision {expected} should come")
    rid = line.get("id", "str")
    replica = line.get("replica", "int")
    if rid not in known or not 0 <= replica < num_replicas:
        raise line.error(f"decision {number}: request {rid!r} has no request line before it, or "
                         f"replica {replica} is not one of the config's {num_replicas}")
    return rid, replica
