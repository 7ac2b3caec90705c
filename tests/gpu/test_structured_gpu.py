"""Structured outputs on CUDA (run on the H200; skipped without CUDA): the grammar
bitmask goes to the device through the pinned staging buffers and masks the logits on
the CUDA-graph, eager and async paths and with n-gram drafts; regex-constrained outputs
match, and unconstrained neighbours are unchanged (tests/structured/test_paged_structured.py
is the same check on CPU).

Run: ``python -m pytest tests/gpu/test_structured_gpu.py -m gpu -q``.
"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests in their own process",
                allow_module_level=True)
pytest.importorskip("regex")

from schedkit.core.request import Request, SamplingParams  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.testing import paged_config, random_prompts, run_engine  # noqa: E402
from schedkit.structured.testing import structured_backend_plugin, structured_text  # noqa: E402

VOCAB = 512
PATTERNS = [r"[a-f]{2,4}-[0-9]{2}", r"(ab|cd){1,3}x", r"[0-9]{1,3}_[a-z]{3}", r"(yes|no|maybe)"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("m") / "llama", tiny_config("llama"))


def workload(constrained: bool) -> list[Request]:
    prompts = random_prompts([5, 9, 17, 3, 12, 7, 20, 4] * 4, VOCAB, seed=3)
    out = []
    for i, p in enumerate(prompts):
        if i % 2 == 0 and constrained:
            sp = SamplingParams(max_tokens=40, eos_token_id=0, temperature=0.0 if i % 4 == 0 else 1.0,
                                seed=i, structured_outputs={"regex": PATTERNS[(i // 2) % 4]})
        else:
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out.append(Request(str(i), p, sp, 0.0))
    return out


@pytest.mark.parametrize("eager, scheduler", [
    (False, {}), (True, {}), (False, {"async_scheduling": True}), (False, {"num_speculative_tokens": 3})],
    ids=["graphs", "eager", "async", "ngram"])
def test_regex_outputs_match_on_every_cuda_path(model, eager, scheduler):
    def run(constrained: bool) -> dict[str, list[int]]:
        cfg = paged_config(model, device="cuda", max_num_seqs=32, num_blocks=256, enforce_eager=eager,
                           scheduler=scheduler)
        cfg = cfg.model_copy(update={"structured_outputs": cfg.structured_outputs.model_copy(
            update={"backend": "synthetic"})})
        engine = EngineCore(cfg, extra_plugins=[structured_backend_plugin(VOCAB)])
        assert (engine.runner.graphs is None) == eager
        return run_engine(engine, workload(constrained))

    outs, plain = run(True), run(False)
    for i in range(0, 32, 2):
        text = structured_text(outs[str(i)], VOCAB)
        assert re.fullmatch(PATTERNS[(i // 2) % 4], text), (i, text)
    for i in range(1, 32, 2):
        assert outs[str(i)] == plain[str(i)], i
