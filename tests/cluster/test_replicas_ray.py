"""``replicas.backend: ray``: one Ray actor per replica on a real local Ray cluster (no
mock), its engine reached over ZMQ; one actor ``ray.kill``ed mid-run. And without Ray
installed, the backend's ConfigError says how to install it."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import zmq

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.engine.messages import UtilityCall, client_encoder
from schedkit.errors import ConfigError
from schedkit.llm import LLM, AsyncLLM
from tests.cluster.replica_runs import (
    DEATH,
    KILLED,
    check_kill_run,
    fake_config,
    fake_tokens,
    kill_mid_run,
    max_tokens,
    paged_config,
    paged_reference,
    prompt,
    sigstop,
    wait_gone,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # slow: Ray clusters


@pytest.fixture(scope="module")
def ray():
    """One local Ray cluster for the module (4 logical CPUs: one per replica's actor)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield ray
    if started:
        ray.shutdown()


def killed_with_its_engine(ray):
    """``after_detect``: the engine was stopped; let it run again and check that it
    leaves now that its actor is gone."""

    def check(handle):
        try:
            os.kill(handle.engine_pid, signal.SIGCONT)
        except ProcessLookupError:  # already gone with its actor
            pass
        assert wait_gone(handle.engine_pid), "the engine outlived its actor"
        assert wait_gone(handle.actor_pid)

    return check


def assert_cleaned_up(ray, handles):
    for h in handles:
        assert wait_gone(h.engine_pid) and wait_gone(h.actor_pid)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.actor.stop.remote(), timeout=30)


def test_async_kill_mid_run_through_ray(ray):
    n = 2000
    run = asyncio.run(kill_mid_run(fake_config("ray"), n, stop=lambda h: sigstop(h.engine_pid),
                                   kill=lambda h: ray.kill(h.actor), after_detect=killed_with_its_engine(ray)))
    check_kill_run(run, n, fake_tokens)
    assert_cleaned_up(ray, run.handles)
    reasons = {DEATH.fullmatch(f.error)[3] for f in run.finals.values() if f.finish_reason == "error"}
    assert reasons == {"its Ray actor was killed by ray.kill"}, reasons
    print(f"death detected {run.detect_s * 1e3:.0f} ms after ray.kill")


def test_a_dead_ray_worker_fails_its_requests_with_one_line_naming_the_replica(ray, caplog):
    """The actor's worker process killed (as the OOM killer would): each failed request's
    error is one short line naming the replica and the cause; Ray's paragraph about it
    is logged once."""
    n = 2000
    with caplog.at_level(logging.WARNING, logger="schedkit.cluster"):
        run = asyncio.run(kill_mid_run(fake_config("ray"), n, stop=lambda h: sigstop(h.engine_pid),
                                       kill=lambda h: os.kill(h.actor_pid, signal.SIGKILL),
                                       after_detect=killed_with_its_engine(ray)))
    check_kill_run(run, n, fake_tokens)
    errors = [f.error for f in run.finals.values() if f.finish_reason == "error"]
    assert errors and all(len(e) < 200 and "\n" not in e for e in errors), max(errors, key=len)
    assert all(e.startswith(f"replica {KILLED} (ray) died after") for e in errors)
    assert {DEATH.fullmatch(e)[3].partition(" (")[0] for e in errors} == {"its worker process died"}
    told = [r.getMessage() for r in caplog.records if "Ray says" in r.getMessage()]
    assert len(told) == 1 and "Worker exit type" in told[0], told
    assert_cleaned_up(ray, run.handles)


def test_a_ray_replica_refuses_a_client_without_its_keys(ray):
    """Each replica's engine admits only its front end's key for it: a plain client and
    one holding another replica's keys are refused and counted, and sending
    ``shutdown`` stops nothing."""

    async def main():
        async with await AsyncLLM.create(fake_config("ray")) as llm:
            handles = llm.core.replicas.handles
            ctx = zmq.Context()
            try:
                plain, borrowed = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
                handles[0].keys.secure_client(borrowed)
                for sock in (plain, borrowed):
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(handles[KILLED].input_addr)
                    sock.send(client_encoder.encode(UtilityCall(0, "shutdown", [])))
                deadline = asyncio.get_running_loop().time() + 20
                while True:
                    per = (await llm.call_utility("stats"))["replicas"]
                    if per[KILLED]["num_refused_connections"] >= 2 or asyncio.get_running_loop().time() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert per[KILLED]["num_refused_connections"] >= 2 and per[0]["num_refused_connections"] == 0
                for i in range(8):
                    outs = [d async for d in llm.generate([1, 2, i], SamplingParams(max_tokens=2, ignore_eos=True))]
                    assert outs[-1].finish_reason == "length"
                stats = await llm.call_utility("stats")
                assert [r["healthy"] for r in stats["replicas"]] == [True, True]
                assert stats["num_refused_connections"] >= 2
            finally:
                ctx.destroy(0)
        return list(handles)

    handles = asyncio.run(asyncio.wait_for(main(), 120))
    assert_cleaned_up(ray, handles)


def test_llm_generate_kill_mid_run_through_ray(ray):
    n = 2000
    with LLM(fake_config("ray")) as llm:
        core = llm._async.core
        handles = list(core.replicas.handles)
        assert {h.engine_pid for h in handles}.isdisjoint({os.getpid()})
        victim, replica = handles[KILLED], core.router.replicas[KILLED]
        done = threading.Event()

        def kill_when_mid_run():
            while replica.num_routed - replica.num_outstanding < 100 or replica.num_running == 0:
                if done.wait(0.005):
                    return
            ray.kill(victim.actor)

        killer = threading.Thread(target=kill_when_mid_run, daemon=True)
        killer.start()
        outs = llm.generate([prompt(i) for i in range(n)],
                            [SamplingParams(max_tokens=max_tokens(i), ignore_eos=True) for i in range(n)],
                            use_tqdm=False)
        done.set()
        killer.join(5)
        stats = llm.call_utility("stats")
        failed = [o for o in outs if o.finish_reason == "error"]
        for i, o in enumerate(outs):
            want = fake_tokens(o.request_id, max_tokens(i))
            if o.finish_reason == "error":
                m = DEATH.fullmatch(o.error)
                assert m and int(m[1]) == KILLED and int(m[2]) == len(o.output_token_ids) > 0, o.error
                assert o.output_token_ids == want[:len(o.output_token_ids)]
            else:
                assert o.finish_reason == "length" and o.output_token_ids == want
        assert failed and stats["router"]["num_failed_by_death"] == len(failed)
        assert stats["router"]["num_rerouted"] > 0
        assert [r["healthy"] for r in stats["replicas"]] == [True, False]
        assert wait_gone(victim.engine_pid)  # the actor's death took its engine
    assert_cleaned_up(ray, handles)


def test_replica_resources_reach_ray(ray):
    """Each replica's actor holds replicas.num_cpus (here 2 of the 4: both fit, a third
    would not) and the engine runs beside it, bound on loopback (same node)."""
    cfg = fake_config("ray", num_cpus=2)

    async def main():
        async with await AsyncLLM.create(cfg) as llm:
            deadline = asyncio.get_running_loop().time() + 30  # the resource view catches up
            while ray.available_resources().get("CPU", 0) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            assert ray.available_resources().get("CPU", 0) == 0
            handles = list(llm.core.replicas.handles)
            assert all(h.input_addr.startswith("tcp://127.0.0.1:") for h in handles)
            outs = [d async for d in llm.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                                  request_id="x")]
            assert outs[-1].finish_reason == "length"
        return handles

    handles = asyncio.run(asyncio.wait_for(main(), 120))
    assert_cleaned_up(ray, handles)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.timeout(1200)
def test_paged_model_kill_mid_run_through_ray(ray):
    """As test_replicas_local's paged test (``SCHEDKIT_PAGED_KILL_REQUESTS`` too), the
    replica's Ray actor killed."""
    n = int(os.environ.get("SCHEDKIT_PAGED_KILL_REQUESTS", "200"))
    expected = paged_reference(n)
    run = asyncio.run(kill_mid_run(paged_config("ray"), n, stop=lambda h: sigstop(h.engine_pid),
                                   kill=lambda h: ray.kill(h.actor), after_detect=killed_with_its_engine(ray),
                                   min_done=20))
    check_kill_run(run, n, expected)
    assert_cleaned_up(ray, run.handles)


def test_disaggregated_through_ray_equals_one_colocated_engine(ray):
    """One prefill and one decode replica as Ray actors: the KV travels through the front
    end as between local processes, and greedy tokens equal one engine's."""
    from tests.cluster.test_disagg_replicas import (
        ALWAYS,
        ROLES,
        colocated,
        paged_base,
        random_prompts,
    )

    base = paged_base(num_speculative_tokens=2)
    prompts = random_prompts(8, seed=21)
    sps = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)
    cfg = config_from_dict({**base, "replicas": {"count": 2, "backend": "ray", "roles": ROLES}, "router": ALWAYS})
    with LLM(cfg) as llm:
        got = [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        stats = llm.call_utility("stats")
    assert got == want
    kv = stats["kv_transfer"]
    assert kv["num_handoffs"] == len(prompts) and kv["num_bytes"] > 0 and kv["fallbacks"] == {}
    assert all(r["kv_transfer_held_blocks"] == 0 and r["kv_cache_usage"] == 0.0 for r in stats["replicas"])


def test_requests_moved_between_ray_replicas_equal_one_engine(ray, install_plugin):
    """Live migration between two Ray actors' engines: the tiny paged model, moved at
    random steps, greedy tokens equal one engine's."""
    from tests.cluster.test_disagg_replicas import colocated, paged_base, random_prompts
    from tests.cluster.test_migration_replicas import RANDOM_MOVES

    install_plugin("random_moves", RANDOM_MOVES, {"random-moves": "random_moves:RandomMoves"})
    base = paged_base()
    prompts = random_prompts(8, seed=22)
    sps = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)
    cfg = config_from_dict({**base, "replicas": {"count": 2, "backend": "ray"}, "router": {
        "policy": "round-robin", "migration_interval_s": 0.02,
        "plugins": [{"name": "random-moves", "settings": {"seed": 5, "share": 0.5}}]}})
    with LLM(cfg) as llm:
        got = [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        stats = llm.call_utility("stats")
    assert got == want
    assert stats["migration"]["num_migrated"] >= 2 and stats["migration"]["fallbacks"] == {}


def test_ray_backend_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    cfg = config_from_dict({"replicas": {"count": 2, "backend": "ray"}})
    children_before = _children()
    with pytest.raises(ConfigError, match=r"replicas.backend: ray.*pip install -e '\.\[cluster\]'"):
        LLM(cfg)

    async def main():
        await AsyncLLM.create(cfg)

    with pytest.raises(ConfigError, match=r"pip install"):
        asyncio.run(main())
    assert _children() == children_before  # nothing was started


def test_replicas_a_new_local_cluster_cannot_hold_are_refused_at_once():
    """With no ray_address the front end starts a local cluster; replicas that cannot fit
    it would wait forever, so they are a ConfigError (in a fresh process: this module's
    cluster is already connected)."""
    pytest.importorskip("ray")
    code = (
        "from schedkit.config import config_from_dict\n"
        "from schedkit.llm import LLM\n"
        "from schedkit.errors import ConfigError\n"
        "import ray\n"
        "try:\n"
        "    LLM(config_from_dict({'replicas': {'count': 2, 'backend': 'ray', 'num_cpus': 10000}}))\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
        "print('connected:', ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: replicas: 2 replicas with num_cpus=10000" in out.stdout, out.stdout + out.stderr
    assert "CPU: 20000 needed" in out.stdout and "connected: False" in out.stdout


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(d))
    return out


RAY_WORKER_DEATH = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: EngineHost\n"
    "\tactor_id: 63c8dbb2d4d67125570368a801000000\n\tpid: 5723\n\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
    "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common "
    "causes include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray "
    "stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another "
    "unexpected error. If the process was killed by the kernel OOM killer (verifiable by checking for "
    "OOM in dmesg of the OOMing node), consider enabling resource isolation.")
"""Ray 2.60's text for an actor whose worker process was SIGKILLed."""


@pytest.mark.parametrize(("text", "cause"), [
    (RAY_WORKER_DEATH,
     "its worker process died (SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2)"),
    ("The actor died unexpectedly before finishing this task.\n\tpid: 1\n"
     "The actor is dead because it was killed by `ray.kill`.", "its Ray actor was killed by ray.kill"),
    ("The actor is dead because its node has died. Node ID: abc. More text.",
     "its Ray actor died (its node has died)"),
    ("x" * 500, "its Ray actor died (" + "x" * 117 + "...)"),
])
def test_ray_actor_death_causes_are_one_short_line(text, cause):
    from schedkit.cluster.replicas import actor_death_cause

    assert actor_death_cause(text) == cause


def test_a_ray_replica_off_the_front_end_node_needs_engine_host_node():
    from schedkit.cluster.replicas import _engine_host

    cfg = fake_config("ray")
    assert _engine_host(cfg, "10.0.0.5", "10.0.0.5") == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"replicas.engine_host: loopback.*node 10.0.0.7.*"
                                          r"set replicas.engine_host: node"):
        _engine_host(cfg, "10.0.0.7", "10.0.0.5")
    assert _engine_host(fake_config("ray", engine_host="node"), "10.0.0.7", "10.0.0.5") == "10.0.0.7"
    with pytest.raises(ConfigError, match="replicas.engine_host only apply with backend: ray"):
        config_from_dict({"replicas": {"count": 2, "engine_host": "node"}})
