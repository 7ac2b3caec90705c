"""Run a workload through an in-process EngineCore and record every token's time.

With the fake or simulated runner the engine clock is virtual, so a replay of hours of
trace takes seconds and is exactly reproducible; with the real runner it is wall time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.config import Config
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import SchedkitError
from schedkit.lab.metrics import RequestMetrics, refused_metrics, request_metrics
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.runners.fake import tenant_acceptance


def _refused(req: Request, start: float, error: str) -> RequestMetrics:
    return refused_metrics(req.request_id, req.arrival_time - start, req.num_prompt_tokens, error,
                           tenant=req.tenant, priority=req.priority, max_tokens=req.max_tokens)


@dataclass(slots=True)
class RunResult:
    """Everything a report needs about one run of one workload under one config."""

    metrics: list[RequestMetrics]
    failed: dict[str, str] = field(default_factory=dict)
    """request_id -> error, for requests the engine refused or failed (the refused ones
    are in ``metrics`` too, as rejected)."""
    num_steps: int = 0
    wall_s: float = 0.0
    start_time: float = 0.0


PROGRESS_DELAY_S = 1.0
"""A progress bar appears only for a run that takes longer than this (wall time)."""
PROGRESS_INTERVAL_S = 0.1
"""At most one redraw of a progress bar per this many seconds."""


def progress_bar(label: str, total: int) -> Any:
    """A tqdm bar on stderr: requests finished out of ``total``, elapsed time and rate;
    it appears after PROGRESS_DELAY_S and is cleared when closed."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", dynamic_ncols=True, leave=False,
                delay=PROGRESS_DELAY_S, mininterval=PROGRESS_INTERVAL_S, file=sys.stderr)


def _tenant_acceptance(config: Config, runner: Any) -> None:
    """Give a fake or simulated runner built outside the config (``run_workload``'s
    ``runner``) the tenants' draft acceptance that ``from_config`` reads
    (``workload.tenants[].draft_acceptance``)."""
    table = getattr(runner, "acceptance_by_tenant", None)
    if table is not None:
        for tenant, alpha in tenant_acceptance(config).items():
            table.setdefault(tenant, alpha)


def run_workload(config: Config, workload: list[WorkloadRequest] | None = None, *,
                 base_dir: str | Path | None = None, extra_plugins: Iterable[Any] = (),
                 runner: Any = None, progress: str | None = None,
                 on_step: Callable[[EngineCore], None] | None = None) -> RunResult:
    """Replay ``workload`` (default: the config's own) through ``config``'s engine.

    The workload's time 0 is the engine's ``start_time``, the moment it is ready to
    serve (the runner built and initialized), and every request arrives at its
    workload time on the engine clock. ``progress``: a label; show a progress bar on
    stderr (:func:`progress_bar`) while the requests run. ``on_step`` is called with the
    engine after every step it ran.
    """
    if workload is None:
        workload = generate(config.workload, config.runner.vocab_size, base_dir)
    wall0 = time.perf_counter()
    engine = EngineCore(config, runner=runner, extra_plugins=extra_plugins)
    _tenant_acceptance(config, engine.runner)
    start = engine.start_time
    live: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    refused: list[RequestMetrics] = []
    eos = config.runner.eos_token_id
    slo = config.workload.slo
    for w in workload:
        req = Request(w.request_id, w.prompt_token_ids,
                      SamplingParams(max_tokens=w.max_tokens, eos_token_id=eos),
                      arrival_time=start + w.arrival_time, priority=w.priority, tenant=w.tenant,
                      ttft_slo_s=slo.class_target("ttft_s", w.tenant, w.priority))
        try:
            # At its trace time on the engine clock, even when the engine reaches it late
            # (a slow first step): every policy sees the same arrivals.
            engine.add_request_at(req, start + w.arrival_time)
        except SchedkitError as e:
            failed[w.request_id] = str(e)
            refused.append(_refused(req, start, str(e)))
            continue
        live[w.request_id] = req
        token_times[w.request_id] = []
    done: list[Request] = []
    bar = progress_bar(progress, len(workload)) if progress is not None else None
    if bar is not None:
        bar.update(len(refused))
    try:
        while engine.has_requests():
            steps = engine.num_steps
            outputs = engine.step()
            if on_step is not None and engine.num_steps > steps:
                on_step(engine)
            now = engine.now()
            num_done = len(done) + len(refused)
            for group in outputs.values():
                for o in group.outputs:
                    times = token_times.get(o.request_id)
                    if times is not None and o.new_token_ids:
                        times.extend([now] * len(o.new_token_ids))
                    if o.finish_reason is not None:
                        ended = live.pop(o.request_id, None)
                        if o.error is not None:
                            failed[o.request_id] = o.error
                        if ended is not None and not ended.is_finished:  # refused when it arrived
                            refused.append(_refused(ended, start, o.error or "refused"))
                        elif ended is not None:
                            done.append(ended)
            if bar is not None and len(done) + len(refused) > num_done:
                bar.update(len(done) + len(refused) - num_done)
    finally:
        if bar is not None:
            bar.close()
        engine.close()
    metrics = [request_metrics(r, token_times[r.request_id], start, failed.get(r.request_id))
               for r in done] + refused
    metrics.sort(key=lambda m: (m.arrival_time, m.request_id))
    return RunResult(metrics, failed, engine.num_steps, time.perf_counter() - wall0, start)
