"""Who can reach an engine: only the client holding the launch's keys.

A process that reaches the engine's sockets without them (no key, its own key, a wrong
engine key) is refused at the handshake and counted; what it sends (here ``shutdown``
and a request) never reaches the engine, which keeps serving its own client. ipc
sockets live in a directory only this user can enter; the keys never appear on the
engine's command line or in its environment.
"""

from __future__ import annotations

import os
import stat
import time

import pytest
import zmq

from schedkit.core.request import SamplingParams
from schedkit.engine.auth import EngineKeys
from schedkit.engine.client import EngineClient, wire_request
from schedkit.engine.messages import AddRequests, Hello, UtilityCall, client_encoder
from schedkit.errors import SchedkitError
from schedkit.llm import LLM

ROGUES = ("no key", "own client key", "wrong engine key")


def rogue_socket(ctx: zmq.Context, kind: str, keys: EngineKeys, addr: str) -> zmq.Socket:
    """A DEALER that knows the address but not the launch's client key."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kind != "no key":
        own = EngineKeys.generate()
        server = keys.server_public if kind == "own client key" else own.server_public
        EngineKeys(server, b"", own.client_public, own.client_secret).secure_client(sock)
    sock.connect(addr)
    return sock


def wait_for_refusals(llm: LLM, n: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        refused = llm.call_utility("stats")["num_refused_connections"]
        if refused >= n or time.monotonic() > deadline:
            return refused
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_client_without_the_keys_is_refused_counted_and_the_engine_keeps_serving(small_config, transport):
    with LLM(small_config(), transport=transport) as llm:
        engine = llm.engine
        ctx = zmq.Context()
        try:
            rogues = []
            for kind in ROGUES:
                into = rogue_socket(ctx, kind, engine.keys, engine.input_addr)
                into.send(client_encoder.encode(UtilityCall(0, "shutdown", [])))
                into.send(client_encoder.encode(AddRequests([
                    wire_request(f"rogue-{kind}", [1, 2, 3], SamplingParams(max_tokens=50))])))
                out = rogue_socket(ctx, kind, engine.keys, engine.output_addr)
                out.send(client_encoder.encode(Hello()))
                rogues += [into, out]
            assert wait_for_refusals(llm, 2 * len(ROGUES)) >= 2 * len(ROGUES)
            assert not any(s.poll(200) for s in rogues)  # not even a Ready or a heartbeat
            assert engine.is_alive()
            outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
            assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 3
            stats = llm.call_utility("stats")
            assert stats["num_running"] == stats["num_waiting"] == 0  # no rogue request got in
            assert stats["num_malformed_messages"] == 0
        finally:
            ctx.destroy(0)


def test_a_second_client_with_the_launch_keys_is_admitted(small_config):
    with LLM(small_config()) as llm:
        other = EngineClient(llm.engine.input_addr, llm.engine.output_addr, keys=llm.engine.keys)
        try:
            assert other.call_utility("num_unfinished") == 0
        finally:
            other.close()
        assert llm.call_utility("stats")["num_refused_connections"] == 0


def test_a_client_needs_the_keys():
    with pytest.raises(SchedkitError, match="needs the engine launch's keys"):
        EngineClient("ipc:///nowhere-in", "ipc:///nowhere-out")


def test_ipc_sockets_live_in_a_private_directory_removed_at_shutdown(small_config):
    llm = LLM(small_config())
    try:
        paths = [a.removeprefix("ipc://") for a in (llm.engine.input_addr, llm.engine.output_addr)]
        folder = os.path.dirname(paths[0])
        assert {os.path.dirname(p) for p in paths} == {folder}
        info = os.stat(folder)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert all(stat.S_ISSOCK(os.stat(p).st_mode) for p in paths)
    finally:
        llm.close()
    assert not os.path.exists(folder)


def test_the_keys_are_not_on_the_engine_command_line_or_in_its_environment(small_config):
    with LLM(small_config(), transport="tcp") as llm:
        keys = llm.engine.keys
        pid = llm.engine.pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert b"schedkit.engine.process" in cmdline
        for secret in (keys.server_secret, keys.client_secret, keys.client_public, keys.server_public):
            assert secret not in cmdline and secret not in environ
        assert "secret" not in repr(keys).replace("secrets hidden", "")


def test_engine_keys_round_trip_through_the_engine_part():
    keys = EngineKeys.generate()
    engine_side = EngineKeys.from_engine_part(keys.engine_part())
    assert engine_side.server_public == keys.server_public
    assert engine_side.client_public == keys.client_public and engine_side.client_secret == b""
    assert keys.client_secret.decode() not in str(keys.engine_part())
