"""Structured outputs in the paged runner: the step's grammar bitmask masks the logits
of the structured requests' sampled positions before the sampler, on every path
(eager, decode "graphs", async scheduling, drafts), and leaves other rows untouched.

The engine's real Scheduler plans every step; a wrapper around ``execute_async`` then
sets ``structured_output_request_ids`` and ``grammar_bitmask`` by hand (as the engine
does just before launching) from a per-position allowed set, and records the raw and
masked logits and the sampled tokens of each step.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.core.outputs import SchedulerOutput  # noqa: E402
from schedkit.core.structured_output import GrammarBitmask  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.model_runner import _stage_grammar, grammar_rows  # noqa: E402
from schedkit.runners.paged.sampler import apply_grammar_bitmask  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    paged_config,
    random_prompts,
    run_engine,
)

VOCAB = 512
Allowed = Callable[[str, int], "set[int] | None"]


def allowed_at(rid: str, pos: int) -> set[int]:
    """Three tokens, a different set at each position (a shifted row would leave it)."""
    return {(pos * 37 + c * 101) % VOCAB for c in range(3)}


def make_bitmask(rows: list[set[int] | None], num_words: int = (VOCAB + 31) // 32) -> GrammarBitmask:
    """One row per set (None: every token allowed)."""
    words = array("i", [0]) * (len(rows) * num_words)
    for r, allowed in enumerate(rows):
        for w in range(num_words):
            if allowed is None:
                words[r * num_words + w] = -1
                continue
            v = sum(1 << (t - 32 * w) for t in allowed if 32 * w <= t < 32 * w + 32)
            words[r * num_words + w] = v - (1 << 32) if v >= 1 << 31 else v
    return GrammarBitmask(len(rows), num_words, words)


@dataclass
class StepRecord:
    req_ids: list[str]
    slices: list[tuple[int, int]]
    positions: dict[str, list[int]]
    """Structured request -> the position each of its bitmask rows samples."""
    raw: Any
    masked: Any
    tokens: list[int]
    in_flight: bool
    """Launched while the previous step's tokens were not collected."""


class Constrained:
    """Sets each step's structured rows by hand and records what the runner did."""

    def __init__(self, engine: EngineCore, structured: set[str], allowed: Allowed = allowed_at,
                 num_words: int = (VOCAB + 31) // 32) -> None:
        runner = engine.runner
        self.runner, self.structured, self.allowed, self.num_words = runner, structured, allowed, num_words
        self.steps: list[StepRecord] = []
        self._raw: Any = None
        self._masked: Any = None
        real_execute, real_logits, real_sampler = runner.execute_async, runner.model.compute_logits, runner.sampler

        def compute_logits(hidden: Any) -> Any:
            out = real_logits(hidden)
            self._raw = out.clone()
            return out

        def sampler(logits: Any, batch: Any) -> Any:
            self._masked = logits.clone()
            return real_sampler(logits, batch)

        def execute_async(so: SchedulerOutput) -> Any:
            self._raw = self._masked = None
            positions = self._fill(so)
            in_flight = runner._num_uncollected > 0
            handle = real_execute(so)
            tokens = [] if handle.tokens is None else handle.tokens.tolist()
            self.steps.append(StepRecord(handle.req_ids, handle.slices, positions, self._raw,
                                         self._masked, tokens, in_flight))
            return handle

        runner.model.compute_logits = compute_logits
        runner.sampler = sampler
        runner.execute_async = execute_async

    def _fill(self, so: SchedulerOutput) -> dict[str, list[int]]:
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        rows: list[set[int] | None] = []
        first: dict[str, int] = {}
        positions: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            if rid not in self.structured:
                continue
            k = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            start = computed[rid] + n - k  # the position of its first sampled token
            first[rid] = len(rows)
            positions[rid] = list(range(start, start + k + 1))
            rows.extend(self.allowed(rid, p) for p in positions[rid])
        if rows:
            so.structured_output_request_ids = first
            so.grammar_bitmask = make_bitmask(rows, self.num_words)
        return positions

    def check_rows(self, greedy: Collection[str] = ()) -> int:
        """Every structured row masked exactly to its set (greedy: its argmax there), every
        other row bit-for-bit untouched; returns the number of structured rows seen."""
        num = 0
        for st in self.steps:
            if st.raw is None:
                continue
            width = st.raw.shape[1]
            constrained: dict[int, set[int] | None] = {}
            for rid, (a, b) in zip(st.req_ids, st.slices, strict=True):
                if rid in self.structured and a < b:
                    assert len(st.positions[rid]) == b - a
                    for j, row in enumerate(range(a, b)):
                        constrained[row] = self.allowed(rid, st.positions[rid][j])
            for row in range(st.raw.shape[0]):
                raw, masked = st.raw[row], st.masked[row]
                if row not in constrained:
                    assert torch.equal(raw, masked), f"unconstrained row {row} changed"
                    continue
                num += 1
                allowed = constrained[row]
                keep = set(range(min(width, 32 * self.num_words))) if allowed is None else {
                    t for t in allowed if t < min(width, 32 * self.num_words)}
                assert set(torch.isfinite(masked).nonzero()[:, 0].tolist()) == keep
                idx = torch.tensor(sorted(keep))
                assert torch.equal(masked[idx], raw[idx])
                assert st.tokens[row] in keep
                rid = next(r for r, (a, b) in zip(st.req_ids, st.slices, strict=True) if a <= row < b)
                if rid in greedy:
                    assert st.tokens[row] == int(idx[raw[idx].argmax()])
        return num


def _engine(path: Any, **scheduler: Any) -> EngineCore:
    return EngineCore(paged_config(path, block_size=8, max_num_seqs=6, max_num_batched_tokens=48,
                                   scheduler=scheduler))


PROMPTS = random_prompts([11, 30, 7], VOCAB, seed=9)
SAMPLING = {
    "greedy": {},
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=1.0, top_k=2),
    "top-p": dict(temperature=1.0, top_p=0.5),
}


# -- the device op -------------------------------------------------------------------------
@pytest.mark.parametrize("num_words", [2, 4, 5])  # narrower, exact (100 -> 4 words), wider
def test_apply_masks_only_the_selected_rows(num_words: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    before = logits.clone()
    sets: list[set[int] | None] = [{3, 63, 64, 99, 130}, None, {0, 31, 32}]
    bm = make_bitmask(sets, num_words)
    words = torch.frombuffer(bm.words, dtype=torch.int32).view(bm.num_rows, bm.num_words)
    none = apply_grammar_bitmask(logits, words, torch.tensor([4, 1, 2]), torch.tensor([0, 1, 2]))
    assert none.tolist() == [False, False, False]
    for row in (0, 3):
        assert torch.equal(logits[row], before[row])
    width = min(100, 32 * num_words)
    for row, allowed in ((4, sets[0]), (1, sets[1]), (2, sets[2])):
        keep = set(range(width)) if allowed is None else {t for t in allowed if t < width}
        assert set(torch.isfinite(logits[row]).nonzero()[:, 0].tolist()) == keep
        idx = torch.tensor(sorted(keep))
        assert torch.equal(logits[row, idx], before[row, idx])


def test_a_row_allowing_nothing_keeps_its_argmax() -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    # token 45 is beyond the logits' width: nothing below it is allowed
    words = torch.frombuffer(make_bitmask([set(), {45}], 2).words, dtype=torch.int32).view(2, 2)
    none = apply_grammar_bitmask(logits, words, torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert none.tolist() == [True, True]
    for row in range(2):
        assert torch.isfinite(logits[row]).nonzero()[:, 0].tolist() == [int(before[row].argmax())]


def test_rows_follow_the_sample_slices() -> None:
    req_ids = ["a", "chunk", "s", "b"]
    slices = [(0, 1), (1, 1), (1, 4), (4, 5)]  # "s" verifies two drafts: three rows
    assert grammar_rows({"s": 2, "chunk": 0, "gone": 0, "b": 0}, 5, req_ids, slices) == (
        [1, 2, 3, 4], [2, 3, 4, 0])
    with pytest.raises(ValueError, match="'s' samples 3 positions from row 3"):
        grammar_rows({"s": 3}, 5, req_ids, slices)


def test_cuda_staging_path_on_the_cpu() -> None:
    """The pinned-staging path of CUDA (unpinned here): the same words and rows, two
    buffers used in turn, grown on demand."""
    from types import SimpleNamespace

    runner = SimpleNamespace(_grammar_staging=[None, None], _grammar_turn=0, device=torch.device("cpu"))
    bufs = []
    for num_rows in (3, 2, 40, 1):
        bm = make_bitmask([{r, 2 * r + 1} for r in range(num_rows)])
        words = torch.frombuffer(bm.words, dtype=torch.int32)
        lrows, mrows = list(range(num_rows, 0, -1)), list(range(num_rows))
        w, dl, dm = _stage_grammar(runner, words, lrows, mrows, bm.num_rows, bm.num_words,  # type: ignore[arg-type]
                                   pin=False)
        assert torch.equal(w, words.view(num_rows, bm.num_words))
        assert dl.tolist() == lrows and dm.tolist() == mrows
        bufs.append(runner._grammar_staging[runner._grammar_turn ^ 1])
    assert bufs[0] is not bufs[1] and bufs[1] is bufs[3] and len(bufs[2]) >= 2 * 40 + 40 * 16


# -- through the scheduler -----------------------------------------------------------------
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_sampled_tokens_stay_in_the_allowed_sets(sampling: str, model_dir: Any) -> None:
    """Greedy, temperature 1, top-k, top-p: every token of the structured request lies in
    its position's set; its neighbours' logits are not touched."""
    path = model_dir("llama")
    engine = _engine(path)
    rec = Constrained(engine, {"c"})
    params = SAMPLING[sampling]
    reqs = [greedy_request("c", PROMPTS[0], 12, **params), greedy_request("u", PROMPTS[1], 12),
            greedy_request("v", PROMPTS[2], 12, **params)]
    out = run_engine(engine, reqs)
    assert all(t in allowed_at("c", len(PROMPTS[0]) + i) for i, t in enumerate(out["c"]))
    assert len(out["c"]) == 12
    assert rec.check_rows(greedy={"c"} if not params else set()) == 12


@pytest.mark.parametrize("sampling", ["greedy", "temperature"])
def test_unconstrained_neighbours_sample_as_without_it(sampling: str, model_dir: Any) -> None:
    """Neighbours sample bit-for-bit what they sample in the same batch without a
    bitmask (shared-generator rows too), and a seeded one what it samples alone."""
    path = model_dir("llama")
    params = SAMPLING[sampling]

    def run(constrain: bool, alone: bool = False) -> dict[str, list[int]]:
        engine = _engine(path)
        if constrain:
            Constrained(engine, {"c"})
        reqs = [greedy_request("u", PROMPTS[1], 10, **params),
                greedy_request("s", PROMPTS[2], 10, seed=5, **params)]
        if not alone:
            reqs.insert(1, greedy_request("c", PROMPTS[0], 10, **params))
        return run_engine(engine, reqs)

    masked, plain, alone = run(True), run(False), run(False, alone=True)
    assert masked["c"] != plain["c"]
    assert masked["u"] == plain["u"] and masked["s"] == plain["s"]
    assert masked["s"] == alone["s"]


def test_decode_graph_path_is_masked(model_dir: Any) -> None:
    """Decode-only steps through the runner's graph branch (a stand-in replaying the model
    eagerly): the logits are computed outside the graph and masked there."""
    path = model_dir("llama")
    engine = _engine(path)
    runner = engine.runner

    class Graphs:
        runs = 0

        def can_run(self, inputs: Any) -> bool:
            return bool(inputs.is_decode_only)

        def run(self, inputs: Any, fill: Any = None) -> Any:
            Graphs.runs += 1
            ids, pos, meta = runner._device_inputs(inputs)
            if fill is not None:
                ids[fill[0]] = fill[2][fill[1]]
            return runner.model(ids, pos, runner.kv_caches, meta)

    runner.graphs = Graphs()
    rec = Constrained(engine, {"c"})
    out = run_engine(engine, [greedy_request("c", PROMPTS[0], 8), greedy_request("u", PROMPTS[1], 8)])
    assert Graphs.runs >= 5
    assert all(t in allowed_at("c", len(PROMPTS[0]) + i) for i, t in enumerate(out["c"]))
    assert rec.check_rows(greedy={"c", "u"}) == 8


@pytest.mark.parametrize("sampling", ["greedy", "temperature"])
def test_async_steps_are_masked(sampling: str, model_dir: Any) -> None:
    """execute_async with the previous step's tokens in flight: the step's own logits
    are masked before its sampler runs; greedy output is that of synchronous steps."""
    path = model_dir("llama")
    params = SAMPLING[sampling]

    def run(async_scheduling: bool) -> tuple[dict[str, list[int]], Constrained]:
        engine = _engine(path, async_scheduling=async_scheduling)
        rec = Constrained(engine, {"c"})
        reqs = [greedy_request("c", PROMPTS[0], 12, **params),
                greedy_request("u", PROMPTS[1], 12, seed=3, **params)]
        return run_engine(engine, reqs), rec

    out, rec = run(True)
    assert sum(st.in_flight for st in rec.steps) >= 8
    assert all(t in allowed_at("c", len(PROMPTS[0]) + i) for i, t in enumerate(out["c"]))
    assert rec.check_rows(greedy={"c"} if not params else set()) == 12
    sync, _ = run(False)
    assert out["u"] == sync["u"]
    if not params:
        assert out["c"] == sync["c"]


def _spec_engine(path: Any, expected: dict[str, list[int]]) -> tuple[EngineCore, list[int]]:
    """Drafts from ``expected`` (a wrong one every third step), as in the runner tests."""
    engine = _engine(path, num_speculative_tokens=3)
    runner = engine.runner
    proposed: list[int] = []

    def propose(plan: dict[str, int]) -> dict[str, list[int]]:
        drafts = {}
        for rid, st in runner.input_batch.states.items():
            done = st.num_tokens - st.num_prompt_tokens
            d = list(expected[rid][done:done + plan.get(rid, 0)])
            if done % 3 == 2 and d:
                d[-1] = (d[-1] + 1) % VOCAB
            drafts[rid] = d
            proposed.append(len(d))
        return drafts

    runner.propose_draft_token_ids = propose
    return engine, proposed


def test_drafts_are_verified_under_their_rows(model_dir: Any) -> None:
    """With drafts, row ``first + j`` constrains the target after the j-th draft: the
    constrained greedy output is unchanged by speculation and drafts save steps."""
    path = model_dir("llama")
    reqs = lambda: [greedy_request("c", PROMPTS[0], 16), greedy_request("u", PROMPTS[1], 16)]  # noqa: E731
    plain = _engine(path)
    Constrained(plain, {"c"})
    expected = run_engine(plain, reqs())
    engine, proposed = _spec_engine(path, expected)
    rec = Constrained(engine, {"c"})
    got = run_engine(engine, reqs())
    assert got == expected
    assert sum(proposed) > 0 and engine.num_steps < plain.num_steps
    multi = [st for st in rec.steps if len(st.positions.get("c", ())) > 1]
    assert multi  # steps where "c" verified drafts under several rows
    assert rec.check_rows(greedy={"c", "u"}) > 16


def test_sampled_drafts_stay_in_the_allowed_sets(model_dir: Any) -> None:
    path = model_dir("llama")
    drafts_from = {"c": [next(iter(sorted(allowed_at("c", len(PROMPTS[0]) + i)))) for i in range(16)],
                   "u": [0] * 16}
    engine, proposed = _spec_engine(path, drafts_from)
    rec = Constrained(engine, {"c"})
    out = run_engine(engine, [greedy_request("c", PROMPTS[0], 16, temperature=1.0, top_p=0.9),
                              greedy_request("u", PROMPTS[1], 16)])
    assert sum(proposed) > 0
    assert all(t in allowed_at("c", len(PROMPTS[0]) + i) for i, t in enumerate(out["c"]))
    assert rec.check_rows(greedy={"u"}) >= 16


def test_a_narrow_bitmask_disallows_the_tokens_beyond_it(model_dir: Any) -> None:
    """8 words (256 tokens) of all-allowed rows for a 512-token vocabulary."""
    path = model_dir("llama")
    engine = _engine(path)
    rec = Constrained(engine, {"c", "g"}, allowed=lambda rid, pos: None, num_words=8)
    out = run_engine(engine, [greedy_request("c", PROMPTS[0], 16, temperature=1.0),
                              greedy_request("g", PROMPTS[1], 16)])
    assert all(t < 256 for t in out["c"] + out["g"])
    assert rec.check_rows(greedy={"g"}) == 32
    plain = run_engine(_engine(path), [greedy_request("c", PROMPTS[0], 16, temperature=1.0)])
    assert any(t >= 256 for t in plain["c"])  # the mask, not chance, kept them low


@pytest.mark.parametrize("debug", [False, True])
def test_a_row_allowing_nothing(debug: bool, model_dir: Any) -> None:
    """A bug upstream: in production the row samples its unmasked argmax; with
    ``check_grammar_bitmask`` the runner says which request and row."""
    path = model_dir("llama")
    engine = _engine(path)
    engine.runner.check_grammar_bitmask = debug
    Constrained(engine, {"c"}, allowed=lambda rid, pos: set())
    engine.add_request(greedy_request("c", PROMPTS[0], 2, temperature=1.0))
    so = engine.scheduler.schedule()
    if debug:
        with pytest.raises(AssertionError, match=r"\('c', 0\)"):
            engine.runner.execute(so)
        return
    raw = {}
    real = engine.runner.model.compute_logits

    def spy(hidden: Any) -> Any:
        raw["x"] = (out := real(hidden)).clone()  # before the mask
        return out

    engine.runner.model.compute_logits = spy
    out = engine.runner.execute(so)
    assert out.sampled_token_ids == [[int(raw["x"][0].argmax())]]


@pytest.mark.parametrize("num_words", [16, 13, 20])  # as wide as the 500-token vocabulary, narrower, wider
def test_the_compiled_cpu_kernel_masks_exactly_as_the_torch_ops(num_words):
    from schedkit.runners.paged.cpu_kernels import apply_grammar_bitmask_cpu, load_cpu_kernels
    from schedkit.runners.paged.sampler import apply_grammar_bitmask

    if load_cpu_kernels() is None:
        pytest.skip("no C++ compiler: the runner uses the torch ops")
    g = torch.Generator().manual_seed(num_words)
    vocab = 500
    logits = torch.randn(12, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (9, num_words), dtype=torch.int32, generator=g)
    words[1] = 0  # allows nothing: keeps its argmax only
    words[2] = -1  # allows everything
    words[3, :] = 0
    if num_words > 15:
        words[3, 15] = 1 << 20  # only a token past the vocabulary (15 * 32 + 20 = 500): nothing
    words[4] = 0
    words[4, 2] = 0b101  # tokens 64 and 66
    logit_rows = torch.tensor([0, 3, 5, 6, 7, 11], dtype=torch.int32)
    mask_rows = torch.tensor([1, 2, 3, 4, 0, 8], dtype=torch.int32)
    expected, got = logits.clone(), logits.clone()
    none_ref = apply_grammar_bitmask(expected, words, logit_rows, mask_rows)
    none_got = apply_grammar_bitmask_cpu(got, words, logit_rows, mask_rows)
    assert torch.equal(got, expected) and torch.equal(none_got, none_ref)
    assert none_got.tolist() == [True, False, True, False, False, False]
    assert torch.isfinite(got[6]).nonzero().flatten().tolist() == [64, 66]
    assert torch.isfinite(got[0]).sum() == 1 and torch.equal(got[1], logits[1])  # untouched row
