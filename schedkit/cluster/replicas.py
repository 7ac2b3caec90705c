"""Where a cluster's engines run: the ``replicas.backend`` of the YAML.

- ``local``: one engine-core process per replica on this machine (an
  :class:`~schedkit.engine.process.EngineProcess` each, over ``replicas.transport``).
- ``ray``: one Ray actor per replica, holding ``replicas.num_cpus``, ``num_gpus`` and
  ``resources`` (so Ray places it, e.g. one GPU each, and sets its
  ``CUDA_VISIBLE_DEVICES``). The actor starts the engine-core process beside it, bound
  over TCP on loopback (on another node: that node's IP, with ``replicas.engine_host:
  node``), and hands back the addresses; the front end then talks to the engine over ZMQ
  exactly as to a local one. The front end makes each replica's keys and sends the
  engine's part with the start call, so only the front end can talk to its engines.
  The engine leaves when its actor goes (stdin EOF, parent-pid watch), so
  ``ray.kill(actor)`` takes the engine with it.

Every replica handle offers what a connection needs (``input_addr``, ``output_addr``,
``is_alive()``, ``death_reason()``, ``shutdown()``). Ray is imported only here, and only
for ``backend: ray`` (:func:`~schedkit.cluster.ray_util.require_ray`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from schedkit.config import Config
from schedkit.engine.auth import EngineKeys
from schedkit.engine.client import EngineHandle
from schedkit.engine.process import START_ERRORS, START_TIMEOUT_S, EngineProcess
from schedkit.errors import ConfigError, EngineDeadError, SchedkitError

log = logging.getLogger("schedkit.cluster")

RAY_PLACEMENT_TIMEOUT_S = START_TIMEOUT_S + 60.0
"""How long a Ray replica may take to be placed and start its engine."""
DEATH_CAUSE_CHARS = 120
"""The most of Ray's own words a replica's death reason quotes (its full text is logged)."""


def _check_config(config: Config) -> None:
    """Fail on a bad engine config before any replica starts (EngineProcess's checks)."""
    from schedkit.plugins.manager import get_plugin_manager
    from schedkit.runners import configured_runner_class

    get_plugin_manager(config)
    configured_runner_class(config)


class ReplicaSet(abc.ABC):
    """The started replicas of one cluster, by index.

    Attributes:
        backend: ``local`` or ``ray``.
        handles: One per replica, index order.
    """

    backend = "?"

    def __init__(self, handles: Sequence[EngineHandle]) -> None:
        self.handles = list(handles)

    def __len__(self) -> int:
        return len(self.handles)

    @abc.abstractmethod
    def wait_ready(self) -> None:
        """Block until every replica's engine answers ready (they start in parallel).

        Raises:
            ConfigError, PluginError: A replica's engine refused the config.
            EngineDeadError: A replica failed to start (then all are shut down).
        """

    def shutdown(self) -> None:
        """Stop every replica (those already dead too); never raises."""
        for h in self.handles:
            try:
                h.shutdown()
            except Exception:  # one stuck replica must not keep the others running
                log.exception("shutting a replica down failed")


class LocalReplicas(ReplicaSet):
    """Engine-core processes on this machine (``handles`` are EngineProcess objects)."""

    backend = "local"
    handles: list[EngineProcess]  # type: ignore[assignment]

    @classmethod
    def spawn(cls, config: Config) -> LocalReplicas:
        """Start the processes (from the calling thread: the engines' parent-death
        signal follows it); :meth:`wait_ready` waits for them."""
        procs: list[EngineProcess] = []
        try:
            for _ in range(config.replicas.count):
                procs.append(EngineProcess(config, transport=config.replicas.transport, wait=False))
        except BaseException:
            for p in procs:
                p.shutdown()
            raise
        return cls(procs)

    def wait_ready(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self.handles)) as pool:
            futures = [pool.submit(p.wait_ready) for p in self.handles]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            self.shutdown()
            raise first


class EngineHost:
    """The Ray actor of one replica (wrapped with ``ray.remote`` at start-up, so this
    module imports without Ray): it starts and owns the replica's engine process."""

    def __init__(self) -> None:
        self.engine: EngineProcess | None = None

    def start(self, config_json: dict[str, Any], driver_ip: str, keys: dict[str, str]) -> tuple[Any, ...]:
        """Start the engine with the engine's part of the replica's keys; ``("ready",
        input_addr, output_addr, engine_pid, actor_pid)`` or ``("error", error type,
        message)``."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        try:
            config = Config.model_validate(config_json)
            host = _engine_host(config, node_ip, driver_ip)
            self.engine = EngineProcess(config, transport="tcp", host=host,
                                        keys=EngineKeys.from_engine_part(keys))
        except SchedkitError as e:
            return ("error", type(e).__name__, str(e))
        return ("ready", self.engine.input_addr, self.engine.output_addr, self.engine.pid, os.getpid())

    def wait_exit(self) -> int | None:
        """Return once the engine process exited (its exit code)."""
        if self.engine is None:
            return None
        return self.engine.proc.wait()

    def stop(self) -> bool:
        if self.engine is not None:
            self.engine.shutdown()
        return True


def _engine_host(config: Config, node_ip: str, driver_ip: str) -> str:
    """The address a Ray replica's engine binds on node ``node_ip`` (``replicas.engine_host``).

    Raises:
        ConfigError: ``loopback`` on a node other than the front end's.
    """
    if node_ip == driver_ip:
        return "127.0.0.1"
    if config.replicas.engine_host == "node":
        return node_ip
    raise ConfigError(f"replicas.engine_host: loopback, but this replica runs on node {node_ip}, not "
                      f"on the front end's ({driver_ip}), which could not reach it there; set "
                      "replicas.engine_host: node to bind that node's IP (docs/cluster.md)")


class RayReplica:
    """One replica on Ray: its actor and the addresses of the engine it started.

    Attributes:
        actor: The Ray actor handle (``ray.kill(replica.actor)`` kills the replica).
        keys: The replica's keys (made here; the engine got its part).
        engine_pid, actor_pid: Process ids on the actor's node (set once ready).
    """

    def __init__(self, ray: Any, actor: Any, index: int, start_ref: Any, keys: EngineKeys) -> None:
        self._ray = ray
        self.actor = actor
        self.index = index
        self.keys = keys
        self._start_ref = start_ref
        self._exit_ref: Any = None
        self._death: str | None = None
        self.input_addr = ""
        self.output_addr = ""
        self.engine_pid: int | None = None
        self.actor_pid: int | None = None

    def wait_ready(self, what: str) -> None:
        ray = self._ray
        try:
            answer = ray.get(self._start_ref, timeout=RAY_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise EngineDeadError(
                f"replica {self.index}: its Ray actor did not start in {RAY_PLACEMENT_TIMEOUT_S:.0f} s "
                f"(each replica needs {what}; the cluster has {ray.available_resources()} free)") from None
        except ray.exceptions.RayError as e:
            raise EngineDeadError(f"replica {self.index}: its Ray actor failed to start: "
                                  f"{str(e).splitlines()[0]}") from None
        if answer[0] != "ready":
            _, kind, message = answer
            typed = START_ERRORS.get(kind)
            if typed is not None:
                raise typed(message)
            raise EngineDeadError(f"replica {self.index}: {message}")
        _, self.input_addr, self.output_addr, self.engine_pid, self.actor_pid = answer
        self._exit_ref = self.actor.wait_exit.remote()

    def is_alive(self) -> bool:
        if self._exit_ref is None:
            return True
        ready, _ = self._ray.wait([self._exit_ref], timeout=0)
        return not ready

    def death_reason(self) -> str:
        """One line: what happened to the actor or its engine (Ray's full text is logged,
        once)."""
        if self._death is not None:
            return self._death
        ray = self._ray
        try:
            code = ray.get(self._exit_ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            log.warning("replica %d (ray): its actor died; Ray says: %s", self.index, e)
            self._death = actor_death_cause(str(e))
            return self._death
        except ray.exceptions.RayError as e:
            return f"its Ray actor failed: {_clip(str(e).splitlines()[0])}"
        return f"the engine process of its Ray actor exited (code {code})"

    def shutdown(self, timeout: float = 5.0) -> None:
        ray = self._ray
        try:
            ray.get(self.actor.stop.remote(), timeout=timeout)
        except ray.exceptions.RayError:
            pass  # dead already, or stuck: killed below
        ray.kill(self.actor, no_restart=True)


def _clip(text: str, limit: int = DEATH_CAUSE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def actor_death_cause(ray_text: str) -> str:
    """Ray's account of an actor's death (a RayActorError's text, a paragraph) in one
    short line: ``its worker process died (SYSTEM_ERROR: Worker unexpectedly exits with a
    connection error code 2)``, ``its Ray actor was killed by ray.kill``, else ``its Ray
    actor died (...)`` with the first sentence of Ray's reason."""
    lines = [ln.strip() for ln in ray_text.splitlines() if ln.strip()]
    because = next((ln for ln in lines if ln.startswith("The actor is dead because")), None)
    if because is None:
        return f"its Ray actor died ({_clip(lines[0] if lines else 'no reason given')})"
    reason = because.removeprefix("The actor is dead because").strip()
    if reason.startswith("its worker process has died"):
        kind = re.search(r"Worker exit type: (\S+)", reason)
        detail = re.search(r"Worker exit detail: (.+?)(?:\.\s|\.?$)", reason)
        cause = ": ".join(m[1] for m in (kind, detail) if m) or "no detail"
        return f"its worker process died ({_clip(cause)})"
    if "killed by `ray.kill`" in reason:
        return "its Ray actor was killed by ray.kill"
    return f"its Ray actor died ({_clip(reason.split('. ')[0].rstrip('.'))})"


def _check_fits(ray: Any, config: Config, started: bool) -> None:
    """Refuse replicas a cluster we just started can never hold (their actors would wait
    for resources forever); on a cluster we joined (it may autoscale), only warn."""
    rc = config.replicas
    demand = {"CPU": rc.num_cpus, "GPU": rc.num_gpus, **rc.resources}
    total = ray.cluster_resources()
    short = {k: f"{v * rc.count:g} needed, {total.get(k, 0):g} there" for k, v in demand.items()
             if v and v * rc.count > total.get(k, 0) + 1e-9}
    if not short:
        return
    message = (f"replicas: {rc.count} replicas with num_cpus={rc.num_cpus:g}, num_gpus={rc.num_gpus:g}"
               + (f", resources={dict(rc.resources)}" if rc.resources else "")
               + f" do not fit the Ray cluster ({'; '.join(f'{k}: {v}' for k, v in short.items())})")
    if started:
        raise ConfigError(f"{message}: lower replicas.num_cpus / num_gpus, or start a cluster "
                          "that has them (ray start --head ...) and set replicas.ray_address")
    log.warning("%s; the actors wait until the cluster has room", message)


class RayReplicas(ReplicaSet):
    """One actor per replica on a Ray cluster (``handles`` are RayReplica objects)."""

    backend = "ray"
    handles: list[RayReplica]  # type: ignore[assignment]

    def __init__(self, handles: Sequence[RayReplica], ray: Any, started_ray: bool, what: str) -> None:
        super().__init__(handles)
        self._ray = ray
        self.started_ray = started_ray
        """This front end connected to Ray (and disconnects at shutdown)."""
        self._what = what

    @classmethod
    def spawn(cls, config: Config) -> RayReplicas:
        """Connect to Ray (``replicas.ray_address``, or a new local cluster) and create the
        actors; :meth:`wait_ready` waits for their engines.

        Raises:
            ConfigError: Ray is not installed (the message says how to install it), or
                the cluster cannot be reached.
        """
        from schedkit.cluster.ray_util import init_ray, require_ray

        ray = require_ray("replicas.backend: ray")
        rc = config.replicas
        started = init_ray(rc.ray_address)
        handles: list[RayReplica] = []
        try:
            _check_fits(ray, config, started)
            actor_cls = ray.remote(EngineHost)
            driver_ip = ray.util.get_node_ip_address()
            config_json = config.model_dump(mode="json")
            for i in range(rc.count):
                actor = actor_cls.options(num_cpus=rc.num_cpus, num_gpus=rc.num_gpus,
                                          resources=dict(rc.resources) or None,
                                          max_concurrency=4, max_restarts=0).remote()
                keys = EngineKeys.generate()
                start = actor.start.remote(config_json, driver_ip, keys.engine_part())
                handles.append(RayReplica(ray, actor, i, start, keys))
        except BaseException:
            for h in handles:  # on a cluster we joined, they would outlive us
                try:
                    ray.kill(h.actor)
                except Exception:  # already gone
                    pass
            if started:
                ray.shutdown()
            raise
        what = f"num_cpus={rc.num_cpus}, num_gpus={rc.num_gpus}" + (
            f", resources={dict(rc.resources)}" if rc.resources else "")
        return cls(handles, ray, started, what)

    def wait_ready(self) -> None:
        try:
            for h in self.handles:
                h.wait_ready(self._what)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        super().shutdown()
        if self.started_ray:
            self.started_ray = False
            self._ray.shutdown()


def spawn_replicas(config: Config) -> ReplicaSet:
    """Start ``config.replicas.count`` replicas of ``config`` on its backend (without
    waiting for them: :meth:`ReplicaSet.wait_ready`). The config is checked first, so a
    bad YAML, a plugin that is not installed or a missing Ray starts nothing.

    Raises:
        ConfigError, PluginError: As above.
    """
    _check_config(config)
    if config.replicas.backend == "ray":
        return RayReplicas.spawn(config)
    return LocalReplicas.spawn(config)
