"""EngineCore: schedule -> runner.execute -> update_from_output, in-process.

The engine owns the scheduler clock: with a runner that reports step durations (the
fake runner and the simulator) time is virtual and advances by each step's duration,
so a long workload replays in seconds; otherwise it is wall-clock time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from schedkit.config import Config
from schedkit.core.outputs import EngineCoreOutputs
from schedkit.core.request import Request, RequestStatus
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import describe_plugins, get_plugin_manager
from schedkit.runners import runner_class


class EngineCore:
    """Args:
        config: The whole validated config.
        runner: A ready runner; by default one is built from ``config.runner``.
        extra_plugins: Plugin objects registered after the configured ones.
    """

    def __init__(self, config: Config, *, runner: Any = None, extra_plugins: Iterable[Any] = ()) -> None:
        self.config = config
        self.plugin_manager = get_plugin_manager(config, extra_plugins=extra_plugins)
        self.runner = runner if runner is not None else self._build_runner(config)
        self._virtual = hasattr(self.runner, "step_time_s")
        self._now = 0.0
        num_blocks = self.runner.initialize(config.cache.num_blocks, config.cache.block_size)
        cache_cfg = config.cache.model_copy(update={"num_blocks": num_blocks})
        self.scheduler = Scheduler(config.scheduler, cache_cfg, HookFacade(self.plugin_manager),
                                   clock=self.now)
        self.num_steps = 0

    @staticmethod
    def _build_runner(config: Config) -> Any:
        cls = runner_class(config.runner.kind)
        return cls.from_config(config)

    # -- clock ---------------------------------------------------------------------------
    def now(self) -> float:
        return self._now if self._virtual else time.monotonic()

    def advance_to(self, t: float) -> None:
        """Move the virtual clock forward (idle time before the next arrival)."""
        if self._virtual and t > self._now:
            self._now = t

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; returns outputs per client index (empty when idle)."""
        sched = self.scheduler
        if not sched.has_requests():
            return {}
        scheduler_output = sched.schedule()
        runner_output = self.runner.execute(scheduler_output)
        if self._virtual and runner_output.step_duration is not None:
            self._now += runner_output.step_duration
        outputs = sched.update_from_output(scheduler_output, runner_output)
        if sched.num_spec_tokens:
            sched.update_draft_token_ids(self.runner.propose_draft_token_ids(sched.num_spec_tokens))
        self.num_steps += 1
        return outputs

    # -- utility calls -------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def list_plugins(self) -> list[tuple[str, list[str]]]:
        return describe_plugins(self.plugin_manager)

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        kv = sched.kv_cache_manager
        return {
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "kv_cache_usage": kv.usage, "num_preemptions": sched.num_preemptions_total,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate, "num_steps": self.num_steps,
        }
