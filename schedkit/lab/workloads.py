"""Workloads: seeded synthetic generators and replay of public request traces.

Everything here is deterministic given the workload config (its ``seed`` included):
the same YAML always yields the same requests, token for token.

Traces (copies with their licenses under ``data/``):
- ``azure``: Azure LLM inference trace 2023 (code / conversation), CSV
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; prompt contents are synthetic.
- ``mooncake``: Mooncake FAST'25 JSONL; each ``hash_id`` becomes one fixed 512-token block,
  so requests that share hash ids share a real token prefix (and prefix-cache hits).
- ``vidur``: arxiv-summarization length pairs; arrivals are generated (Poisson, ``rate``).

The YAML keys of a workload (``schedkit.config.WorkloadConfig`` and its parts) are listed
with their defaults in docs/reference.md, which tests/test_docs.py checks against them.
"""

from __future__ import annotations

import bisect
import csv
import functools
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from schedkit.config import LengthConfig, TraceConfig, WorkloadConfig
from schedkit.core.request import MAX_ARRIVAL_OFFSET_S
from schedkit.errors import ConfigError

MOONCAKE_BLOCK = 512
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True, frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_time: float
    """Seconds after the start of the workload."""
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: str = "default"
    priority: int = 0


def generate(cfg: WorkloadConfig, vocab_size: int = 32000,
             base_dir: str | Path | None = None, tokenizer: Any = None) -> list[WorkloadRequest]:
    """The workload's requests, sorted by arrival time.

    Raises:
        ConfigError: A trace file is missing or has the wrong columns, or text prompts
            were given without a tokenizer.
    """
    if cfg.kind == "trace":
        assert cfg.trace is not None
        return _within_the_clock(_from_trace(cfg, cfg.trace, vocab_size, base_dir), "workload.trace.time_scale")
    reqs = _within_the_clock(_synthetic(cfg, vocab_size), "workload.rate")
    if cfg.prompts:
        if tokenizer is None:
            raise ConfigError("workload.prompts are text: they need a model with a tokenizer "
                              "(runner.kind paged, or model.tokenizer)")
        encoded = [encode_prompt(tokenizer, p) for p in cfg.prompts]
        reqs = [WorkloadRequest(r.request_id, r.arrival_time, encoded[i % len(encoded)], r.max_tokens,
                                r.tenant, r.priority) for i, r in enumerate(reqs)]
    return reqs


def _within_the_clock(reqs: list[WorkloadRequest], knob: str) -> list[WorkloadRequest]:
    """Raises ConfigError (naming ``knob``) when the last arrival is beyond what the
    engine accepts (``MAX_ARRIVAL_OFFSET_S``): a rate of 1e-300 is a mistake, not a
    workload to find out about at the first request."""
    last = max((r.arrival_time for r in reqs), default=0.0)
    if not last <= MAX_ARRIVAL_OFFSET_S:
        raise ConfigError(f"{knob}: the requests would arrive over {last:.3g} s, more than the "
                          f"engine's {MAX_ARRIVAL_OFFSET_S:g} s")
    return reqs


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a user message, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(text))


# ---------------------------------------------------------------------------- synthetic
class LengthSampler:
    """Draws lengths from a :class:`LengthConfig` with a given RNG."""

    def __init__(self, cfg: LengthConfig) -> None:
        self.cfg = cfg
        self._cum: list[float] = []
        if cfg.dist == "zipf":
            acc = 0.0
            for k in range(1, cfg.max - cfg.min + 2):
                acc += k ** -cfg.a
                self._cum.append(acc)

    def __call__(self, rng: random.Random) -> int:
        c = self.cfg
        if c.dist == "fixed":
            return c.min
        if c.dist == "uniform":
            return rng.randint(c.min, c.max)
        if c.dist == "zipf":
            i = bisect.bisect_left(self._cum, rng.random() * self._cum[-1])
            return c.min + min(i, len(self._cum) - 1)
        value = round(rng.lognormvariate(math.log(c.median), c.sigma))
        return min(max(value, c.min), c.max)


def _interarrival(cfg: WorkloadConfig, rng: random.Random) -> float:
    if cfg.kind == "poisson":
        return rng.expovariate(cfg.rate)
    if cfg.kind == "gamma":
        shape = 1.0 / cfg.burstiness ** 2
        return rng.gammavariate(shape, 1.0 / (cfg.rate * shape))
    return 1.0 / cfg.rate


def _weighted_picker(rng: random.Random, items: list, weights: list[float]):
    cum = list(itertools.accumulate(weights))
    return lambda: items[bisect.bisect_left(cum, rng.random() * cum[-1])]


def _class_pickers(cfg: WorkloadConfig, rng: random.Random) -> tuple[Any, Any]:
    """Callables drawing each request's tenant and priority class by weight."""
    tenant = (_weighted_picker(rng, [t.name for t in cfg.tenants], [t.weight for t in cfg.tenants])
              if cfg.tenants else (lambda: "default"))
    priority = (_weighted_picker(rng, [p.priority for p in cfg.priorities],
                                 [p.weight for p in cfg.priorities])
                if cfg.priorities else (lambda: 0))
    return tenant, priority


def _synthetic(cfg: WorkloadConfig, vocab_size: int) -> list[WorkloadRequest]:
    rng = random.Random(cfg.seed)
    prompt_len, output_len = LengthSampler(cfg.prompt_len), LengthSampler(cfg.output_len)
    tenant, priority = _class_pickers(cfg, rng)
    sp = cfg.shared_prefix
    prefixes = ([token_run(-(cfg.seed << 8) - j - 1, sp.length, vocab_size) for j in range(sp.count)]
                if sp is not None else [])
    t = 0.0
    reqs = []
    for i in range(cfg.num_requests):
        t += _interarrival(cfg, rng)
        prompt = token_run((cfg.seed << 24) + i, prompt_len(rng), vocab_size)
        if sp is not None and rng.random() < sp.fraction:
            prompt = prefixes[rng.randrange(sp.count)] + prompt
        reqs.append(WorkloadRequest(f"req-{i}", t, prompt, output_len(rng), tenant(), priority()))
    return reqs


# ---------------------------------------------------------------------------- traces
def resolve_path(path: str, base_dir: str | Path | None) -> Path:
    """Find a trace file: as given, next to the config file, then in the repository."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [
        *([Path(base_dir) / p] if base_dir is not None else []), Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c
    folders = [c for c in candidates if c.is_dir()]
    if folders:
        raise ConfigError(f"workload.trace.path = {path!r}: {folders[0]} is a directory, not a trace file")
    raise ConfigError(f"workload.trace.path = {path!r}: file not found (looked in: "
                      f"{', '.join(str(c) for c in candidates)})")


def _require_columns(path: Path, found: Sequence[str] | None, needed: tuple[str, ...]) -> None:
    missing = [c for c in needed if c not in (found or ())]
    if missing:
        raise ConfigError(f"{path}: missing columns {missing} (found {found}); expected "
                          f"{', '.join(needed)}")


def _azure_seconds(stamp: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> POSIX seconds."""
    whole, _, frac = stamp.partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or 0}")


def _csv_rows(path: Path, needed: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV trace with the ``needed`` columns."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            _require_columns(path, reader.fieldnames, needed)
            for row in reader:
                yield reader.line_num, row
        except UnicodeDecodeError as e:
            raise _not_text(path, e) from None


def _count(path: Path, line: int, row: dict[str, str], column: str) -> int:
    """A non-negative token count of a trace row (0 is served as 1 token)."""
    try:
        n = int(row[column])
    except (TypeError, ValueError):
        raise ConfigError(f"{path}:{line}: {column} = {row[column]!r}: not a whole number") from None
    if n < 0:
        raise ConfigError(f"{path}:{line}: {column} = {n}: a token count cannot be negative")
    return n


def _read_azure(path: Path) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    for line, r in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            t = _azure_seconds(r["TIMESTAMP"])
        except (TypeError, ValueError):
            raise ConfigError(f"{path}:{line}: TIMESTAMP = {r['TIMESTAMP']!r}: not a time like "
                              "'2023-11-16 18:17:03.9799600'") from None
        if rows and t < rows[-1][0]:
            raise ConfigError(f"{path}:{line}: TIMESTAMP = {r['TIMESTAMP']!r} is earlier than the "
                              "row before it: a trace's rows must be in time order")
        rows.append((t, _count(path, line, r, "ContextTokens"), _count(path, line, r, "GeneratedTokens")))
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, p, o) for t, p, o in rows]


def _read_vidur(path: Path) -> list[tuple[int, int]]:
    return [(_count(path, line, r, "num_prefill_tokens"), _count(path, line, r, "num_decode_tokens"))
            for line, r in _csv_rows(path, ("num_prefill_tokens", "num_decode_tokens"))]


def _read_mooncake(path: Path, start: int, limit: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with open(path) as f:
        for n, line in _lines(path, f):
            if n < start:
                continue
            if len(rows) >= limit:
                break
            try:
                row = json.loads(line)
                rows.append({k: row[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")})
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{n + 1}: not a Mooncake trace line "
                                  f"(timestamp, input_length, output_length, hash_ids): {e}") from e
    return rows


def _lines(path: Path, f: Any) -> Iterator[tuple[int, str]]:
    """(index, line) of an open text file; a byte that is not UTF-8 is a ConfigError."""
    try:
        yield from enumerate(f)
    except UnicodeDecodeError as e:
        raise _not_text(path, e) from None


def _not_text(path: Path, e: UnicodeDecodeError) -> ConfigError:
    return ConfigError(f"{path}: not UTF-8 text ({e.reason}, byte {e.object[e.start]:#04x})")


def token_run(key: int, n: int, vocab_size: int) -> list[int]:
    """``n`` token ids determined by ``key`` (ids 0..2 are left out as special tokens).

    Prompt contents do not matter to a scheduler beyond which prompts share prefixes,
    so a cheap arithmetic sequence per key stands in for random text; distinct keys
    start at distinct points, so unrelated prompts share no block.
    """
    m = vocab_size - 3
    base = (key * 2654435761) % m
    step = 7919 % m or 1
    cycle = _token_cycle(m, step)
    if cycle is None:
        return [(base + step * i) % m + 3 for i in range(n)]
    # The same ids as the formula above, sliced from the run's one cycle (a C-speed copy:
    # long traces need hundreds of millions of prompt tokens).
    ids, inverse = cycle
    j = base * inverse % m  # (base + step * i) % m == step * (j + i) % m
    if j + n <= m:
        return ids[j:j + n]
    out = ids[j:]
    whole, rest = divmod(n - len(out), m)
    out += ids * whole
    out += ids[:rest]
    return out


@functools.lru_cache(maxsize=8)
def _token_cycle(m: int, step: int) -> tuple[list[int], int] | None:
    """``[step * j % m + 3 for j in range(m)]`` and the inverse of ``step`` modulo ``m``
    (None when there is none: ``token_run`` then uses its formula)."""
    if m < 2 or math.gcd(step, m) != 1:
        return None
    return [step * j % m + 3 for j in range(m)], pow(step, -1, m)


def _block_tokens(hash_id: int, seed: int, vocab_size: int) -> list[int]:
    """The fixed 512 tokens that stand for one Mooncake hash id."""
    return token_run(hash_id * 1000003 + seed, MOONCAKE_BLOCK, vocab_size)


def _from_trace(cfg: WorkloadConfig, tc: TraceConfig, vocab_size: int,
                base_dir: str | Path | None) -> list[WorkloadRequest]:
    path = resolve_path(tc.path, base_dir)
    rng = random.Random(cfg.seed)
    tenant, priority = _class_pickers(cfg, rng)
    limit = cfg.num_requests
    rows: list[tuple[float, list[int], int]] = []
    if tc.format == "mooncake":
        blocks: dict[int, list[int]] = {}
        for r in _read_mooncake(path, tc.start, limit):
            prompt: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = _block_tokens(h, cfg.seed, vocab_size)
                prompt += blocks[h]
            rows.append((r["timestamp"] / 1000.0, prompt[: r["input_length"]], r["output_length"]))
    else:
        if tc.format == "azure":
            timed = _read_azure(path)[tc.start: tc.start + limit]
        else:
            t, timed = 0.0, []
            for p, o in _read_vidur(path)[tc.start: tc.start + limit]:
                t += rng.expovariate(cfg.rate)
                timed.append((t, p, o))
        for i, (t, p, o) in enumerate(timed):
            rows.append((t, token_run((cfg.seed << 24) + tc.start + i, max(p, 1), vocab_size), o))
    if not rows:
        raise ConfigError(f"{path}: no requests from row {tc.start} on (an empty trace, or "
                          "workload.trace.start past its end)")
    t0 = rows[0][0]
    reqs = []
    for i, (t, prompt, out) in enumerate(rows):
        if tc.max_prompt_len is not None:
            prompt = prompt[: tc.max_prompt_len]
        if tc.max_output_len is not None:
            out = min(out, tc.max_output_len)
        reqs.append(WorkloadRequest(f"req-{i}", (t - t0) * tc.time_scale, prompt, max(out, 1),
                                    tenant(), priority()))
    return reqs


def repeat_workload(workload: Sequence[WorkloadRequest], num_requests: int, *,
                    vocab_size: int = 32000, gap_s: float | None = None) -> list[WorkloadRequest]:
    """The first ``num_requests`` requests of ``workload`` played over and over, for a
    trace shorter than the run wanted (deterministic, like everything here).

    Copy ``k`` (0, 1, ...) starts ``gap_s`` after copy ``k - 1``'s last arrival (default:
    the workload's mean gap between arrivals); its requests are numbered on
    (``req-<k * len(workload) + i>``) and its prompt tokens go through the ``k``-th
    permutation ``t -> 3 + (t - 3) * a_k mod (vocab_size - 3)`` of the non-special ids
    (``a_0 = 1``: copy 0 is the workload itself). A permutation keeps which prompts of a
    copy share prefixes, and how long the shares are, exactly; for the prompts made here
    (``token_run`` arithmetic runs, so also Mooncake's hash-id blocks) copies share no
    block with each other: each copy is a new set of conversations over the same
    arrival pattern, not a replay of the same ones.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    base = list(workload)
    if num_requests <= len(base) or not base:
        return base[:num_requests]
    span = base[-1].arrival_time - base[0].arrival_time
    if gap_s is None:
        gap_s = span / (len(base) - 1) if len(base) > 1 else 1.0
    m = vocab_size - 3
    multipliers = [a for a in range(1, max(m, 2)) if math.gcd(a, m) == 1]
    out: list[WorkloadRequest] = []
    for k in itertools.count():
        if len(out) >= num_requests:
            break
        if k >= len(multipliers):
            raise ValueError(f"cannot make {k + 1} distinct copies with a vocabulary of {vocab_size}")
        a = multipliers[k]
        table = list(range(3)) + [3 + (t * a) % m for t in range(m)] if k else None
        shift = k * (span + gap_s)
        for i, w in enumerate(base[: num_requests - len(out)]):
            prompt = w.prompt_token_ids if table is None else [table[t] for t in w.prompt_token_ids]
            out.append(WorkloadRequest(f"req-{k * len(base) + i}", w.arrival_time + shift, prompt,
                                       w.max_tokens, w.tenant, w.priority))
    return out
