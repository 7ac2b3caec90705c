"""Fixtures of the paged-runner tests: small seeded random-weight models on disk, built
once per session, and transformers loaded on the same weights as the oracle.

Every module here skips when torch is missing; the oracle tests also need transformers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import os

    import torch

    if not torch.cuda.is_available():
        # The Triton kernels run under the interpreter here. Set before anything imports
        # triton: its own @jit helpers (tl.cdiv ...) must be interpreted functions too.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tiny ops gain nothing from more threads, and on a shared 2-core machine spinning
    # OpenMP workers make them many times slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``model_dir(family, seed=0, **config)``: folder of a seeded random model (cached)."""
    from schedkit.runners.paged.builder import build_random_model, tiny_config

    built: dict[str, Path] = {}

    def make(family: str = "llama", seed: int = 0, **kw: Any) -> Path:
        key = f"{family}-{seed}-{sorted(kw.items())}"
        if key not in built:
            path = tmp_path_factory.mktemp(f"{family}-model")
            built[key] = build_random_model(path, tiny_config(family, **kw), seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    """``hf_model(folder)``: transformers' model on the same weights (cached, float32)."""
    pytest.importorskip("transformers")
    from schedkit.runners.paged.testing import load_hf_model

    loaded: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        if path not in loaded:
            loaded[path] = load_hf_model(path)
        return loaded[path]

    return load
