"""Decoder models of the paged runner (Llama / Qwen2 family)."""

from schedkit.runners.paged.models.args import (
    SUPPORTED_ARCHITECTURES,
    ModelArgs,
    model_args_from_hf,
)
from schedkit.runners.paged.models.llama import CausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelArgs", "model_args_from_hf"]
