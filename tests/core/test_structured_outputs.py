"""Structured outputs in the scheduler (docs/scheduler-behaviour.md, section
"Structured outputs"): requests wait in WAITING_FOR_FSM while their grammar compiles,
without blocking the queue; the step lists the structured requests and their bitmask
rows; sampled tokens advance the grammars; a rejected token fails the request; the
grammar's end finishes it with "stop".

The backend here is a test plugin whose grammars are token sequences: the constraint
``regex="seq:5,6,7"`` allows exactly tokens 5, 6, 7 and then ends (``seq:5|6,7``: 5 or
6, then 7; a run of single choices is what jump-forward decoding appends). A constraint
``regex="gate:<name>"`` compiles only once the test opens that gate (then allows token
1 forever), and ``regex="fail"`` does not compile.
"""

from __future__ import annotations

import threading
import time

import pytest

from schedkit import hookimpl
from schedkit.config import config_from_dict
from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.outputs import KVConnectorOutput
from schedkit.core.request import Request, RequestStatus, SamplingParams
from schedkit.core.structured_output import (
    GrammarBitmask,
    StructuredOutputBackend,
    StructuredOutputManager,
)
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError
from schedkit.kv.connector import KVConnectorBase
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler, step
from schedkit.runners.fake import FakeRunner

FSM = RequestStatus.WAITING_FOR_FSM
LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS
VOCAB = 64


class SequenceGrammar(StructuredOutputGrammar):
    def __init__(self, tokens: list[set[int]] | None):
        self.tokens = tokens  # None: token 1 forever
        self.pos = 0

    def _allowed(self, pos: int) -> set[int]:
        if self.tokens is None:
            return {1}
        return self.tokens[pos] if pos < len(self.tokens) else set()

    def jump_forward_tokens(self):
        out, pos = [], self.pos
        while self.tokens is not None and pos < len(self.tokens) and len(self.tokens[pos]) == 1:
            out.append(next(iter(self.tokens[pos])))
            pos += 1
        return out

    def accept_tokens(self, request_id, tokens):
        for t in tokens:
            if t not in self._allowed(self.pos):
                return False
            self.pos += 1
        return True

    def validate_tokens(self, tokens):
        out, pos = [], self.pos
        for t in tokens:
            if t not in self._allowed(pos):
                break
            out.append(t)
            pos += 1
        return out

    def rollback(self, num_tokens):
        assert num_tokens <= self.pos
        self.pos -= num_tokens

    def fill_bitmask(self, bitmask, row):
        words = bitmask.words
        base = row * bitmask.num_words
        for w in range(bitmask.num_words):
            words[base + w] = 0
        for t in self._allowed(self.pos):
            words[base + t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)

    def is_terminated(self):
        return self.tokens is not None and self.pos >= len(self.tokens)


class SequenceBackend(StructuredOutputBackend):
    name = "sequence"
    vocab_size = VOCAB

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}
        self.compiles: list[str] = []

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def validate(self, params):
        if params.kind != "regex":
            raise ValueError("the sequence backend takes regex='seq:...' only")
        if params.regex.startswith("seq:"):
            parse(params.regex)

    def compile(self, params):
        self.compiles.append(params.regex)
        text = params.regex
        if text == "fail":
            raise ValueError("this grammar never compiles")
        if text.startswith("gate:"):
            self.gate(text[5:]).wait(30)
            return None
        return parse(text)

    def new_grammar(self, compiled, max_rollback_tokens):
        return SequenceGrammar(compiled)


def parse(text: str) -> list[set[int]]:
    return [{int(t) for t in alt.split("|")} for alt in text[4:].split(",")]


def manager(backend: SequenceBackend | None = None, **kw) -> tuple[StructuredOutputManager, SequenceBackend]:
    backend = backend or SequenceBackend()
    return StructuredOutputManager(lambda: backend, **kw), backend


def structured(rid: str, prompt: list[int], regex: str, **kw) -> Request:
    return make_request(rid, prompt, structured_outputs=StructuredOutputsParams(regex=regex), **kw)


def wait_compiled(mgr: StructuredOutputManager, *reqs: Request) -> None:
    for r in reqs:
        r.structured_output.compiled.result(timeout=10)


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_a_request_whose_grammar_is_compiling_waits_skipped_and_blocks_nobody():
    mgr, backend = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    g = structured("g", [1, 2, 3], "gate:g")
    sched.add_request(g)
    assert g.status is FSM
    res = step(sched, sampled=7)
    assert not res.scheduler_output.scheduled_new_reqs and not sched.running
    assert ids(sched.waiting) == ["g"] and not list(sched.kv_holding)
    assert sched.skipped_ids == {"g"} and res.outputs == [] and g.status is FSM
    plain = make_request("plain", [4, 5])
    sched.add_request(plain)
    res = step(sched, sampled=7)
    assert [r.req_id for r in res.scheduler_output.scheduled_new_reqs] == ["plain"]
    assert ids(sched.waiting) == ["g"] and g.status is FSM
    backend.gate("g").set()
    wait_compiled(mgr, g)
    res = step(sched, sampled={"plain": [7], "g": [1]})
    assert [r.req_id for r in res.scheduler_output.scheduled_new_reqs] == ["g"]
    assert g.status is RequestStatus.RUNNING and "g" not in sched.skipped_ids


class OneShotRemote(KVConnectorBase):
    """Requests whose id starts with "remote" load their whole prompt asynchronously, once."""

    def __init__(self, role, config):
        super().__init__(role, config)
        self.loaded: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        rid = request.request_id
        if not rid.startswith("remote") or rid in self.loaded:
            return 0, False
        return request.num_prompt_tokens - num_local_hit_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loaded.add(request.request_id)


class RemotePlugin:
    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        return OneShotRemote(role, config)


def test_a_finished_load_is_served_before_older_requests_whose_grammar_is_ready():
    mgr, backend = manager()
    sched = make_scheduler(structured_output_manager=mgr, max_num_seqs=1, plugins=[RemotePlugin()])
    g1, g2 = structured("g1", [1] * 4, "gate:a"), structured("g2", [2] * 4, "gate:a")
    rk = make_request("remote-rk", [3] * 4)
    for r in (g1, g2, rk):
        sched.add_request(r)
    # The load starts (and the worker reports it done); the grammars are compiling.
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"remote-rk"}))
    assert rk.status is LOADING and ids(sched.kv_holding) == ["remote-rk"]
    assert ids(sched.waiting) == ["g1", "g2"]
    sched.add_request(make_request("tail", [4] * 4))
    backend.gate("a").set()
    wait_compiled(mgr, g1, g2)
    assert g1.status is FSM and g2.status is FSM  # ready, but not looked at yet
    res = step(sched, sampled=1)
    assert [r.req_id for r in res.scheduler_output.scheduled_new_reqs] == ["remote-rk"]
    assert ids(sched.kv_holding) + ids(sched.waiting) == ["g1", "g2", "tail"]


def test_skipped_waiting_requests_of_every_kind_keep_their_order():
    mgr, backend = manager()
    sched = make_scheduler(structured_output_manager=mgr, max_num_batched_tokens=20,
                           plugins=[RemotePlugin()])
    grammar = structured("grammar", [1], "gate:b")
    remote = make_request("remote", [2])
    regular = make_request("regular", list(range(3, 23)))
    tail = make_request("tail", [5])
    for r in (grammar, remote, regular, tail):
        sched.add_request(r)
    # The remote load starts (the worker reports it done with this step's output).
    res = step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"remote"}))
    assert [r.req_id for r in res.scheduler_output.scheduled_new_reqs] == ["regular"]
    assert ids(sched.kv_holding) == ["remote"] and ids(sched.waiting) == ["grammar", "tail"]
    sched.finish_requests("regular", RequestStatus.FINISHED_ABORTED)
    backend.gate("b").set()
    wait_compiled(mgr, grammar)
    res = step(sched, sampled=1)
    assert [r.req_id for r in res.scheduler_output.scheduled_new_reqs] == ["remote", "grammar", "tail"]
    assert ids(sched.running) == ["remote", "grammar", "tail"]


def test_a_token_the_grammar_rejects_fails_the_request_and_frees_it():
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    free_before = sched.kv_cache_manager.num_free_blocks
    req = structured("r", [1, 2, 3], "seq:5,6,7")
    sched.add_request(req)
    wait_compiled(mgr, req)
    res = step(sched, sampled={"r": [123]})
    (out,) = res.outputs
    assert out.new_token_ids == [123] and out.finish_reason == "error"
    assert "not allowed by its regex" in out.error
    assert req.status is RequestStatus.FINISHED_ERROR and "r" not in sched.requests
    assert not sched.running and sched.kv_cache_manager.num_free_blocks == free_before


def test_the_grammars_end_finishes_the_request_with_stop():
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    req = structured("r", [1, 2, 3], "seq:5,6,7", max_tokens=50, eos_token_id=None)
    sched.add_request(req)
    wait_compiled(mgr, req)
    outs = [o for i in range(3) for o in step(sched, sampled={"r": [5 + i]}).outputs]
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7]
    assert outs[-1].finish_reason == "stop" and req.status is RequestStatus.FINISHED_STOPPED


def test_a_grammar_that_does_not_compile_fails_its_request_at_the_next_update():
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    bad = structured("bad", [1, 2], "fail")
    sched.add_request(bad)
    with pytest.raises(ValueError):
        bad.structured_output.compiled.result(timeout=10)
    res = step(sched)
    (out,) = res.outputs
    assert out.finish_reason == "error" and "does not compile" in out.error
    assert "this grammar never compiles" in out.error and "bad" not in sched.requests
    assert not list(sched.waiting) and not sched.skipped_ids


def test_invalid_constraints_fail_at_the_next_update_and_schedulers_without_structured_outputs_refuse():
    """The backend's check runs on a compile worker, not in add_request: a constraint it
    refuses fails its request at the next update, naming why."""
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    x = structured("x", [1], "seq:five")
    y = make_request("y", [1], structured_outputs={"choice": ["a"]})
    sched.add_request(x)
    sched.add_request(y)
    for r in (x, y):
        with pytest.raises(ValueError):
            r.structured_output.compiled.result(timeout=10)
    errors = {o.request_id: o.error for o in step(sched).outputs}
    assert "does not compile" in errors["x"] and "regex='seq:...' only" in errors["y"]
    assert not sched.requests and not list(sched.waiting)
    plain_sched = make_scheduler()
    with pytest.raises(RequestError, match="structured outputs are not available"):
        plain_sched.add_request(structured("z", [1], "seq:1"))
    assert not plain_sched.requests


def test_a_constraint_seen_before_is_compiled_once():
    mgr, backend = manager()
    sched = make_scheduler(structured_output_manager=mgr)
    a, b = structured("a", [1], "seq:5,6"), structured("b", [2], "seq:5,6")
    sched.add_request(a)
    sched.add_request(b)
    wait_compiled(mgr, a, b)
    assert backend.compiles == ["seq:5,6"] and mgr.num_compiled == 1 and mgr.num_cache_hits == 1
    res = step(sched, sampled=5)
    assert set(res.scheduler_output.structured_output_request_ids) == {"a", "b"}


def test_bitmask_rows_cover_every_sampled_position_and_drafts_are_cut_at_the_grammar():
    mgr, _ = manager(max_rollback_tokens=3)
    sched = make_scheduler(structured_output_manager=mgr, num_speculative_tokens=3)
    s = structured("s", [1, 2], "seq:5,6,7,8,9", max_tokens=20, eos_token_id=None)
    plain = make_request("plain", [3, 4], max_tokens=20)
    for r in (s, plain):
        sched.add_request(r)
    wait_compiled(mgr, s)
    step(sched, sampled={"s": [5], "plain": [9]})
    sched.update_draft_token_ids({"s": [6, 7, 40], "plain": [1, 2, 3]})
    assert s.spec_token_ids == [6, 7] and plain.spec_token_ids == [1, 2, 3]
    so = sched.schedule()
    sched.fill_grammar_bitmask(so)
    assert so.structured_output_request_ids == {"s": 0}
    bm = so.grammar_bitmask
    assert bm.num_rows == 3 and [bm.allowed(r) for r in range(3)] == [[6], [7], [8]]
    assert s.structured_output.grammar.pos == 1  # filled by advancing over drafts, then rolled back


def test_a_structured_prefill_chunk_gets_no_row():
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr, max_num_batched_tokens=8, max_num_seqs=2)
    s = structured("s", list(range(1, 21)), "seq:5")
    sched.add_request(s)
    wait_compiled(mgr, s)
    res = step(sched)
    assert res.scheduler_output.num_scheduled_tokens == {"s": 8}
    assert res.scheduler_output.structured_output_request_ids == {}
    assert res.scheduler_output.grammar_bitmask is None


def test_the_fake_runner_samples_inside_the_bitmask_and_the_grammar_survives_preemption():
    mgr, _ = manager()
    # 6 blocks of 4 tokens: the two requests cannot both grow to 17 tokens; one is preempted.
    sched = make_scheduler(structured_output_manager=mgr, block_size=4, num_blocks=7)
    seq = [5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
    a = structured("a", [1] * 4, "seq:" + ",".join(map(str, seq)), max_tokens=30, eos_token_id=None)
    b = make_request("b", [2] * 4, max_tokens=13, eos_token_id=None)
    for r in (a, b):
        sched.add_request(r)
    wait_compiled(mgr, a)
    runner = FakeRunner(vocab_size=VOCAB)
    outs: dict[str, list[int]] = {"a": [], "b": []}
    reasons = {}
    while sched.has_requests():
        for o in step(sched, runner).outputs:
            outs[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    assert outs["a"] == seq and reasons == {"a": "stop", "b": "length"}
    assert sched.num_preemptions_total > 0


class BackendPlugin:
    def __init__(self):
        self.backend = SequenceBackend()

    @hookimpl
    def schedkit_create_structured_output_backend(self, config, tokenizer, vocab_size):
        return self.backend if config.backend == "sequence" else None


@pytest.mark.parametrize("async_scheduling,num_spec", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_grammars_follow_every_token_through_the_engine(async_scheduling, num_spec):
    config = config_from_dict({
        "cache": {"block_size": 4, "num_blocks": 9},
        "scheduler": {"async_scheduling": async_scheduling, "num_speculative_tokens": num_spec},
        "runner": {"vocab_size": VOCAB},
        "structured_outputs": {"backend": "sequence"}})
    engine = EngineCore(config, extra_plugins=[BackendPlugin()])
    seq = [7, 3, 3, 8, 60, 2, 9, 9, 1, 5, 4, 4, 6, 0, 12, 13, 14, 15]
    regex = "seq:" + ",".join(map(str, seq))
    for i in range(3):
        engine.add_request(Request(f"s{i}", [1 + i] * 5, SamplingParams(
            max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)), 0.0))
        engine.add_request(Request(f"p{i}", [4 + i] * 5, SamplingParams(max_tokens=18), 0.0))
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while engine.has_requests() and time.monotonic() < deadline:
        for group in engine.step().values():
            for o in group.outputs:
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    reasons[o.request_id] = o.finish_reason
        assert_scheduler_consistent(engine.scheduler)
    assert reasons == {**{f"s{i}": "stop" for i in range(3)}, **{f"p{i}": "length" for i in range(3)}}
    assert all(outs[f"s{i}"] == seq for i in range(3))
    assert engine.scheduler.num_preemptions_total > 0  # 8 usable blocks of 4 tokens for 6 requests


def test_bitmask_allocation_and_bits():
    bm = GrammarBitmask.allocate(2, 70)
    assert bm.num_words == 3 and bm.allows(0, 69) and not bm.allows(0, 96)
    bm.words[3:6] = type(bm.words)("i", [0, 1 << 4, -(1 << 31)])
    assert bm.allowed(1) == [36, 95] and bm.allowed(0)[:3] == [0, 1, 2]


def jump_forward_scheduler(**kw):
    mgr, _ = manager(jump_forward=True)
    return make_scheduler(structured_output_manager=mgr, **kw), mgr


def test_jump_forward_appends_forced_tokens_in_the_step_that_sampled_before_them():
    sched, mgr = jump_forward_scheduler()
    req = structured("r", [1, 2, 3], "seq:5|6,10,11,12,7|8,20,21", max_tokens=50, eos_token_id=None)
    sched.add_request(req)
    wait_compiled(mgr, req)
    runner = FakeRunner(vocab_size=VOCAB)
    res = step(sched, runner)
    (out,) = res.outputs
    assert out.new_token_ids[1:] == [10, 11, 12] and out.new_token_ids[0] in (5, 6)
    assert req.num_computed_tokens == 3 and req.num_tokens == 7  # the sampled and forced tokens are not computed
    res = step(sched, runner)
    assert res.scheduler_output.num_scheduled_tokens == {"r": 4}  # the sampled token and the forced ones
    assert res.scheduler_output.scheduled_cached_reqs.appended_token_ids == {"r": [10, 11, 12]}
    (out,) = res.outputs
    assert out.new_token_ids[1:] == [20, 21] and out.finish_reason == "stop"
    assert len(req.output_token_ids) == 7 and sched.num_jump_forward_tokens == 5
    assert "r" not in sched.requests


def test_jump_forward_respects_max_tokens_and_the_step_budget():
    sched, mgr = jump_forward_scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    capped = structured("c", [1], "seq:5,6,7,8,9,10", max_tokens=3, eos_token_id=None)
    long = structured("l", [2], "seq:5" + ",4" * 40 + ",3|2", max_tokens=60, eos_token_id=None)
    for r in (capped, long):
        sched.add_request(r)
    wait_compiled(mgr, capped, long)
    runner = FakeRunner(vocab_size=VOCAB)
    outs: dict[str, list[int]] = {"c": [], "l": []}
    reasons = {}
    steps = 0
    while sched.has_requests():
        res = step(sched, runner)
        steps += 1
        assert res.scheduler_output.total_num_scheduled_tokens <= 16
        for o in res.outputs:
            outs[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    assert outs["c"] == [5, 6, 7] and reasons["c"] == "length"
    assert outs["l"][:41] == [5] + [4] * 40 and outs["l"][41] in (2, 3) and reasons["l"] == "stop"
    assert steps < len(outs["l"])  # 42 tokens in fewer steps


def test_jump_forward_survives_preemption_and_matches_decoding_without_it():
    seqs = ["seq:5|6,10,11,12,13,7|8,20,21,22,23,24,25,9|19,30,31",
            "seq:3|4,40,41,42,43,44,45,46,2|1,50,51,52,53"]

    def run(jump_forward):
        mgr, _ = manager(jump_forward=jump_forward)
        sched = make_scheduler(structured_output_manager=mgr, block_size=4, num_blocks=8)
        reqs = [structured(f"r{i}", [1 + i] * 4, seq, max_tokens=40, eos_token_id=None)
                for i, seq in enumerate(seqs)] + [make_request("p", [9] * 4, max_tokens=14, eos_token_id=None)]
        for r in reqs:
            sched.add_request(r)
        wait_compiled(mgr, *reqs[:2])
        runner = FakeRunner(vocab_size=VOCAB)
        outs: dict[str, list[int]] = {}
        steps = 0
        while sched.has_requests():
            steps += 1
            for o in step(sched, runner).outputs:
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs, steps, sched.num_preemptions_total

    plain, plain_steps, _ = run(False)
    jumped, jumped_steps, preemptions = run(True)
    assert jumped["r0"] == plain["r0"] and jumped["r1"] == plain["r1"] and jumped["p"] == plain["p"]
    assert len(jumped["r0"]) == 15 and len(jumped["r1"]) == 13
    assert jumped_steps < plain_steps and preemptions > 0


def test_a_verified_draft_that_ends_the_grammar_ends_the_step_there():
    mgr, _ = manager(max_rollback_tokens=2)
    sched = make_scheduler(structured_output_manager=mgr, num_speculative_tokens=2)
    req = structured("r", [1, 2], "seq:4,5,9", max_tokens=20, eos_token_id=None, ignore_eos=True)
    sched.add_request(req)
    wait_compiled(mgr, req)
    step(sched, sampled={"r": [4]})
    sched.update_draft_token_ids({"r": [5, 9]})
    res = step(sched, sampled={"r": [5, 9, 3]})  # both drafts verified, then a bonus token
    (out,) = res.outputs
    assert out.new_token_ids == [5, 9] and out.finish_reason == "stop"
    assert req.output_token_ids == [4, 5, 9] and "r" not in sched.requests


class FailingGrammar(SequenceGrammar):
    def __init__(self, tokens, where):
        super().__init__(tokens)
        self.where = where

    def accept_tokens(self, request_id, tokens):
        if self.where == "accept":
            raise RuntimeError("accept exploded")
        return super().accept_tokens(request_id, tokens)

    def fill_bitmask(self, bitmask, row):
        if self.where == "fill":
            raise RuntimeError("fill exploded")
        super().fill_bitmask(bitmask, row)


class FailingBackend(SequenceBackend):
    """``regex="boom:<where>:seq..."``: the matcher raises in ``where`` (accept, fill,
    new) or ``validate`` raises a RuntimeError."""

    def validate(self, params):
        if params.regex == "boom:validate":
            raise RuntimeError("validate exploded")

    def compile(self, params):
        where, _, seq = params.regex[5:].partition(":")
        return where, parse("seq:" + seq) if seq else None

    def new_grammar(self, compiled, max_rollback_tokens):
        where, tokens = compiled
        if where == "new":
            raise RuntimeError("new_grammar exploded")
        return FailingGrammar(tokens, where)


class FailingPlugin:
    @hookimpl
    def schedkit_create_structured_output_backend(self, config):
        return FailingBackend() if config.backend == "failing" else None


@pytest.mark.parametrize("where", ["accept", "fill", "new"])
def test_a_backend_that_raises_fails_only_its_request(where):
    engine = EngineCore(config_from_dict({"runner": {"vocab_size": VOCAB},
                                          "structured_outputs": {"backend": "failing"}}),
                        extra_plugins=[FailingPlugin()])
    engine.add_request(Request("bad", [1, 2], SamplingParams(
        max_tokens=5, structured_outputs={"regex": f"boom:{where}:1,1,1"}), 0.0))
    engine.add_request(Request("plain", [3, 4], SamplingParams(max_tokens=5), 0.0))
    finished = {}
    while engine.has_requests():
        for group in engine.step().values():
            for o in group.outputs:
                if o.finish_reason:
                    finished[o.request_id] = (o.finish_reason, o.error or "")
        assert_scheduler_consistent(engine.scheduler)
    assert finished["plain"] == ("length", "")
    reason, error = finished["bad"]
    assert reason == "error" and ("exploded" in error or "logged" in error), error
    engine.close()


def test_a_backend_whose_validate_raises_fails_only_that_request():
    mgr, _ = manager(FailingBackend())
    sched = make_scheduler(structured_output_manager=mgr)
    x = structured("x", [1], "boom:validate")
    sched.add_request(x)
    with pytest.raises(RuntimeError):
        x.structured_output.compiled.result(timeout=10)
    (out,) = step(sched).outputs
    assert out.finish_reason == "error" and "RuntimeError: validate exploded" in out.error
    assert not sched.requests


def test_a_failed_compilation_is_reported_even_when_no_schedule_reaches_its_request():
    mgr, _ = manager()
    sched = make_scheduler(structured_output_manager=mgr, max_num_seqs=1)
    sched.add_request(make_request("busy", [1, 2], max_tokens=50))
    step(sched, sampled=7)  # "busy" takes the only running slot
    bad = structured("bad", [3], "fail")
    sched.add_request(bad)
    with pytest.raises(ValueError):
        bad.structured_output.compiled.result(timeout=10)
    res = step(sched, sampled=7)
    assert [(o.request_id, o.finish_reason) for o in res.outputs if o.finish_reason] == [("bad", "error")]
    assert "busy" in sched.requests and "bad" not in sched.requests


def test_closing_the_engine_stops_the_compile_threads():
    engine = EngineCore(config_from_dict({"runner": {"vocab_size": VOCAB},
                                          "structured_outputs": {"backend": "sequence"}}),
                        extra_plugins=[BackendPlugin()])
    engine.add_request(Request("s", [1], SamplingParams(max_tokens=2, structured_outputs={"regex": "seq:1,2"}), 0.0))
    pool = engine.structured_output_manager._pool
    assert pool is not None
    engine.close()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("key", None, 0, "r")
    assert not any(w.thread.is_alive() for w in pool._workers)
