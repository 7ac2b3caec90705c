"""The CPU linear layers: schedkit's packed-weight GEMM against oneDNN's matmul, both on
this machine in one process, calls alternating so that drift in the machine's speed
(large on shared VMs) hits both alike.

Two parts, each a median over alternating calls:

- shapes: one GEMM of [M, K] x [K, N] (float32, SmolLM2-135M's projections by default),
  ``cpu_kernels.gemv`` on the packed copy against ``torch.ops.mkldnn._linear_pointwise``
  on oneDNN's packed weight; GFLOP/s of each.
- steps: whole engine steps of SmolLM2-135M (the converted model folder) with every
  PackedLinear switched between the two paths before each step: a prefill of one fresh
  prompt of L tokens (``--prefill``), a decode step of B sequences at C tokens of context
  (``--decode``).

- row counts (``--row-counts DTYPE``, alone): SmolLM2-135M's four weight shapes as
  PackedLinears, called with every row count from 2 to 299 in a shuffled order, three
  passes padded as the runner pads (``cpu_linear.padded_rows``: bfloat16 from 17 rows,
  float32 from 257), then three with the exact row count; wall time of each pass. The
  first pass of each builds oneDNN's kernels; the later ones show whether they stay
  cached.

  python scripts/bench_cpu_linear.py --threads 2
  python scripts/bench_cpu_linear.py --shapes 128x576x3072 --prefill 128 --decode 32,256
  python scripts/bench_cpu_linear.py --threads 2 --row-counts bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from schedkit.core.request import Request, SamplingParams
from schedkit.runners.paged import cpu_kernels
from schedkit.runners.paged.cpu_linear import PackedLinear, time_gemm_paths

sys.path.insert(0, str(Path(__file__).parent))
import bench_paged  # noqa: E402

SHAPES = ["2x576x960", "8x576x960", "32x576x3072", "64x1536x576", "128x576x960", "128x576x3072",
          "128x1536x576", "512x576x3072", "32x576x49152"]
"""M x K x N: rows (tokens of a step) x in x out; SmolLM2-135M's qkv (960), o (576),
gate_up (3072), down (K 1536) and LM head (49152)."""


def alternate(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, called in turn ``reps`` times after a warm-up."""
    for _ in range(2):
        a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, into in ((a, ta), (b, tb)):
            t = time.perf_counter()
            f()
            into.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def bench_shapes(shapes: list[str], reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for spec in shapes:
        m, k, n = (int(v) for v in spec.split("x"))
        t_dnn, t_ours = time_gemm_paths(m, k, n, reps, g, bias=True)
        flop = 2 * m * k * n
        print(f"{spec:>14}  oneDNN {1e3 * t_dnn:8.3f} ms {flop / t_dnn / 1e9:6.1f} GFLOP/s   "
              f"schedkit {1e3 * t_ours:8.3f} ms {flop / t_ours / 1e9:6.1f} GFLOP/s   {t_dnn / t_ours:.2f}x")


def bench_steps(a: argparse.Namespace) -> None:
    ns = argparse.Namespace(model=a.model, dtype="float32", hf_init=False, device="cpu", threads=a.threads,
                            eager=True, block_size=16, num_blocks=8192, max_batch_tokens=2048, max_num_seqs=128)
    engine = bench_paged.build_engine(ns, 4096)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    rng = random.Random(0)
    counter = iter(range(1 << 30))

    def use(ours: bool) -> None:
        for lin in linears:
            lin._many_rows = ours

    def prefill(ours: bool) -> None:
        use(ours)
        engine.add_request(Request(f"p{next(counter)}", [rng.randrange(100, 40000) for _ in range(a.prefill)],
                                   SamplingParams(max_tokens=1, temperature=0.0), arrival_time=time.monotonic()))
        while engine.has_requests():
            engine.step()

    if a.prefill:
        t_dnn, t_ours = alternate(lambda: prefill(False), lambda: prefill(True), a.reps)
        print(f"prefill of {a.prefill} tokens: oneDNN {1e3 * t_dnn:.1f} ms, schedkit {1e3 * t_ours:.1f} ms, "
              f"{t_dnn / t_ours:.2f}x")
    if a.decode:
        batch, ctx = (int(v) for v in a.decode.split(","))
        for i in range(batch):
            engine.add_request(Request(f"d{i}", [rng.randrange(100, 40000) for _ in range(ctx)], SamplingParams(
                max_tokens=10 ** 6, temperature=0.0, ignore_eos=True), arrival_time=time.monotonic()))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()

        def step(ours: bool) -> None:
            use(ours)
            engine.step()

        t_dnn, t_ours = alternate(lambda: step(False), lambda: step(True), a.reps)
        print(f"decode step of {batch} sequences at {ctx} tokens: oneDNN {1e3 * t_dnn:.1f} ms, "
              f"schedkit {1e3 * t_ours:.1f} ms, {t_dnn / t_ours:.2f}x")


def bench_row_counts(dtype: torch.dtype, passes: int = 3) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
    linears = [PackedLinear(torch.randn(n, k, generator=g).to(dtype), None) for k, n in shapes]
    for lin in linears:
        lin._many_rows = False  # oneDNN for every call of more than one row
    rows = list(range(2, 300))
    random.Random(0).shuffle(rows)
    inputs = {m: {k: torch.randn(m, k, generator=g).to(dtype) for k, _ in shapes} for m in rows}
    runner_rule = linears[0]._pad_from
    for label, pad_from in (("padded", runner_rule), ("exact rows", 1 << 30)):
        for lin in linears:
            lin._pad_from = pad_from
        for p in range(passes):
            t = time.perf_counter()
            for m in rows:
                for (k, _), lin in zip(shapes, linears, strict=True):
                    lin(inputs[m][k])
            print(f"{label:>10} pass {p}: {1e3 * (time.perf_counter() - t):7.1f} ms "
                  f"({len(rows)} row counts x {len(shapes)} shapes, {dtype})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="MxKxN ...; none to skip")
    ap.add_argument("--model", default=str(bench_paged.cache_dir() / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens (0: skip)")
    ap.add_argument("--decode", default="32,256", help="BATCH,CONTEXT ('' to skip)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--row-counts", default=None, metavar="DTYPE",
                    help="only the row-count part, in this dtype (float32, bfloat16)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.row_counts:
        bench_row_counts(getattr(torch, a.row_counts))
        return
    if cpu_kernels.load_cpu_kernels() is None or not cpu_kernels.gemm_supported(torch.float32):
        sys.exit("this build of the kernels has no multi-row GEMM (it needs AVX2 and FMA)")
    print(f"threads {a.threads}, median of {a.reps} alternating calls")
    bench_shapes(a.shapes, a.reps)
    if a.prefill or a.decode:
        bench_steps(a)


if __name__ == "__main__":
    main()
