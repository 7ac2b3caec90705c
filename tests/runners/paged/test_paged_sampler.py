"""Sampler: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from schedkit.core.request import SamplingParams  # noqa: E402
from schedkit.runners.paged.sampler import Sampler, SamplingBatch, apply_top_k_top_p  # noqa: E402

CPU = torch.device("cpu")


def _sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None,
            seed: int = 0) -> list[int]:
    batch = SamplingBatch.build(params, positions or [0] * len(params), logits.shape[1], CPU)
    return Sampler(CPU, seed)(logits, batch).tolist()


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 50)
    assert _sample(logits, [SamplingParams(temperature=0.0)] * 5) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("tiny", [1e-300, 1e-46, 1e-45, 1e-40, 1e-38, 1e-30, 9.9e-6])
def test_a_vanishing_temperature_is_greedy(tiny: float) -> None:
    # float32 logits / 1e-40 overflow (NaN after the softmax: the last id, every step), and
    # below ~7e-46 the temperature rounds to 0 on the device and sampled at 1.0 instead
    assert SamplingParams(temperature=tiny).temperature == 0.0
    logits = torch.randn(6, 300) * 10
    params = [SamplingParams(temperature=tiny, seed=i) for i in range(3)] + [SamplingParams(temperature=1.0)] * 3
    assert _sample(logits, params)[:3] == logits[:3].argmax(-1).tolist()
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25]]))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.7]))
    keep = torch.isfinite(masked)
    assert keep[0].tolist() == [False, True, False, True]  # top-2
    assert keep[1].tolist() == [False, True, False, True]  # 0.5 + 0.25 >= 0.7
    torch.testing.assert_close(masked[keep], logits[keep])


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=3)]
    out = _sample(logits, params)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[3] in logits[3].topk(3).indices.tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 1000, generator=g)
    others = torch.randn(3, 1000, generator=g)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = _sample(row, [p], [17], seed=1)
    batched = _sample(torch.cat([others[:2], row, others[2:]]),
                      [SamplingParams()] * 2 + [p] + [SamplingParams()], [0, 0, 17, 0], seed=2)
    assert batched[2] == alone[0]
    draws = {_sample(row, [p], [pos])[0] for pos in range(20)}
    assert len(draws) > 5  # the position varies the draw


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(6000, 3).contiguous()
    out = torch.tensor(_sample(logits, [SamplingParams(temperature=1.0)] * 6000))
    freq = torch.bincount(out, minlength=3).float() / 6000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    top_p = torch.tensor(_sample(logits[:500], [SamplingParams(top_p=0.6)] * 500))
    assert set(top_p.tolist()) == {0, 1}


def test_a_zero_probability_token_is_never_drawn() -> None:
    # Masked tokens (-inf: top-k, top-p or a grammar) between and around allowed ones.
    logits = torch.full((4000, 9), float("-inf"))
    logits[:, 1] = 0.0
    logits[:, 4] = 1.0
    logits[:, 7] = -1.0
    out = torch.tensor(_sample(logits, [SamplingParams(temperature=1.3)] * 4000))
    assert set(out.tolist()) == {1, 4, 7}
    probs = torch.softmax(logits[0] / 1.3, -1)
    freq = torch.bincount(out, minlength=9).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_sampling_over_a_large_vocabulary_follows_the_distribution() -> None:
    # Much of the mass spread thinly over 49,152 entries: the float32 running sum must
    # still give each region its share.
    g = torch.Generator().manual_seed(5)
    row = torch.randn(49152, generator=g)
    row[:3] = torch.tensor([9.0, 8.5, 8.0])
    probs = row.softmax(-1)
    out = torch.tensor(_sample(row.expand(3000, -1).contiguous(), [SamplingParams(temperature=1.0)] * 3000))
    head = [float((out == i).float().mean()) for i in range(3)]
    torch.testing.assert_close(torch.tensor(head), probs[:3], atol=0.03, rtol=0)
    tail = float((out >= 3).float().mean())
    assert abs(tail - float(probs[3:].sum())) < 0.03
