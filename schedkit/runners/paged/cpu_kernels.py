"""Build and load the paged runner's C++ CPU kernels (``csrc/``) with the system compiler.

The sources, one file per kind of kernel (``attention.cpp`` and the item paths it
includes, ``gemm.cpp``, ``elementwise.cpp``, ``sampling.cpp``, ``features.cpp``, the
vector helpers in ``simd.h``), are compiled one at a time and linked into one library,
``schedkit_cpu_kernels``, once per set of sources, compiler and CPU (``-march=native``),
into ``cache_dir()/kernels``, and loaded with ctypes: no PyTorch headers, no build step
at install time, a few seconds on first use. It links the OpenMP runtime torch already
loaded, so its threads are torch's. :func:`load_cpu_kernels` returns None (and
:func:`build_error` says why) where no compiler works; the runner then falls back to
the PyTorch reference. torch is imported before the library loads, so its libgomp is
the one the library binds to.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from schedkit.config import cache_dir

CSRC = Path(__file__).with_name("csrc")
"""The kernels' sources: every ``*.cpp`` here is compiled into the library, and every
``*.cpp`` and ``*.h`` is part of its cache key."""
LIBRARY = "schedkit_cpu_kernels"
MARCH = os.environ.get("SCHEDKIT_KERNEL_MARCH", "native")
"""The target of ``-march`` (``$SCHEDKIT_KERNEL_MARCH``, default ``native``): the tests set
``x86-64-v3`` in a subprocess to run the AVX2 paths on an AVX-512 machine."""
FLAGS = ["-O3", f"-march={MARCH}", "-ffast-math", "-ffp-contract=fast", "-fopenmp", "-std=c++17", "-fPIC"]
"""Compile flags. The link step (``-shared -fopenmp``) has no -ffast-math: linked with it,
gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole process."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None
_error: str | None = None
_tried = False
_SWITCHES = {"amx": "SCHEDKIT_CPU_AMX", "bf16_tiles": "SCHEDKIT_CPU_BF16_TILES",
             "float_tiles": "SCHEDKIT_CPU_FLOAT_TILES"}
"""The kernel's path switches (``schedkit_<name>_enable``) and the variable that turns each off."""
_on = dict.fromkeys(_SWITCHES, False)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines()
             if ln.startswith(("flags", "model name", "Features", "CPU part", "CPU implementer"))]
    return "\n".join(sorted(set(lines)))


def sources() -> list[Path]:
    """The files compiled into the library (``csrc/*.cpp``), in name order."""
    return sorted(CSRC.glob("*.cpp"))


def _source_text() -> str:
    """Every source and header, each by name, for the cache key: editing, adding or
    removing any of them builds a new library."""
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
    return "\0".join(f"{f.name}\0{f.read_text()}" for f in files)


def _library_path(compiler: str) -> Path:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = compiler
    key = hashlib.sha256("\0".join([_source_text(), " ".join(FLAGS), version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{LIBRARY}-{key}.so"


def _run_compiler(compiler: str, cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")


def _build(compiler: str, target: Path) -> None:
    """Compile each source (one compiler at a time) and link them into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj_dir = tempfile.mkdtemp(suffix=".objects", dir=target.parent)
    try:
        objects = []
        for src in sources():
            objects.append(os.path.join(obj_dir, src.stem + ".o"))
            _run_compiler(compiler, [compiler, *FLAGS, "-c", str(src), "-o", objects[-1]])
        _run_compiler(compiler, [compiler, "-shared", "-fopenmp", *objects, "-o", tmp])
        os.replace(tmp, target)  # atomic: a concurrent build or load sees a whole file
    finally:
        shutil.rmtree(obj_dir, ignore_errors=True)
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be built."""
    global _lib, _lib_path, _error, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        compiler = _compiler()
        if compiler is None:
            _error = "no C++ compiler found (set CXX, or install g++)"
            return None
        try:
            path = _library_path(compiler)
            if not path.is_file():
                _build(compiler, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            return None
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        signatures = {
            "schedkit_paged_attention": ([p, p, p, p, p, p, p, i64, p, i64, i64, i64, i64, i64, f32,
                                          i32, i64, i32, i64], ctypes.c_int),
            "schedkit_rope_store_attention": ([p, i32, i64, p, p, p, p, i64, p, p, p, p, i32, p, p, p, i64,
                                               p, i64, i64, i64, i64, i64, f32, i32, i64, i32, i64, i64],
                                              ctypes.c_int),
            "schedkit_kernel_features": ([], ctypes.c_int),
            "schedkit_add_rms_norm": ([p, i32, p, p, p, i64, i64, f32, i32], None),
            "schedkit_silu_and_mul": ([p, i32, p, i64, i64, i32], None),
            "schedkit_apply_grammar_bitmask": ([p, i64, p, i64, p, p, i64, i64, p, i32], None),
            "schedkit_argmax_rows": ([p, i64, i64, i64, p, i32], None),
            "schedkit_amx_enable": ([i32], ctypes.c_int),
            "schedkit_bf16_tiles_enable": ([i32], ctypes.c_int),
            "schedkit_float_tiles_enable": ([i32], ctypes.c_int),
            "schedkit_gemm": ([p, i32, i64, i64, i64, p, p, i64, p, i32], ctypes.c_int),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _lib, _lib_path, _error = lib, path, None
        for name, var in _SWITCHES.items():
            _set_switch(lib, name, os.environ.get(var, "1") != "0")
        return lib


def _set_switch(lib: ctypes.CDLL, name: str, on: bool) -> bool:
    _on[name] = bool(getattr(lib, f"schedkit_{name}_enable")(int(on)))
    return _on[name]


def library_path() -> Path | None:
    """The loaded library's file (None before :func:`load_cpu_kernels` succeeded)."""
    return _lib_path


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512 (``avx512f`` among /proc/cpuinfo's flags), whatever
    ``-march`` the library was built for: oneDNN picks its kernels from the CPU itself."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def cpu_kernels() -> ctypes.CDLL:
    """The library, for callers that checked :func:`load_cpu_kernels` succeeded."""
    assert _lib is not None, "load_cpu_kernels() has not succeeded"
    return _lib


KERNEL_ERRORS = {
    -1: "a cache dtype this build lacks", -2: "heads that do not divide into KV heads",
    -3: "a head_dim that is not a multiple of 8", -4: "a block id outside the KV cache",
    -5: "a slot outside the KV cache", -6: "a position outside the RoPE tables",
    -7: "query and sequence lengths that do not add up"}


def check_kernel_result(name: str, rc: int) -> None:
    """Raise where a kernel refused its input (it checks every index before writing)."""
    if rc != 0:
        raise RuntimeError(f"{name}: {KERNEL_ERRORS.get(rc, f'error {rc}')}; nothing was written")


def supports_float16() -> bool:
    """Whether the built library has float16 caches (its compiler had _Float16)."""
    return bool(cpu_kernels().schedkit_kernel_features() & 1)


ACTIVATION_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Activation dtypes of the norm, activation and fused attention kernels (their codes)."""


def check_cpu_tensors(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous():
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"the CPU kernels take contiguous {names} CPU tensors, got "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', strided'}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ([rows, dim], float32 or bfloat16); with ``residual`` (same dtype),
    of ``residual += x`` (updated in place). ``weight`` is float32 (a bfloat16 model's
    values). Float32 arithmetic; in bfloat16, rounded after each step as torch rounds a
    bfloat16 model's ops."""
    check_cpu_tensors(x, *(() if residual is None else (residual,)), dtypes=tuple(ACTIVATION_DTYPES))
    check_cpu_tensors(weight)
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual is {residual.dtype}, x is {x.dtype}")
    rows, dim = x.shape
    out = torch.empty_like(x)
    cpu_kernels().schedkit_add_rms_norm(x.data_ptr(), ACTIVATION_DTYPES[x.dtype],
                                        None if residual is None else residual.data_ptr(),
                                        weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                                        torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [rows, 2 * dim] projection (float32 or bfloat16, the
    result in the same dtype; float32 arithmetic, rounded as torch rounds in bfloat16)."""
    check_cpu_tensors(x, dtypes=tuple(ACTIVATION_DTYPES))
    rows, two_dim = x.shape
    out = x.new_empty(rows, two_dim // 2)
    cpu_kernels().schedkit_silu_and_mul(x.data_ptr(), ACTIVATION_DTYPES[x.dtype], out.data_ptr(), rows,
                                        two_dim // 2, torch.get_num_threads())
    return out


GEMV_DTYPES = {torch.float32: (0, 2), torch.bfloat16: (1, 4)}
"""Weight dtypes of the one-row GEMM: (code, feature bit of the build)."""


def gemv_supported(dtype: torch.dtype) -> bool:
    """Whether the built library has the one-row GEMM for ``dtype`` weights (float32 on
    AVX-512 or AVX2 with FMA, bfloat16 on AVX512-BF16) and ``$SCHEDKIT_CPU_GEMV`` is not
    ``0``."""
    if dtype not in GEMV_DTYPES or os.environ.get("SCHEDKIT_CPU_GEMV", "1") == "0" \
            or load_cpu_kernels() is None:
        return False
    return bool(cpu_kernels().schedkit_kernel_features() & GEMV_DTYPES[dtype][1])


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K], N a multiple of 16) in :func:`gemv`'s layout: [N/16, K, 16] in
    float32, [N/16, K/2, 16, 2] in bfloat16 (K even)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.detach().reshape(n // 16, 16, k).permute(0, 2, 1).contiguous()


def gemm_supported(dtype: torch.dtype) -> bool:
    """Whether :func:`gemv` also takes several rows of ``dtype`` (float32, built wherever
    AVX2 and FMA are) and ``$SCHEDKIT_CPU_GEMM`` is not ``0``. Whether the linear layers
    use it is :func:`cpu_linear.multi_row_gemm`'s call."""
    return dtype == torch.float32 and os.environ.get("SCHEDKIT_CPU_GEMM", "1") != "0" \
        and gemv_supported(dtype) and bool(cpu_kernels().schedkit_kernel_features() & 8)


def gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for rows ``x`` ([M, K], the weight's dtype, unit stride along
    K) against ``W`` packed by :func:`pack_gemv_weight`. One row (the decode step of one
    sequence) streams the weight once, without oneDNN's per-call setup; several rows
    (where :func:`gemm_supported`) run register tiles of 6 rows x 16 outputs. Returns
    [M, out_features]."""
    if x.dtype != packed.dtype or x.dim() != 2 or x.device.type != "cpu" or x.stride(-1) != 1 \
            or x.shape[0] < 1 or x.shape[1] != packed.shape[1] * (2 if x.dtype == torch.bfloat16 else 1):
        raise ValueError(f"gemv takes [rows, {packed.shape[1]}] {packed.dtype} CPU rows with unit stride, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    rows = x.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    rc = cpu_kernels().schedkit_gemm(x.data_ptr(), GEMV_DTYPES[x.dtype][0], rows, x.stride(0) if rows > 1 else x.shape[1],
                                     x.shape[1], packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                     out_features, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"schedkit_gemm: {'no path for this dtype and row count' if rc == -1 else 'unsupported shape'}")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [rows, cols] float32 CPU tensor (unit stride along its
    rows), rows spread over torch's threads: the first index of each row's largest value,
    a NaN counting as the largest."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"argmax_rows takes a 2-d float32 CPU tensor with unit row stride, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cpu_kernels().schedkit_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                                       torch.get_num_threads())
    return out


def amx_enabled() -> bool:
    """Whether the kernel runs bfloat16 prefill tiles on AMX: built for a CPU with AMX, the
    OS granted the tile state, and ``$SCHEDKIT_CPU_AMX`` is not ``0``."""
    return _on["amx"]


def set_amx(on: bool) -> bool:
    """Turn the AMX prefill tiles on or off (tests compare both paths); returns whether
    they are on."""
    return _set_switch(cpu_kernels(), "amx", on)


def bf16_tiles_enabled() -> bool:
    """Whether the kernel runs bfloat16 prefill tiles by ``vdpbf16ps`` where it has no AMX
    (AVX512-BF16, e.g. AMD Zen 4): built for such a CPU and ``$SCHEDKIT_CPU_BF16_TILES``
    is not ``0``. AMX tiles, where enabled, take precedence."""
    return _on["bf16_tiles"]


def set_bf16_tiles(on: bool) -> bool:
    """Turn the ``vdpbf16ps`` prefill tiles on or off (tests compare both paths); returns
    whether they are on."""
    return _set_switch(cpu_kernels(), "bf16_tiles", on)


def float_tiles_enabled() -> bool:
    """Whether prefill chunks of 8+ rows that no bfloat16 tile engine takes (float32
    caches; bfloat16 / float16 caches without AVX512-BF16) run as float32 tiles: each
    sequence's keys laid out once, transposed, and shared by 16 rows' query vectors.
    ``$SCHEDKIT_CPU_FLOAT_TILES=0`` turns them off."""
    return _on["float_tiles"]


def set_float_tiles(on: bool) -> bool:
    """Turn the float32 prefill tiles on or off (tests compare both paths); returns
    whether they are on."""
    return _set_switch(cpu_kernels(), "float_tiles", on)


def build_error() -> str | None:
    """Why :func:`load_cpu_kernels` returned None (None if it has not failed)."""
    return _error


def apply_grammar_bitmask_cpu(logits: torch.Tensor, words: torch.Tensor, logit_rows: torch.Tensor,
                              mask_rows: torch.Tensor) -> torch.Tensor:
    """:func:`schedkit.runners.paged.sampler.apply_grammar_bitmask` in one pass over the
    constrained rows (float32 CPU logits, contiguous int32 words and row indices)."""
    check_cpu_tensors(logits)
    for t in (words, logit_rows, mask_rows):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu", t
    m = len(logit_rows)
    none_allowed = torch.zeros(m, dtype=torch.uint8)
    num_words = words.shape[1] if words.dim() == 2 else 0
    cpu_kernels().schedkit_apply_grammar_bitmask(
        logits.data_ptr(), logits.stride(0), words.data_ptr(), num_words, logit_rows.data_ptr(),
        mask_rows.data_ptr(), m, logits.shape[1], none_allowed.data_ptr(), torch.get_num_threads())
    return none_allowed.bool()
