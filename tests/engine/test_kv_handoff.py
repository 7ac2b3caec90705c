"""The ``kv_*`` utility methods of one engine (schedkit.engine.kv_handoff), on two
in-process engines of the tiny paged model: a hand-off moves exactly the blocks the
receiver lacks, the receiver's greedy tokens equal a colocated engine's, blocks are
freed on both sides; bad arguments raise typed errors naming what was wrong."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from schedkit.core.request import Request, SamplingParams  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.engine.kv_handoff import KVHandoffs  # noqa: E402
from schedkit.errors import ConfigError, RequestError  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.kv_transfer import KVTransfer, pack_blocks, unpack_blocks  # noqa: E402
from schedkit.runners.paged.testing import paged_config, random_prompts, run_engine  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("m") / "llama", tiny_config("llama"))


def engine(model, transfer: bool = True) -> EngineCore:
    cfg = paged_config(model, num_blocks=64, enable_prefix_caching=True)
    return EngineCore(cfg, extra_plugins=[KVTransfer()] if transfer else [])


def greedy(rid: str, prompt: list[int], n: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), 0.0)


def prefill(model, handoffs: KVHandoffs, rid: str, prompt: list[int]) -> dict:
    handoffs.send_when_finished(rid)
    eng = handoffs.engine
    eng.add_request(greedy(rid, prompt, 1))
    params = None
    while eng.has_requests():
        for eco in eng.step().values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    params = o.kv_transfer_params
    assert params is not None
    return params


def test_a_hand_off_between_two_engines_gives_the_colocated_tokens(model):
    prompts = random_prompts([70, 45, 33], VOCAB, seed=4)
    want = run_engine(engine(model, transfer=False), [greedy(str(i), p) for i, p in enumerate(prompts)])
    p_eng, d_eng = engine(model), engine(model)
    p, d = KVHandoffs(p_eng), KVHandoffs(d_eng)
    assert p.worker is not None and d.worker is not None
    free = p_eng.scheduler.kv_cache_manager.num_free_blocks
    got = {}
    for i, prompt in enumerate(prompts):
        rid = str(i)
        params = prefill(model, p, rid, prompt)
        assert len(params["block_ids"]) == len(prompt) // 16
        assert p.connector.num_held_blocks == len(prompt) // 16
        held = d.call("kv_reserve", [rid, params["block_hashes"], len(prompt)])
        assert held == 0
        payload = p.call("kv_export", [rid, held])
        assert payload["num_blocks"] == len(prompt) // 16 and payload["shape"][2] == len(prompt) // 16
        assert d.call("kv_import", [rid, held, payload]) is True
        assert p.call("kv_release", [rid]) is True and p.connector.num_held_blocks == 0
        got |= run_engine(d_eng, [greedy(rid, prompt)])
    assert got == want
    assert d.connector.num_tokens_received == sum(len(p) // 16 * 16 for p in prompts)
    assert p_eng.scheduler.kv_cache_manager.num_free_blocks == free
    assert d.connector.num_reserved_blocks == 0 and not d.worker.staged


def test_blocks_the_receiver_holds_are_not_sent(model):
    prompt = random_prompts([85], VOCAB, seed=5)[0]
    p_eng, d_eng = engine(model), engine(model)
    p, d = KVHandoffs(p_eng), KVHandoffs(d_eng)
    run_engine(d_eng, [greedy("warm", prompt[:48] + [1, 2, 3])])  # caches three blocks
    params = prefill(model, p, "x", prompt)
    held = d.call("kv_reserve", ["x", params["block_hashes"], len(prompt)])
    assert held == 3
    payload = p.call("kv_export", ["x", held])
    assert payload["num_blocks"] == 2
    d.call("kv_import", ["x", held, payload])
    want = run_engine(engine(model, transfer=False), [greedy("x", prompt)])
    assert run_engine(d_eng, [greedy("x", prompt)]) == want
    assert d.connector.num_tokens_received == 2 * 16


def test_a_receiver_without_room_answers_none_until_it_has_some(model):
    d_eng = engine(model)
    d = KVHandoffs(d_eng)
    d_eng.add_request(greedy("busy", random_prompts([500], VOCAB, seed=6)[0], 200))
    for _ in range(10):  # its prompt computed: it holds 32 of the 63 blocks
        d_eng.step()
    assert d.call("kv_reserve", ["a", [], 600]) is None  # 38 blocks needed
    assert d.connector.num_reserved_blocks == 0
    d_eng.abort_requests("busy")
    assert d.call("kv_reserve", ["a", [], 600]) == 0
    assert d.connector.num_reserved_blocks == 38
    assert d.call("kv_cancel", ["a"]) is True and d.connector.num_reserved_blocks == 0


@pytest.mark.parametrize("method,args,says", [
    ("kv_export", ["nope", 0], "no KV is kept for request 'nope'"),
    ("kv_export", [7, 0], "the first argument must be a request id, got 7"),
    ("kv_reserve", ["r", "abc", 10], "block hashes must be a list of bytes"),
    ("kv_reserve", ["r", [], 0], "prompt tokens must be a positive int, got 0"),
    ("kv_reserve", ["r", []], "kv_reserve takes 3 arguments, got 2"),
    ("kv_import", ["r", -1, {"num_blocks": 0}], "first block must be a non-negative int"),
    ("kv_import", ["r", 0, [1, 2]], "the payload must be a dict with an int num_blocks"),
    ("kv_import", ["r", 0, {"num_blocks": 1, "shape": [1], "dtype": "float32", "data": b""}],
     "received KV of shape [1] and dtype float32, but this engine's cache takes"),
])
def test_bad_arguments_raise_request_errors_naming_them(model, method, args, says):
    h = KVHandoffs(engine(model))
    with pytest.raises(RequestError, match=says.replace("[", r"\[").replace("]", r"\]")):
        h.call(method, args)
    assert h.connector.num_reserved_blocks == 0


def test_an_engine_without_the_transfer_connector_refuses_kv_calls(model):
    h = KVHandoffs(engine(model, transfer=False))
    with pytest.raises(ConfigError, match="not kv-transfer: a disaggregated cluster needs kv-transfer"):
        h.call("kv_export", ["r", 0])
    with pytest.raises(ConfigError):
        h.send_when_finished("r")


def test_payload_round_trip_and_size_check(model):
    eng = engine(model)
    caches = eng.runner.kv_caches
    caches[0][0][3].fill_(1.5)
    payload = pack_blocks(caches, [3, 5])
    blocks = unpack_blocks(payload, caches, "r")
    assert blocks.shape[2] == 2 and float(blocks[0, 0, 0].min()) == 1.5
    with pytest.raises(RequestError, match="received KV has 3 bytes"):
        unpack_blocks({**payload, "data": b"abc"}, caches, "r")
    assert pack_blocks([], [1, 2]) == {"num_blocks": 2}
