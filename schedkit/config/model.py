"""The ``model`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schedkit.config.base import StrictModel


class ModelConfig(StrictModel):
    name: str = "tiny-llama"
    """A built-in model name or a local Hugging Face folder."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights and activations dtype."""
    tokenizer: str | None = None
    """Tokenizer folder; None means the model folder (or token-id prompts only)."""
    seed: int = Field(default=0, ge=0)
    """Weight seed of the built-in random-weight models (tiny-llama, tiny-qwen2)."""
