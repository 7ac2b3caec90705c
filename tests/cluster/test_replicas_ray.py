"""``replicas.backend: ray``: one Ray actor per replica on a real local Ray cluster (no
mock), its engine reached over ZMQ; one actor ``ray.kill``ed mid-run. And without Ray
installed, the backend's ConfigError says how to install it."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.engine.client import LLM, AsyncLLM
from schedkit.errors import ConfigError
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

pytestmark = pytest.mark.timeout(180)


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
    assert len(reasons) == 1 and reasons.pop().startswith("its Ray actor died"), reasons
    print(f"death detected {run.detect_s * 1e3:.0f} ms after ray.kill")


def test_llm_generate_kill_mid_run_through_ray(ray):
    n = 2000
    with LLM(fake_config("ray")) as llm:
        assert llm._replicated is not None
        core = llm._replicated[1].core
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
        "from schedkit.engine.client import LLM\n"
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
