"""Sampling: greedy, temperature, top-k and top-p, with per-request seeds.

Random rows draw by inverting their cumulative distribution: one uniform number per row,
scaled to the row's total mass, located in the row's running sum of probabilities by a
binary search, so a whole batch samples with one softmax, one cumsum and one
``searchsorted``. (The exponential race, ``argmax(probs / Exp(1))``, needs a random number
per vocabulary entry, and on the CPU drawing those numbers cost most of the race and a
large share of a decode step; docs/model-runner.md has the figures.) A token of
probability 0 (masked by top-k, top-p or a grammar) is never drawn: its running sum
equals its predecessor's, and the search takes the first entry strictly above the
target. A row with a seed draws its number from a generator seeded by ``(seed, position
of the sampled token)``: the same request samples the same tokens whatever else is in
the batch, and after preemption and recomputation too. Tokens stay on the device; the
runner copies them to the host once per step.

Structured outputs: :func:`apply_grammar_bitmask` runs on the logits before the sampler
(the runner calls it), so greedy, temperature, top-k and top-p all see the disallowed
tokens at -inf; rows of unconstrained requests are not touched. Sampling is all torch
ops (no Triton kernel), so the mask holds on CUDA as on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schedkit.core.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def step_seed(seed: int, position: int) -> int:
    """Generator seed of the token sampled at ``position`` of a request seeded ``seed``."""
    return (seed * _MIX + position) & _MASK63


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings of one step (one row per sampled position)."""

    temperature: torch.Tensor | None
    """[N] float32; 0 means greedy (None when every row is greedy)."""
    top_k: torch.Tensor | None
    """[N] int64; the vocabulary size where top-k is off."""
    top_p: torch.Tensor | None
    """[N] float32; 1 where top-p is off."""
    seeds: list[int | None]
    """Per-row generator seed (already mixed with the position) or None."""
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], positions: Sequence[int], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        """One row per (params, position of the token to sample)."""
        temps = [float(p.temperature) for p in params]
        if not any(temps):  # all greedy: nothing to copy to the device
            return cls(None, None, None, [None] * len(temps), True, True, False, False)
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [float(p.top_p) for p in params]
        seeds = [None if p.seed is None or p.temperature == 0 else step_seed(p.seed, pos)
                 for p, pos in zip(params, positions, strict=True)]
        return cls(temperature=torch.tensor(temps, dtype=torch.float32).to(device, non_blocking=True),
                   top_k=torch.tensor(top_k, dtype=torch.int64).to(device, non_blocking=True),
                   top_p=torch.tensor(top_p, dtype=torch.float32).to(device, non_blocking=True),
                   seeds=seeds, all_greedy=all(t == 0 for t in temps), any_greedy=not all(temps),
                   any_top_k=any(k < vocab_size for k in top_k), any_top_p=any(p < 1 for p in top_p))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's top-k and top-p sets."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_grammar_bitmask(logits: torch.Tensor, words: torch.Tensor, logit_rows: torch.Tensor,
                          mask_rows: torch.Tensor, shifts: torch.Tensor | None = None) -> torch.Tensor:
    """Set to -inf, in place, the tokens ``words[mask_rows[i]]`` disallows in row
    ``logit_rows[i]`` of ``logits`` (bit ``t % 32`` of word ``t // 32`` set: token ``t``
    allowed). Other rows are untouched.

    Tokens at or above ``32 * words.shape[1]`` are disallowed (logits wider than the
    bitmask); words beyond the logits' width are ignored. A row that allows no token
    (a bug upstream) keeps only its argmax, so it still samples a real token.

    Args:
        logits: [N, vocab] float logits on the device.
        words: [R, W] int32 bitmask words on the same device.
        logit_rows: [M] int32/int64 rows of ``logits`` to constrain (distinct).
        mask_rows: [M] their rows in ``words``.
        shifts: ``arange(32)`` int32 on the device (cached by the caller; made if None).

    Returns:
        [M] bool on the device: True where a row allowed no token (no host sync).
    """
    vocab = logits.shape[1]
    need = (vocab + 31) // 32
    w = words.index_select(0, mask_rows)
    if w.shape[1] > need:
        w = w[:, :need]
    elif w.shape[1] < need:
        w = torch.nn.functional.pad(w, (0, need - w.shape[1]))  # zero words: disallowed
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    blocked = (w[:, :, None] >> shifts).bitwise_and_(1).eq(0).view(len(w), need * 32)[:, :vocab]
    none_allowed = blocked.all(dim=1)
    rows = logits.index_select(0, logit_rows)
    top = rows.argmax(dim=1, keepdim=True)
    blocked.scatter_(1, top, blocked.gather(1, top) & ~none_allowed[:, None])
    logits.index_put_((logit_rows,), rows.masked_fill_(blocked, float("-inf")))
    return none_allowed


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; on the CPU by the compiled kernel where it is built (the
    same answer, rows on every thread, where torch's argmax uses one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(1) == 1:
        from schedkit.runners.paged import cpu_kernels

        if cpu_kernels.load_cpu_kernels() is not None:
            return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Args:
        device: Where logits live.
        seed: Seed of the generator shared by rows without their own seed.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[N, vocab] float32 logits -> [N] int64 token ids (on the device)."""
        if batch.all_greedy:
            return _argmax(logits)
        assert batch.temperature is not None
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        scaled = logits / temperature[:, None]
        if batch.any_top_k or batch.any_top_p:
            scaled = apply_top_k_top_p(scaled, batch.top_k if batch.any_top_k else None,
                                       batch.top_p if batch.any_top_p else None)
        # exp(scaled - row max), summed along the row in place on the fresh ``scaled``:
        # one [N, vocab] buffer in all (new buffers this size page-fault on the CPU).
        cdf = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
        u = torch.rand((len(cdf), 1), generator=self.generator, device=cdf.device)
        for row, seed in enumerate(batch.seeds):
            if seed is not None:
                self._row_generator.manual_seed(seed)
                u[row] = torch.rand(1, generator=self._row_generator, device=cdf.device)
        target = u * cdf[:, -1:]  # the row's total mass (not normalised)
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if not batch.any_greedy:
            return sampled
        return torch.where(batch.temperature > 0, sampled, _argmax(logits))
