"""Structured outputs through the engine on the paged runner (CPU, a tiny random-weight
model; the same check runs on CUDA in tests/gpu/test_structured_gpu.py): regex-constrained
greedy and sampled requests match their patterns on the eager and async paths and with
n-gram speculative decoding, and unconstrained requests of the batch are unchanged."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("regex")

from schedkit.core.request import Request, SamplingParams  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.testing import paged_config, random_prompts, run_engine  # noqa: E402
from schedkit.structured.testing import structured_backend_plugin, structured_text  # noqa: E402

VOCAB = 512
PATTERNS = [r"[a-f]{2,4}-[0-9]{2}", r"(ab|cd){1,3}x", r"[0-9]{1,3}_[a-z]{3}", r"(yes|no|maybe)"]  # bounded: a random model may repeat forever


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("m") / "llama", tiny_config("llama"))


def requests(with_constraints: bool) -> list[Request]:
    prompts = random_prompts([5, 9, 17, 3, 12, 7, 20, 4], VOCAB, seed=3)
    out = []
    for i, p in enumerate(prompts):
        if i % 2 == 0 and with_constraints:
            sp = SamplingParams(max_tokens=40, eos_token_id=0, temperature=0.0 if i % 4 == 0 else 1.0,
                                seed=i, structured_outputs={"regex": PATTERNS[(i // 2) % 4]})
        else:
            sp = SamplingParams(max_tokens=12, temperature=0.0 if i % 3 else 0.9, seed=i, ignore_eos=True)
        out.append(Request(str(i), p, sp, 0.0))
    return out


def run(model, device: str = "cpu", constrained: bool = True, served: list | None = None,
        **kw) -> dict[str, list[int]]:
    """Each request's tokens (``served``: filled with the requests)."""
    cfg = paged_config(model, device=device, max_num_seqs=8, num_blocks=128, **kw)
    cfg = cfg.model_copy(update={"structured_outputs": cfg.structured_outputs.model_copy(
        update={"backend": "synthetic"})})
    engine = EngineCore(cfg, extra_plugins=[structured_backend_plugin(VOCAB)])
    reqs = requests(constrained)
    if served is not None:
        served += reqs
    return run_engine(engine, reqs)


def check(outs: dict[str, list[int]], plain: dict[str, list[int]]) -> None:
    for i in range(0, 8, 2):
        text = structured_text(outs[str(i)], VOCAB)
        assert re.fullmatch(PATTERNS[(i // 2) % 4], text), (i, text)
        assert outs[str(i)][-1] == 0  # ended by the grammar's stop token
    for i in range(1, 8, 2):
        assert outs[str(i)] == plain[str(i)], i


@pytest.mark.parametrize("kw", [
    {}, {"scheduler": {"async_scheduling": True}},
    {"scheduler": {"num_speculative_tokens": 3}, "speculative": "ngram"},
], ids=["sync", "async", "ngram"])
def test_regex_outputs_match_and_neighbours_are_unchanged(model, kw):
    kw = dict(kw)
    if kw.pop("speculative", None):
        pytest.importorskip("numpy")
    check(run(model, **kw), run(model, constrained=False, **kw))


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "draft_model-1-layer", "eagle",
                                    "draft_model-async", "eagle-async"])
def test_every_proposer_keeps_structured_outputs_token_for_token(model, tmp_path, method):
    """Drafts of every proposer, checked against each request's grammar before they are
    scheduled and verified against masked targets: constrained and unconstrained,
    greedy and seeded requests come out exactly as without speculation. Under
    asynchronous scheduling (the drafting models: drafts proposed inside the step) the
    structured requests get no drafts and the others do."""
    runner: dict = {"speculative_method": method.split("-")[0]}
    scheduler: dict = {"num_speculative_tokens": 3}
    if method.endswith("-async"):
        scheduler["async_scheduling"] = True
    if method == "draft_model-1-layer":
        runner["draft_model"] = {"num_layers": 1}
    if method.startswith("eagle"):
        import json

        from schedkit.runners.paged.builder import build_random_eagle_head

        head = build_random_eagle_head(tmp_path / "head", json.loads((model / "config.json").read_text()), seed=4)
        runner["draft_model"] = {"name": str(head)}
    plain = run(model, scheduler={"async_scheduling": scheduler.get("async_scheduling", False)})
    served: list[Request] = []
    assert run(model, scheduler=scheduler, served=served, **runner) == plain
    drafted = {r.request_id: r.num_draft_tokens for r in served}
    assert sum(drafted[str(i)] for i in range(1, 8, 2)) > 0  # the unconstrained ones were drafted for
    if "async_scheduling" in scheduler:
        assert all(drafted[str(i)] == 0 for i in range(0, 8, 2))
