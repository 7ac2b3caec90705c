"""The engine process behind real sockets: same outputs as in-process, load, faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from schedkit import hookimpl
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.client import EngineClient, EngineProcess, wire_request
from schedkit.engine.core import EngineCore
from schedkit.errors import ConfigError, EngineDeadError
from schedkit.llm import LLM

from .conftest import raw_client


def prompts_and_params(n=24):
    prompts = [[(7 * i + j) % 50 + 3 for j in range(5 + (i * 11) % 40)] for i in range(n)]
    shared = list(range(100, 116))
    prompts += [shared + [i] for i in range(6)]  # prefix hits
    params = [SamplingParams(max_tokens=4 + (i * 5) % 30) for i in range(len(prompts))]
    return prompts, params


class ChunkWatcher:
    """Records every step's scheduled token counts (to show chunked prefill happened)."""

    def __init__(self):
        self.steps = []

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output):
        self.steps.append(dict(scheduler_output.num_scheduled_tokens))


def run_in_process(config, prompts, params, priorities, watcher=None):
    engine = EngineCore(config, extra_plugins=[watcher] if watcher else ())
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        req = Request(f"0-{i}", p, sp, arrival_time=engine.now(), priority=priorities[i])
        engine.add_request(req)
        reqs.append(req)
    while engine.has_requests():
        engine.step()
    return reqs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_process_gives_same_outputs_as_in_process(small_config, policy):
    config = small_config(policy)
    prompts, params = prompts_and_params()
    priorities = [i % 3 for i in range(len(prompts))]
    watcher = ChunkWatcher()
    expected = run_in_process(config, prompts, params, priorities, watcher)
    with LLM(config) as llm:
        outs = llm.generate(prompts, params, priorities=priorities, use_tqdm=False)
    assert [o.request_id for o in outs] == [r.request_id for r in expected]
    for o, r in zip(outs, expected, strict=True):
        assert o.output_token_ids == r.output_token_ids
        assert o.finish_reason == r.get_finished_reason()
        assert o.metrics.num_preemptions == r.num_preemptions
        assert o.metrics.num_cached_tokens == r.num_cached_tokens
    assert sum(r.num_preemptions for r in expected) > 0, "the workload must preempt"
    chunks = {rid for step in watcher.steps for rid, n in step.items() if n == 16}
    long_prompts = {f"0-{i}" for i, p in enumerate(prompts) if len(p) > 16}
    assert chunks & long_prompts, "the workload must chunk long prefills (threshold 16)"
    assert any(r.num_cached_tokens > 0 for r in expected), "the workload must hit the prefix cache"


def test_ten_thousand_requests_from_four_clients():
    config = config_from_dict({"cache": {"num_blocks": 4096, "block_size": 16},
                               "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}})
    engine = EngineProcess(config)
    results: dict[int, dict[str, list]] = {}
    errors = []

    def client_main(c: int) -> None:
        try:
            client = EngineClient(engine.input_addr, engine.output_addr, engine=engine)
            mine = {f"c{c}-{i}": [] for i in range(2500)}
            ids = list(mine)
            for start in range(0, len(ids), 500):
                client.add_requests([wire_request(rid, [c + 3, i % 97 + 3, 5], SamplingParams(max_tokens=1 + i % 3))
                                     for i, rid in enumerate(ids[start:start + 500], start)])
            finished = 0
            while finished < len(ids):
                batch = client.recv(timeout=5)
                assert batch is not None, "stalled"
                for o in batch.outputs:
                    mine[o.request_id].append(o)
                    finished += o.finish_reason is not None
            results[c] = mine
            client.close()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client_main, args=(c,)) for c in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.shutdown()
    assert not errors, errors
    assert sum(len(m) for m in results.values()) == 10_000
    for mine in results.values():
        for rid, outs in mine.items():
            i = int(rid.split("-")[1])
            finishes = [o for o in outs if o.finish_reason is not None]
            assert len(finishes) == 1 and outs[-1] is finishes[0], rid
            assert sum(len(o.new_token_ids) for o in outs) == 1 + i % 3, rid


def test_killed_engine_raises_engine_dead_error_quickly():
    llm = LLM(config_from_dict({"cache": {"num_blocks": 4096}, "scheduler": {"max_model_len": 100000}}))
    box = {}

    def call():
        t0 = time.monotonic()
        try:
            llm.generate([[5] * 50] * 64, SamplingParams(max_tokens=90000), use_tqdm=False)
        except EngineDeadError as e:
            box["err"], box["after"] = e, time.monotonic() - t0

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    os.kill(llm.engine.pid, signal.SIGKILL)
    t.join(10)
    llm.close()
    assert isinstance(box.get("err"), EngineDeadError)
    assert time.monotonic() - killed_at < 5


def test_malformed_message_is_dropped_and_engine_keeps_serving(small_config):
    with LLM(small_config()) as llm:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        llm.engine.keys.secure_client(raw)
        raw.connect(llm.engine.input_addr)
        raw.send(b"\x93not msgpack of ours")
        raw.send_multipart([b"two", b"frames"])
        raw.close(linger=2000)  # deliver before closing
        ctx.term()
        outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 3
        assert llm.call_utility("stats")["num_malformed_messages"] == 2


def test_the_engine_process_freezes_its_start_up_heap_and_still_collects_garbage(small_config):
    # The start-up objects (imports, runner, plugins) sit in the permanent generation, so the
    # collector's full passes skip them; what serving allocates is still collected.
    with LLM(small_config()) as llm:
        frozen = llm.call_utility("stats")["num_gc_frozen_objects"]
        assert frozen > 1000
        for _ in range(3):
            outs = llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=4), use_tqdm=False)
            assert all(len(o.output_token_ids) == 4 for o in outs)
        # frozen objects freed by reference counting leave the permanent generation; nothing joins it
        assert 0.9 * frozen <= llm.call_utility("stats")["num_gc_frozen_objects"] <= frozen


def test_freeze_startup_heap_leaves_later_garbage_collectable():
    import gc
    import weakref

    from schedkit.engine.gc_heap import freeze_startup_heap

    try:
        assert freeze_startup_heap() >= gc.get_freeze_count() > 0

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_invalid_requests_fail_alone(small_config):
    with LLM(small_config()) as llm, raw_client(llm) as client:
        good = wire_request("good", [1, 2, 3], SamplingParams(max_tokens=2))
        too_long = wire_request("long", [1] * 200, SamplingParams(max_tokens=2))
        bad_params = wire_request("bad", [1, 2], SamplingParams(max_tokens=2))
        bad_params = type(bad_params)(bad_params.request_id, bad_params.prompt_token_ids,
                                      type(bad_params.sampling_params)(max_tokens=0))
        client.add_requests([good, too_long, bad_params, wire_request("good", [4], SamplingParams())])
        seen: dict[str, list] = {}
        num_finished = 0
        while num_finished < 4:
            batch = client.recv(timeout=5)
            assert batch is not None, seen
            for o in batch.outputs:
                if o.finish_reason is not None:
                    seen.setdefault(o.request_id, []).append(o)
                    num_finished += 1
        assert "max_model_len" in seen["long"][0].error
        assert "max_tokens" in seen["bad"][0].error
        good_outs = seen["good"]
        assert {o.finish_reason for o in good_outs} == {"error", "length"}
        assert any("duplicate" in (o.error or "") for o in good_outs)


def test_abort_frees_kv_blocks_and_shutdown_cleans_up():
    # Steps sleep 2 ms: no request can reach its 8,136-token cap (and finish "length")
    # before the abort, however slowly this process is scheduled.
    config = config_from_dict({"cache": {"num_blocks": 512, "block_size": 16},
                               "scheduler": {"max_model_len": 100000},
                               "runner": {"clock": "wall", "step_time_ms": 2}})
    llm = LLM(config)
    try:
        with raw_client(llm) as client:
            _abort_all_and_close(llm, client)
    finally:
        llm.close()


def _abort_all_and_close(llm: LLM, client: EngineClient) -> None:
    client.add_requests([wire_request(f"r{i}", [i + 3] * 40, SamplingParams(max_tokens=90000))
                         for i in range(8)])
    pending: list = []
    for _ in range(100):  # the adds and this call may be handled before the first step
        stats = client.call_utility("stats", pending=pending)
        if stats["num_free_blocks"] < 511:
            break
    assert stats["num_running"] + stats["num_waiting"] == 8 and stats["num_free_blocks"] < 511
    client.abort([f"r{i}" for i in range(8)])
    finished: dict[str, str] = {}
    deadline = time.monotonic() + 10
    while len(finished) < 8 and time.monotonic() < deadline:
        for batch in pending + [client.recv(timeout=1) or type(pending)()]:
            for o in getattr(batch, "outputs", ()):
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
        pending = []
    assert finished == {f"r{i}": "abort" for i in range(8)}
    stats = client.call_utility("stats")
    assert stats["num_free_blocks"] == 511 and stats["num_running"] == 0
    pid = llm.engine.pid
    paths = [p for p in llm.engine._paths]
    assert all(p.exists() for p in paths)
    llm.close()
    assert llm.engine.exitcode is not None
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert not any(p.exists() for p in paths)


@pytest.mark.parametrize("text,needle", [
    ("scheduler: {policy: nope}\n", "nope"),
    ("plugins: [{name: not-installed}]\n", "not-installed"),
    ("cache: {block_size: many}\n", "cache.block_size"),
    ("runner: {kindd: fake}\n", "runner.kindd"),
])
def test_bad_yaml_stops_before_any_process(tmp_path, monkeypatch, text, needle):
    def no_spawn(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        LLM(cfg)


def test_engine_exits_and_cleans_up_when_its_parent_dies(tmp_path):
    """A client process killed without shutdown: the engine notices, exits, removes its
    socket files and their directory."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from schedkit.config import Config\n"
        "from schedkit.engine.client import EngineProcess\n"
        "e = EngineProcess(Config())\n"
        "print(e.pid, e.input_addr, e.output_addr, flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid, *addrs = parent.stdout.readline().split()
    paths = [a.removeprefix("ipc://") for a in addrs]
    assert all(os.path.exists(p) for p in paths)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert not any(os.path.exists(p) for p in paths)
    assert not os.path.exists(os.path.dirname(paths[0]))  # their private directory too


def test_a_bad_utility_argument_raises_its_own_type():
    from schedkit.config import config_from_dict
    from schedkit.errors import ConfigError
    from schedkit.llm import LLM

    with LLM(config_from_dict({})) as llm:
        with pytest.raises(ConfigError, match="pause state must be one of"):
            llm.call_utility("set_pause_state", "banana")
        assert llm.call_utility("stats")["pause_state"] == "unpaused"


def test_async_llm_utility_errors_keep_their_type():
    import asyncio

    from schedkit.config import config_from_dict
    from schedkit.errors import ConfigError
    from schedkit.llm import AsyncLLM

    async def main():
        llm = await AsyncLLM.create(config_from_dict({}))
        try:
            with pytest.raises(ConfigError, match="pause state must be one of"):
                await llm.call_utility("set_pause_state", "banana")
        finally:
            await llm.close()
    asyncio.run(main())


def test_abort_with_a_bad_id_raises_in_the_client():
    from schedkit.config import config_from_dict
    from schedkit.errors import RequestError
    from schedkit.llm import LLM

    with LLM(config_from_dict({})) as llm, raw_client(llm) as client:
        for bad in (["a", 5], 5, None):
            with pytest.raises(RequestError, match="abort: request ids must be"):
                client.abort(bad)
        client.abort("a")  # one id as a string: fine (unknown ids are ignored)
        assert llm.call_utility("stats")["num_running"] == 0


def test_a_client_dropped_unclosed_in_a_reference_cycle_is_collected_without_hanging():
    # A failed test's traceback (or any user cycle) can keep a client alive until the
    # cycle collector runs; pyzmq then clears the context's socket list before the
    # sockets close, and a context ended with open sockets waits forever.
    import gc
    import weakref

    engine = EngineProcess(config_from_dict({}))
    try:
        client = EngineClient(engine.input_addr, engine.output_addr, engine=engine)
        cycle: dict = {"client": client}
        cycle["self"] = cycle
        client.cycle = cycle  # type: ignore[attr-defined]
        ctx = weakref.ref(client.ctx)
        del client, cycle
        done = threading.Event()

        def collect() -> None:
            gc.collect()
            done.set()

        threading.Thread(target=collect, daemon=True).start()
        assert done.wait(20), "the garbage collector hung ending the client's zmq context"
        assert ctx() is None
    finally:
        engine.shutdown()
