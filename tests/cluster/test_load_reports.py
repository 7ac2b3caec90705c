"""What an engine process publishes for the router: load reports with its KV cache
events, only to clients whose Hello asked for them."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
import zmq

from schedkit.cluster.router import Router, replica_config
from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.engine.client import AsyncEngineClient, wire_request
from schedkit.engine.messages import (
    AddRequests,
    Hello,
    LoadReport,
    OutputBatch,
    Ready,
    WireKVEvent,
    client_encoder,
    engine_decoder,
    kv_events_from_wire,
    kv_events_to_wire,
)
from schedkit.engine.process import EngineProcess
from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from schedkit.kv.prefix_index import CachedPrefixIndex

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(1, 33))  # two full 16-token blocks


def _config(**cache):
    return config_from_dict({"replicas": {"count": 2}, "cache": cache,
                             "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 2}})


def test_subscribed_client_gets_ordered_reports_with_every_kv_event():
    cfg = replica_config(_config())
    assert cfg.cache.enable_kv_events
    reports: list[LoadReport] = []

    async def main():
        engine = EngineProcess(cfg)
        conn = AsyncEngineClient(engine, on_load=reports.append)
        await conn.connect()
        try:
            for i in range(20):
                w = wire_request(f"r{i}", PREFIX + [100 + i, 200 + i], SamplingParams(max_tokens=5))
                async for _ in conn.stream(w):
                    pass
            index = CachedPrefixIndex()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not reports or reports[-1].num_running
                                                   or reports[-1].kv_cache_usage):
                await asyncio.sleep(0.05)  # the idle engine's last report
            for r in reports:
                index.apply(kv_events_from_wire(r.kv_events))
            hashes = Router(_config()).make_request("x", PREFIX + [1, 2]).block_hashes
            assert len(hashes) == 2 and index.num_matched_blocks(hashes) == 2
            assert [r.seq for r in reports] == list(range(len(reports)))
            assert reports[-1].num_waiting == reports[-1].num_running == 0
            stored = [e for r in reports for e in kv_events_from_wire(r.kv_events)
                      if isinstance(e, BlockStored)]
            assert stored and all(e.block_size == 16 and e.token_ids == [] for e in stored)
            n = len(reports)
            assert await conn.call_utility("reset_prefix_cache") is True
            while len(reports) == n:
                await asyncio.sleep(0.02)
            events = kv_events_from_wire(reports[-1].kv_events)
            assert isinstance(events[-1], AllBlocksCleared)
            index.apply(events)
            assert len(index) == 0
        finally:
            await conn.close()

    asyncio.run(main())


@pytest.mark.parametrize("kv_events", [False, True])
def test_a_client_that_did_not_ask_gets_no_report(kv_events):
    cfg = _config(enable_kv_events=kv_events)
    engine = EngineProcess(cfg)
    ctx = zmq.Context()
    try:
        identity = uuid.uuid4().bytes
        socks = []
        for addr in (engine.input_addr, engine.output_addr):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.ROUTING_ID, identity)
            s.setsockopt(zmq.LINGER, 0)
            engine.keys.secure_client(s)
            s.connect(addr)
            socks.append(s)
        in_sock, out_sock = socks
        out_sock.send(client_encoder.encode(Hello()))
        assert out_sock.poll(30_000)
        assert isinstance(engine_decoder.decode(out_sock.recv()), Ready)
        ws = [wire_request(f"r{i}", PREFIX + [i], SamplingParams(max_tokens=4)) for i in range(5)]
        in_sock.send(client_encoder.encode(AddRequests(ws)))
        kinds, done = [], 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (done < 5 or len(kinds) < 3):
            if out_sock.poll(100):
                msg = engine_decoder.decode(out_sock.recv())
                kinds.append(type(msg))
                if isinstance(msg, OutputBatch):
                    done += sum(1 for o in msg.outputs if o.finish_reason)
        time.sleep(0.3)  # anything sent after the last finish
        while out_sock.poll(0):
            kinds.append(type(engine_decoder.decode(out_sock.recv())))
        assert done == 5 and LoadReport not in kinds
    finally:
        ctx.destroy(0)
        engine.shutdown()


def test_kv_events_are_compact_on_the_wire():
    """A BlockStored of two blocks costs its hashes and a few bytes, not its tokens; the
    front end gets the same events back (without the token ids)."""
    events = [BlockStored([b"a" * 8, b"b" * 8], None, list(range(32)), 16),
              BlockRemoved([b"a" * 8]), AllBlocksCleared()]
    wire = msgspec.msgpack.encode(kv_events_to_wire(events))
    assert len(wire) <= 3 * 8 + 6 * len(events)  # the hashes, and a few bytes of framing each
    back = kv_events_from_wire(msgspec.msgpack.decode(wire, type=list[WireKVEvent]))
    assert back == [BlockStored([b"a" * 8, b"b" * 8], None, [], 16), BlockRemoved([b"a" * 8]),
                    AllBlocksCleared()]
