"""Calibrate the simulator: record a real runner's step times, fit a cost model.

``schedkit calibrate CONFIG -o PROFILE.json`` runs, within a time budget (default 600 s,
model loading included), on the configured (real) runner:

1. the config's own workload (at most a quarter of the budget);
2. a grid of step shapes, bursts of identical-length requests (every batch size with
   every prompt length: large prefills, large decode batches, mixed steps), bursts that
   sample greedily and with top-k / top-p, and bursts under a grammar (where the
   config's structured-output backend can be built). Each burst's duration is first
   predicted by simulating it with a cost model fitted to the steps so far; the
   cheapest run first and those that no longer fit the budget are skipped, so the grid
   is sized to the machine;
3. a swap phase: a second engine with a small KV cache and the ``cpu-offload``
   connector, where requests are preempted for blocks, swapped out to host memory and
   loaded back (a fifth of the budget);

records every engine step's features (:class:`schedkit.runners.cost_model.StepShapes`)
with its measured duration, scheduling and output processing included, and fits the
model (:mod:`schedkit.lab.cost_fit`). The profile records the machine, the versions, the
config, the phases and the fit's residuals.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from schedkit.config import Config, config_from_dict
from schedkit.core.hooks import Preemption
from schedkit.core.request import Request
from schedkit.errors import RequestError, SchedkitError
from schedkit.hookspecs import hookimpl
from schedkit.lab.cost_fit import StepRecord, fit, residuals
from schedkit.lab.step_recorder import Phase, PhaseReport, Session
from schedkit.lab.workloads import WorkloadRequest, generate, token_run
from schedkit.runners.cost_model import CostModel
from schedkit.runners.machine import cpu_times, steal_share
from schedkit.runners.simulated import SimulatedRunner

__all__ = ["Calibration", "Phase", "PhaseReport", "calibrate", "estimate_s", "grid_phases", "probe_ratios_by_kind",
           "record_steps", "sampling_phases", "swap_config"]

GRAMMAR = {"regex": "[a-z ,.]{4,400}"}
"""The constraint of the grammar bursts (every backend compiles a regular expression)."""
SWAP_PLUGIN = "cpu-offload"
GRID_PASSES = 4
"""Most passes over the bursts (the later ones with what time is left)."""


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[:limit - 3] + "..."


@dataclass(slots=True)
class Calibration:
    """What :func:`calibrate` measured and fitted."""

    records: list[StepRecord]
    model: CostModel
    residuals: dict[str, dict[str, float]]
    phases: list[PhaseReport]
    wall_s: float
    budget_s: float
    device_name: str | None = None
    """The runner's accelerator (its ``device_name``), if it has one."""
    steal: float | None = None
    """The machine's steal share during the calibration
    (:func:`~schedkit.runners.machine.steal_share`): on a VM whose cores are shared, the
    steps ran about that much slower than on the machine alone."""
    probe_ratio: float | None = None
    """The speed probe's measured over predicted step time, over the probes run between
    the calibration's passes (the profile's ``speed_probe.ratio``); None: none ran."""
    num_probes: int = 0
    probe_ratio_decode: float | None = None
    """:attr:`probe_ratio` of the probes' decode-only steps alone."""
    probe_ratio_prefill: float | None = None
    """:attr:`probe_ratio` of the probes' steps with a prompt chunk alone."""


PROBE_PROMPT_LENS = (32, 64, 96, 128, 160, 192, 224, 256)
PROBE_MAX_TOKENS = 24


def probe_workload(vocab_size: int, seed: int = 0) -> list[WorkloadRequest]:
    """The speed probe's requests: eight prompts of 32-256 seeded random tokens, all at
    time 0, 24 output tokens each (about 40 steps: chunked prefills, mixed steps, decode
    batches of 1 to 8)."""
    rng = random.Random(seed)
    return [WorkloadRequest(f"probe-{seed}-{i}", 0.0, [rng.randrange(1, vocab_size) for _ in range(n)],
                            PROBE_MAX_TOKENS) for i, n in enumerate(PROBE_PROMPT_LENS)]


def probe_ratio(records: Sequence[StepRecord], model: CostModel) -> float:
    """Measured over ``model``'s predicted time of ``records`` (nan if none)."""
    predicted = sum(model.step_time(f) for f, _ in records)
    return sum(d for _, d in records) / predicted if predicted > 0 else math.nan


def probe_ratios_by_kind(records: Sequence[StepRecord], model: CostModel) -> tuple[float, float]:
    """:func:`probe_ratio` of the decode-only steps and of the steps with a prompt chunk
    apart (nan for a kind with no step)."""
    decode = [r for r in records if not r[0].is_prefill_step]
    prefill = [r for r in records if r[0].is_prefill_step]
    return probe_ratio(decode, model), probe_ratio(prefill, model)


# -- phases -------------------------------------------------------------------------------
def _burst(name: str, key: int, batch: int, prompt_len: int, output_len: int, vocab_size: int,
           sampling: dict[str, Any] | None = None) -> Phase:
    reqs = [WorkloadRequest(f"{name}-{i}", 0.0, token_run(key + i, prompt_len, vocab_size), output_len)
            for i in range(batch)]
    return Phase(name, reqs, dict(sampling or {}))


SHARED_LAG_S = 1e-3
"""In a shared-prefix burst, the requests after the first arrive this much later: the
first computes the prefix alone, the others find it cached."""


def _shared_burst(name: str, key: int, batch: int, prefix_len: int, output_len: int, vocab_size: int,
                  suffix_len: int = 16) -> Phase:
    """``batch`` prompts of one ``prefix_len``-token prefix and a distinct suffix each; the
    first arrives alone, the rest right after it and read its prefix blocks from the
    cache: decode steps where every request reads the same blocks."""
    prefix = token_run(key, prefix_len, vocab_size)
    reqs = [WorkloadRequest(f"{name}-{i}", SHARED_LAG_S if i else 0.0,
                            prefix + token_run(key + 1 + i, suffix_len, vocab_size), output_len)
            for i in range(batch)]
    return Phase(name, reqs, is_timed=True, shared_prefix=prefix_len)


def _fits(config: Config, batch: int, prompt_len: int, output_len: int) -> bool:
    cc = config.cache
    return (prompt_len + output_len <= config.scheduler.max_model_len
            and batch * (prompt_len + output_len + cc.block_size) <= 0.8 * cc.num_blocks * cc.block_size)


def _fits_shared(config: Config, batch: int, prefix_len: int, own_len: int) -> bool:
    """``batch`` requests of one cached ``prefix_len``-token prefix and ``own_len`` tokens
    each of their own fit the model length and the KV cache (the prefix held once)."""
    cc = config.cache
    return (prefix_len + own_len <= config.scheduler.max_model_len
            and prefix_len + batch * (own_len + cc.block_size) <= 0.8 * cc.num_blocks * cc.block_size)


BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)
SHARED_BATCH_SIZES = (4, 16, 64, 256)


def grid_phases(config: Config, output_len: int = 16, prompt_lens: Sequence[int] | None = None,
                batch_sizes: Sequence[int] | None = None) -> list[Phase]:
    """Bursts of ``b`` distinct prompts of ``p`` tokens arriving together, for every
    batch size and prompt length that fits the scheduler and the KV cache: each gives
    prefill (and mixed) steps of up to the token budget, then decode steps at batch
    ``b`` over context ``p``. With prefix caching on, also bursts of ``b`` prompts that
    share a ``p``-token prefix (``p`` of 256 or more, ``b`` above 1): decode steps whose
    requests read the same blocks (batch sizes 4, 16, 64, 256 and ``max_num_seqs``).
    Defaults: batch sizes 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256 up to
    ``max_num_seqs`` (and ``max_num_seqs`` itself), so that every small batch, where
    the attention kernel's threads are unevenly loaded, is measured at every context;
    prompt lengths 32, 256, 1024, 4096 up to the model length."""
    sc = config.scheduler
    if batch_sizes is None:
        batch_sizes = sorted({b for b in BATCH_SIZES if b < sc.max_num_seqs} | {sc.max_num_seqs})
    if prompt_lens is None:
        prompt_lens = [p for p in (32, 256, 1024, 4096) if p + output_len <= sc.max_model_len]
    key = 1 << 40
    phases = []
    for p in prompt_lens:
        for b in batch_sizes:
            if _fits(config, b, p, output_len):
                phases.append(_burst(f"grid-p{p}-b{b}", key, b, p, output_len, config.runner.vocab_size))
                key += b
    if config.cache.enable_prefix_caching:
        for p in prompt_lens:
            for b in batch_sizes:
                if p >= 256 and b > 1 and (b in SHARED_BATCH_SIZES or b == sc.max_num_seqs) \
                        and _fits_shared(config, b, p, 16 + output_len):
                    phases.append(_shared_burst(f"shared-p{p}-b{b}", key, b, p, output_len,
                                                config.runner.vocab_size))
                    key += b + 1
    return phases


def sampling_phases(config: Config, output_len: int = 16) -> list[Phase]:
    """Bursts that sample greedily, with top-k / top-p, and under a grammar (the grid's
    requests sample with temperature 1 and nothing else), at small and large batches."""
    sc = config.scheduler
    kinds: dict[str, dict[str, Any]] = {
        "greedy": {"temperature": 0.0}, "topk": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
        "grammar": {"temperature": 0.0, "structured_outputs": GRAMMAR}}
    key = 1 << 42
    phases = []
    for kind, sampling in kinds.items():
        for b in sorted({1, min(4, sc.max_num_seqs), min(32, sc.max_num_seqs)}):
            if _fits(config, b, 32, output_len):
                phases.append(_burst(f"{kind}-b{b}", key, b, 32, output_len, config.runner.vocab_size,
                                     sampling))
                key += b
    return phases


class RotateSwapped:
    """The swap phase's plugin: every ``every`` steps (while requests wait) the request
    running longest is preempted with its KV saved to host memory, so that a waiting one
    takes its seat and, in the small KV cache, the blocks it freed; it loads its KV back
    when it resumes."""

    def __init__(self, every: int = 6) -> None:
        self.every = every
        self.num_calls = 0

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request]) -> list[Preemption] | None:
        self.num_calls += 1
        if self.num_calls % self.every or not running:
            return None
        return [Preemption(running[0], "calibration", save_kv=True)]


def swap_config(config: Config, prompt_len: int = 256, output_len: int = 32) -> tuple[Config, Phase]:
    """The swap phase: ``config`` with a KV cache of about three requests' worth of
    blocks and the ``cpu-offload`` connector, and a burst of eight requests: running ones
    are preempted (for blocks, and by :class:`RotateSwapped`), their KV saved to host
    memory, and load it back when they resume."""
    sc, cc = config.scheduler, config.cache
    prompt_len = max(cc.block_size, min(prompt_len, sc.max_model_len // 4))
    blocks_per_req = -(-(prompt_len + output_len) // cc.block_size) + 1
    num_blocks = 3 * blocks_per_req + 1
    data = config.model_dump(mode="json", exclude={"compare"})
    data["cache"].update(num_blocks=num_blocks, enable_prefix_caching=True)
    data["scheduler"]["max_model_len"] = min(sc.max_model_len, (num_blocks - 1) * cc.block_size)
    data["plugins"] = [p for p in data["plugins"] if p["name"] != SWAP_PLUGIN] + [
        {"name": SWAP_PLUGIN, "settings": {"max_blocks": 64 * blocks_per_req}}]
    if data["runner"].get("device") == "cuda":
        data["runner"]["cuda_graph_max_batch_size"] = min(data["runner"]["cuda_graph_max_batch_size"], 16)
    lens = [prompt_len // 2, prompt_len, 3 * prompt_len // 4, prompt_len]
    vocab = config.runner.vocab_size
    reqs = [WorkloadRequest(f"swap-{i}", 0.0, token_run((1 << 43) + i, lens[i % 4], vocab), output_len)
            for i in range(8)]
    return config_from_dict(data, "<swap phase>"), Phase("swap", reqs)


def estimate_s(config: Config, model: CostModel, phase: Phase) -> float:
    """Seconds ``phase`` takes by the cost model: simulated on ``config``'s scheduler."""
    session = Session(config, SimulatedRunner(vocab_size=config.runner.vocab_size, cost_model=model))
    try:
        # The grammar's cost is not in the way.
        session.run(Phase(phase.name, phase.requests, is_timed=phase.is_timed))
        return session.engine.now() - session.engine.start_time
    finally:
        session.close()


def record_steps(config: Config, runner: Any = None, workload: list[WorkloadRequest] | None = None,
                 phases: Sequence[Phase] = ()) -> list[StepRecord]:
    """Replay a workload (default: the config's own) on one engine, then run each phase
    to completion in turn; return every step's features and duration on the engine
    clock."""
    session = Session(config, runner if runner is not None else _build_runner(config))
    try:
        if workload is None:
            workload = generate(config.workload, config.runner.vocab_size)
        session.run(Phase("workload", workload, is_timed=True))
        for phase in phases:
            session.run(phase)
        return session.records
    finally:
        session.close()


def _build_runner(config: Config) -> Any:
    from schedkit.engine.core import EngineCore

    return EngineCore._build_runner(config)


# -- the whole calibration ----------------------------------------------------------------
@dataclass(slots=True)
class _Clock:
    start: float
    budget_s: float

    @property
    def end(self) -> float:
        return self.start + self.budget_s

    def at(self, share: float) -> float:
        return self.start + share * self.budget_s


def calibrate(config: Config, *, budget_s: float = 600.0, workload: list[WorkloadRequest] | None = None,
              runner_factory: Callable[[Config], Any] | None = None,
              progress: Callable[[str], None] = lambda line: None) -> Calibration:
    """Record the configured runner's steps within ``budget_s`` seconds (wall time, model
    loading included) and fit the cost model (see the module docstring).

    Args:
        config: A config whose runner is a real one (a simulated one gives back its own
            profile: a check of the pipeline).
        budget_s: Wall-clock seconds for everything; phases that no longer fit are
            skipped or cut.
        workload: The first phase's requests (default: the config's workload).
        runner_factory: Builds a runner from a config (default: the engine's own way).
        progress: Called with one line per phase.

    Raises:
        ConfigError: The config's runner cannot be built or its workload read.
        ValueError: Too few steps were recorded to fit (a budget far too small).
    """
    clock = _Clock(time.monotonic(), budget_s)
    cpu_before = cpu_times()
    build = runner_factory or _build_runner
    fit_reserve = min(20.0, 0.05 * budget_s)
    swap_share = 0.2 * budget_s
    reports: list[PhaseReport] = []

    def note(report: PhaseReport) -> None:
        reports.append(report)
        progress(f"{report.name:<16} {report.status:<10} {report.num_steps:>5} steps "
                 f"{report.wall_s:7.1f} s" + (f" (predicted {report.estimate_s:.1f} s)"
                                               if report.estimate_s is not None else ""))

    runner = build(config)
    probe_spans: list[tuple[int, int]] = []
    device_name = getattr(runner, "device_name", None)
    workers = int(getattr(runner, "attention_workers", 0))
    is_virtual = bool(getattr(runner, "is_virtual_clock", False))
    progress(f"runner ready after {time.monotonic() - clock.start:.1f} s")
    session = Session(config, runner)
    try:
        if workload is None:
            workload = generate(config.workload, config.runner.vocab_size)
        note(session.run(Phase("workload", workload, is_timed=True), deadline=clock.at(0.25)))

        def probe(k: int, session: Session = session) -> None:  # the speed probe, its steps kept apart
            n0 = len(session.records)
            report = session.run(Phase(f"probe-{k}", probe_workload(config.runner.vocab_size, seed=k)),
                                 clock.end - swap_share - fit_reserve)
            note(report)
            if report.status == "ran":
                probe_spans.append((n0, len(session.records)))

        _run_grid(session, config, clock.end - swap_share - fit_reserve, is_virtual, note, probe)
        records = list(session.records)
    finally:
        session.close()
        del session, runner
        gc.collect()  # the swap phase's runner needs the memory (on a GPU, all of it)
    records += _run_swap(config, build, clock.end - fit_reserve, note)
    model = fit(records, attention_workers=workers)
    probed = [records[i] for a, b in probe_spans for i in range(a, b)]
    decode, prefill = probe_ratios_by_kind(probed, model)
    return Calibration(records, model, residuals(records, model), reports, time.monotonic() - clock.start,
                       budget_s, device_name, steal_share(cpu_before, cpu_times()),
                       probe_ratio(probed, model) if probed else None, len(probe_spans),
                       decode if math.isfinite(decode) else None, prefill if math.isfinite(prefill) else None)


def _run_grid(session: Session, config: Config, deadline: float, is_virtual: bool,
              note: Callable[[PhaseReport], None], probe: Callable[[int], None] = lambda k: None) -> None:
    """The grid and sampling bursts, cheapest first (by the cost model fitted so far),
    each only if it still fits before ``deadline``; a phase that overruns is cut there.
    ``probe(k)`` runs before each pass ``k``: the speed probe, spread over the fit's
    time so that its ratio to the fitted model is read at the calibration's mean speed."""
    config = session.config
    phases = grid_phases(config) + sampling_phases(config)
    estimates: dict[str, float] = {}
    if not is_virtual and len(session.records) >= 20:
        model = fit(session.records)
        estimates = {ph.name: estimate_s(config, model, ph) for ph in phases}
    order = sorted(range(len(phases)), key=lambda i: (
        estimates.get(phases[i].name, 0.0), sum(len(r.prompt_token_ids) for r in phases[i].requests)))
    ratios: list[float] = []  # measured / predicted so far: corrects the later predictions
    ran: list[tuple[Phase, float]] = []
    no_grammar = ""
    probe(0)
    for i in order:
        ph = phases[i]
        est = estimates.get(ph.name)
        if no_grammar and "structured_outputs" in ph.sampling:
            note(PhaseReport(ph.name, "skipped: no structured-output backend (above)", estimate_s=est))
            continue
        ratio = sum(ratios) / len(ratios) if ratios else 1.0
        if time.monotonic() + (est or 0.0) * ratio > deadline:
            note(PhaseReport(ph.name, "skipped: over budget", estimate_s=est))
            continue
        try:
            report = session.run(ph, deadline)
        except RequestError as e:  # its first request was refused
            why = _first_line(str(e))
            if "structured_outputs" in ph.sampling:
                no_grammar = why = f"no structured-output backend ({why})"
            note(PhaseReport(ph.name, f"skipped: {why}", estimate_s=est))
            continue
        report.estimate_s = est
        if est and report.status == "ran":
            ratios.append(report.wall_s / est)
        note(report)
        if report.status == "ran":
            ran.append((ph, report.wall_s))
    if not is_virtual:  # a simulated runner's steps are the same every time
        _repeat(session, ran, deadline, note, probe)


def _repeat(session: Session, ran: list[tuple[Phase, float]], deadline: float,
            note: Callable[[PhaseReport], None], probe: Callable[[int], None]) -> None:
    """With time left, the bursts that ran again (new prompts), pass after pass, each
    only if it fits before ``deadline`` by its last duration."""
    key, vocab = 1 << 45, session.engine.config.runner.vocab_size
    for k in range(1, GRID_PASSES):
        if ran and time.monotonic() + 1.2 * ran[0][1] <= deadline:
            probe(k)
        did = False
        for ph, wall_s in ran:
            if time.monotonic() + 1.2 * wall_s > deadline:
                continue
            reqs = []
            prefix = token_run(key, ph.shared_prefix, vocab)
            key += 1
            for r in ph.requests:
                prompt = prefix + token_run(key, len(r.prompt_token_ids) - ph.shared_prefix, vocab)
                reqs.append(WorkloadRequest(f"{r.request_id}-r{k}", r.arrival_time, prompt, r.max_tokens))
                key += 1
            note(session.run(Phase(f"{ph.name}-r{k}", reqs, ph.sampling, ph.is_timed, ph.shared_prefix),
                             deadline))
            did = True
        if not did:
            return


def _run_swap(config: Config, build: Callable[[Config], Any], deadline: float,
              note: Callable[[PhaseReport], None]) -> list[StepRecord]:
    """The swap phase on its own engine, repeated with new prompts while time is left
    (at most four rounds)."""
    if time.monotonic() + 5 > deadline:
        note(PhaseReport("swap", "skipped: over budget"))
        return []
    try:
        swap_cfg, phase = swap_config(config)
        session = Session(swap_cfg, build(swap_cfg), extra_plugins=[RotateSwapped()])
    except (SchedkitError, ValueError) as e:
        note(PhaseReport("swap", f"skipped: {_first_line(str(e))}"))
        return []
    try:
        for round_ in range(4):
            t0 = time.monotonic()
            reqs = [WorkloadRequest(f"{w.request_id}-r{round_}", 0.0,
                                    token_run((1 << 44) + 16 * round_ + j, len(w.prompt_token_ids),
                                              config.runner.vocab_size), w.max_tokens)
                    for j, w in enumerate(phase.requests)]
            report = session.run(Phase(f"swap-{round_}", reqs), deadline)
            note(report)
            if report.status != "ran" or time.monotonic() + (time.monotonic() - t0) > deadline:
                break
        return list(session.records)
    finally:
        session.close()
