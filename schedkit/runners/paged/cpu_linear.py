"""The CPU linear layers: oneDNN GEMMs on pre-packed weights, and the compute dtype.

On the CPU every ``nn.Linear`` of the decoder (and the LM head) is swapped for a
:class:`PackedLinear` once the weights are loaded: its weight is reordered a single time
into oneDNN's blocked layout, so each call runs oneDNN's matmul without re-packing
(faster than MKL's sgemm at these shapes on this project's AVX2 hosts, see
docs/model-runner.md, and the path to AMX where the CPU has it). Where oneDNN has no matmul for the model's dtype
(bfloat16 needs AVX512-BF16 or AMX; float16 AMX-FP16), :func:`cpu_compute_dtype` picks
float32 arithmetic on the same weights instead: widened once at load, so each GEMM runs
at float32 speed rather than through bfloat16 emulation; the KV cache stays in the
model's dtype.

A step with one row (the decode of a single sequence: most steps of a lightly loaded
server) skips oneDNN: :func:`cpu_kernels.gemv` streams a second copy of the weight, laid
out for it at load, in one pass (oneDNN spends a fixed set-up on every call and reads
the weight more slowly at one row; ``SCHEDKIT_CPU_GEMV=0`` gives oneDNN's figure, and
docs/model-runner.md has the decode steps measured both ways). Where the kernel is built for float32 (AVX-512) or bfloat16
(AVX512-BF16), the weights are kept twice; ``SCHEDKIT_CPU_GEMV=0`` turns it off.

The same kernel also takes float32 steps of several rows, in register tiles of 6 rows x
16 outputs over that second copy, where :func:`multi_row_gemm` says so: always on CPUs
without AVX-512 (faster than oneDNN there for prefills and batched decodes, measured
by ``scripts/bench_cpu_linear.py``; figures in docs/model-runner.md), on AVX-512
CPUs where it beat oneDNN in a probe on the machine. ``SCHEDKIT_CPU_GEMM=0`` keeps oneDNN
for them, ``1`` the tiles.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from schedkit.runners.paged import cpu_kernels

PACK_BATCH_HINT = 64
"""Rows oneDNN tunes the packed layout for (any row count works)."""

ROW_ALIGN = 16
"""oneDNN builds (JIT-compiles) a matmul for each row count it meets, about 1-2 ms per
weight shape on a Sapphire Rapids core, and keeps the last 1,024 it built (each holds
up to about a megabyte, so a larger cache is no answer). A server's steps come in every
row count from 1 to the token budget, so past a few hundred row counts the cache evicts
kernels it needs again and every step pays for new ones: cycling 298 row counts through
SmolLM2-135M's four weight shapes took 2.8-3.1 s a pass in bfloat16 (2 threads) where
the same GEMMs take 0.27-0.28 s with their kernels kept (``scripts/bench_cpu_linear.py
--row-counts``). So a call of more than :func:`pad_from` rows is padded with zero rows to
a multiple of ``ROW_ALIGN`` (the answer is the first rows of the result), which bounds the
row counts oneDNN ever sees."""

PAD_FROM_16BIT = 16
"""bfloat16 and float16: padded from 17 rows. AMX works in 16-row tiles, so a padded call
costs little (129 rows padded to 144: 2-5% more time, 513 to 528: 11% less) and the row
counts stay within the cache (144 for a 2,048-token budget)."""

PAD_FROM_FLOAT32 = 256
"""float32: padded from 257 rows only. Its kernels' time grows with every row (129 rows
padded to 144 cost 5-11% more, and a served 128-token prompt's prefill 6% more), while
above 256 rows the padding is at most 6% of the rows. Below, each row count keeps its own
kernel, built on first use."""

WARM_ROWS = 64
"""Row counts up to which the runner has oneDNN build the decoder's and the LM head's
kernels at start (:func:`warm_gemm_row_counts`): decode steps live there, and without it
a fresh server's first steps at each new batch size paid for new kernels."""


_LINEAR = torch.ops.mkldnn._linear_pointwise.default
"""The op's overload itself: a decode step makes 121 of these calls (SmolLM2-135M), and
resolving the overload packet each time costs about 2 us a call."""


def pad_from(dtype: torch.dtype) -> int:
    """Rows above which a oneDNN call in ``dtype`` is padded to a multiple of ``ROW_ALIGN``."""
    return PAD_FROM_16BIT if dtype in (torch.bfloat16, torch.float16) else PAD_FROM_FLOAT32


def _pad_rows(rows: int, from_rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_ALIGN`` when above ``from_rows``."""
    return rows if rows <= from_rows else -(-rows // ROW_ALIGN) * ROW_ALIGN


def padded_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count a call of ``rows`` rows reaches oneDNN with."""
    return _pad_rows(rows, pad_from(dtype))


def _gemv_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The weight in the one-row GEMM's layout where that kernel serves it (see
    :func:`cpu_kernels.gemv`), else None."""
    n, k = weight.shape
    if n % 16 != 0 or (bias is not None and bias.dtype != weight.dtype) or (weight.dtype == torch.bfloat16 and k % 2 != 0) \
            or not cpu_kernels.gemv_supported(weight.dtype):
        return None
    return cpu_kernels.pack_gemv_weight(weight)


def onednn_matmul_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs a native matmul in ``dtype``."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:  # oneDNN's own check accepts AVX-512 without BF16 (emulated)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and (
            torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()) and torch.cpu._is_amx_fp16_supported()
    return False


def cpu_compute_dtype(model_dtype: torch.dtype, setting: str) -> torch.dtype:
    """The arithmetic dtype for ``runner.compute_dtype = setting`` on this CPU."""
    if setting == "float32":
        return torch.float32
    if setting == "model" or onednn_matmul_supported(model_dtype):
        return model_dtype
    return torch.float32


GEMM_PROBE_SHAPES = ((128, 576, 3072), (128, 1536, 576), (32, 576, 3072))
"""[rows, in, out] of the probe that decides :func:`multi_row_gemm` on AVX-512 CPUs: a
prefill chunk through a small model's widest projection and its down projection (K in
two chunks), and a decode batch."""
GEMM_PROBE_REPS = 9
GEMM_PROBE_ROUNDS = 3
GEMM_PROBE_MARGIN = 0.95
"""The tiles are chosen only if they took at most this fraction of oneDNN's time in
every one of :data:`GEMM_PROBE_ROUNDS` probes: a verdict is kept for good, and a close
one is as likely to be noise (on a Zen 4 VM one probe found the tiles 8% faster and
three later ones oneDNN 1-7% faster)."""

logger = logging.getLogger(__name__)
_choice_lock = threading.Lock()
_choices: dict[int, bool] = {}
"""Thread count -> the verdict, once known in this process."""


def time_gemm_paths(m: int, k: int, n: int, reps: int, generator: torch.Generator,
                    bias: bool = False) -> tuple[float, float]:
    """Median seconds of oneDNN's matmul and of the multi-row kernel on one random float32
    [m, k] x [k, n] product (plus a bias), ``reps`` calls of each taken in turn (so drift
    in the machine's speed hits both alike) after a warm-up round."""
    x, w = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    dnn_w = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
    ours_w = cpu_kernels.pack_gemv_weight(w)
    calls = (partial(_LINEAR, x, dnn_w, b, "none", [], ""), partial(cpu_kernels.gemv, x, ours_w, b, n))
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(reps + 1):
        for call, into in zip(calls, times, strict=True):
            t = time.perf_counter()
            call()
            if i:  # the first round warms up
                into.append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def probe_gemm(shapes: tuple[tuple[int, int, int], ...] = GEMM_PROBE_SHAPES,
               reps: int = GEMM_PROBE_REPS) -> tuple[float, float]:
    """Seconds of oneDNN's matmul and of the multi-row kernel on float32 ``shapes`` at
    torch's thread count (:func:`time_gemm_paths` per shape), summed over the shapes. The
    kernel must be built (:func:`cpu_kernels.gemm_supported`)."""
    g = torch.Generator().manual_seed(0)
    per_shape = [time_gemm_paths(m, k, n, reps, g) for m, k, n in shapes]
    return sum(t for t, _ in per_shape), sum(t for _, t in per_shape)


def _verdict_key() -> str:
    """What a saved verdict holds for: oneDNN's side (torch's version) and the probe."""
    return (f"torch {torch.__version__}; shapes {GEMM_PROBE_SHAPES}; reps {GEMM_PROBE_REPS}; "
            f"rounds {GEMM_PROBE_ROUNDS}; margin {GEMM_PROBE_MARGIN}")


def _read_verdict(path: Path, threads: int) -> tuple[dict[str, Any], bool | None]:
    """The file's entries (empty where it is missing or damaged) and the verdict saved for
    ``threads`` under this key, if any."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except Exception:  # noqa: BLE001 (missing, unreadable, not JSON, nested past the recursion limit)
        return {}, None
    if not isinstance(saved, dict):
        return {}, None
    entry = saved.get(str(threads))
    if isinstance(entry, dict) and entry.get("key") == _verdict_key() and isinstance(entry.get("multi_row"), bool):
        return saved, entry["multi_row"]
    return saved, None


def _write_verdict(path: Path, saved: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(saved, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _decide(threads: int) -> bool:
    """The verdict for ``threads`` on an AVX-512 CPU: the one saved beside the library
    (same library build, torch version and probe), else probed now and saved there. A
    lock file keeps two processes from probing at once (each would slow the other's
    timing). Anything that fails here leaves oneDNN in charge, as before the probe
    existed, with a warning."""
    lib = cpu_kernels.library_path()
    path = None if lib is None else lib.with_name(lib.name + ".gemm.json")
    try:
        with contextlib.ExitStack() as stack:
            if path is not None:
                lock = stack.enter_context(open(path.with_name(path.name + ".lock"), "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)
                saved, verdict = _read_verdict(path, threads)
                if verdict is not None:
                    return verdict
            rounds = [probe_gemm() for _ in range(GEMM_PROBE_ROUNDS)]
            verdict = all(t_ours <= GEMM_PROBE_MARGIN * t_dnn for t_dnn, t_ours in rounds)
            t_dnn, t_ours = min(rounds, key=lambda r: r[1] / r[0])  # the round most in the tiles' favour
            logger.info("multi-row float32 GEMM on %d threads: oneDNN %.2f ms, schedkit %.2f ms (of %d probes, the "
                        "one most in schedkit's favour): %s", threads, 1e3 * t_dnn, 1e3 * t_ours, len(rounds),
                        "schedkit" if verdict else "oneDNN")
            if path is not None:
                saved[str(threads)] = {"multi_row": verdict, "key": _verdict_key(),
                                       "onednn_ms": round(1e3 * t_dnn, 3), "schedkit_ms": round(1e3 * t_ours, 3),
                                       "rounds_ms": [[round(1e3 * a, 3), round(1e3 * b, 3)] for a, b in rounds]}
                with contextlib.suppress(OSError):  # a read-only cache: probe again next time
                    _write_verdict(path, saved)
            return verdict
    except Exception as e:  # noqa: BLE001 (a failed probe must not fail the model's load)
        logger.warning("could not compare the multi-row GEMM with oneDNN (%s: %s); several rows go to oneDNN",
                       type(e).__name__, e)
        return False


def multi_row_gemm(dtype: torch.dtype) -> bool:
    """Whether several rows of ``dtype`` go to the multi-row kernel rather than oneDNN.
    ``$SCHEDKIT_CPU_GEMM``: ``0`` never, ``1`` wherever the kernel is built (no probe),
    any other value or none: on CPUs without AVX-512 always (oneDNN runs AVX2 code there
    too, and the tiles measured faster), on AVX-512 CPUs if :func:`probe_gemm` found the
    tiles faster by :data:`GEMM_PROBE_MARGIN` in each of :data:`GEMM_PROBE_ROUNDS` rounds
    at this thread count (the tiles are 256 bits wide: on cores with two 512-bit FMA units
    oneDNN's AVX-512 kernels can outrun them; on Zen 4, which splits 512-bit operations in
    two, the two come close). Decided per layer when it is built, at torch's thread count
    then: a later ``torch.set_num_threads`` keeps it."""
    if not cpu_kernels.gemm_supported(dtype):
        return False
    if os.environ.get("SCHEDKIT_CPU_GEMM") == "1" or not cpu_kernels.cpu_has_avx512():
        return True
    threads = torch.get_num_threads()
    with _choice_lock:
        if threads not in _choices:
            _choices[threads] = _decide(threads)
        return _choices[threads]


class PackedLinear(nn.Module):
    """A linear layer whose weight lives in oneDNN's blocked layout (inference only).

    Args:
        weight: [out, in], reordered once.
        bias: [out] or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("gemv_weight", _gemv_weight(weight, bias))
        # several rows through the same kernel too where it is the faster (multi_row_gemm)
        self._many_rows = self.gemv_weight is not None and multi_row_gemm(weight.dtype)
        self._pad_from = pad_from(weight.dtype)
        # a plain tuple: no buffer lookup (module __getattr__) per call
        self._operands: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] = (
            self.packed_weight, self.bias, self.gemv_weight)  # type: ignore[assignment]

    def _apply(self, fn: Any, recurse: bool = True) -> PackedLinear:
        out = super()._apply(fn, recurse)
        self._operands = (self.packed_weight, self.bias, self.gemv_weight)  # type: ignore[assignment]
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, gemv_weight = self._operands
        if gemv_weight is not None and x.dim() == 2 and x.stride(1) == 1 \
                and (x.shape[0] == 1 or (self._many_rows and x.shape[0] > 1)):
            return cpu_kernels.gemv(x, gemv_weight, bias, self.out_features)
        rows = x.shape[0]
        target = _pad_rows(rows, self._pad_from)
        if target != rows and x.dim() == 2:
            padded = x.new_empty(target, x.shape[1])
            padded[:rows] = x
            padded[rows:].zero_()
            return _LINEAR(padded, weight, bias, "none", [], "")[:rows]
        return _LINEAR(x, weight, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def warm_row_counts(limit: int, dtype: torch.dtype) -> list[int]:
    """The row counts calls of 1 to ``limit`` rows reach oneDNN with (:func:`padded_rows`)."""
    return sorted({padded_rows(m, dtype) for m in range(1, limit + 1)})


@torch.inference_mode()
def warm_gemm_row_counts(model: nn.Module, rows: int = WARM_ROWS) -> None:
    """Call each distinct packed weight shape of ``model`` once at every row count of
    :func:`warm_row_counts` up to ``rows``, on zeros, so that oneDNN has built those
    kernels before the first request. Layers of one shape share kernels: one call per
    shape and count."""
    seen: set[tuple[Any, ...]] = set()
    for module in model.modules():
        if not isinstance(module, PackedLinear) or module._many_rows:  # the latter never reach oneDNN
            continue
        weight, bias, _ = module._operands
        key = (module.in_features, module.out_features, weight.dtype, bias is not None)
        if key in seen:
            continue
        seen.add(key)
        counts = warm_row_counts(rows, weight.dtype)
        x = torch.zeros(counts[-1], module.in_features, dtype=weight.dtype)
        for m in counts:
            module(x[:m])


def pack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` under ``model`` by a :class:`PackedLinear` (where
    oneDNN serves its dtype)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and onednn_matmul_supported(child.weight.dtype):
                setattr(parent, name, PackedLinear.from_linear(child))


def prepare_cpu_model(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Make a loaded CausalLM (or an EAGLE head, which has no LM head) ready for the
    CPU: its arithmetic in ``compute_dtype`` (the RoPE tables stay float32), every
    linear layer packed, and a tied LM head given its own packed copy of the embedding
    (the embedding lookup keeps the plain one)."""
    for param in model.parameters():  # parameters only: the RoPE buffers stay float32
        param.data = param.data.to(compute_dtype)
    tied_head = getattr(model, "lm_head", False) is None
    if tied_head and onednn_matmul_supported(compute_dtype):
        embedding = cast(nn.Embedding, cast(nn.Module, model.model).embed_tokens)
        model.lm_head = PackedLinear(embedding.weight, None)
    pack_linears(model)
