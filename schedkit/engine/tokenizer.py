"""The model's tokenizer, loaded the same way by clients, the server and the engine
(which needs it for structured outputs)."""

from __future__ import annotations

import json
from typing import Any

from schedkit.config import Config
from schedkit.errors import ConfigError


def load_tokenizer(config: Config) -> Any:
    """The model's tokenizer (transformers), or None for runners without a real model.

    Raises:
        ConfigError: The tokenizer cannot be loaded.
    """
    if config.model.tokenizer is None and config.runner.kind != "paged":
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("text needs the tokenizer library: pip install 'schedkit[demo]'") from e
    path = config.model.tokenizer
    if path is None:
        from schedkit.runners.paged.loader import resolve_model_path

        path = str(resolve_model_path(config.model.name, config.model.seed))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e


def model_eos_ids(config: Config) -> tuple[int, ...]:
    """Every ``eos_token_id`` of the paged runner's model folder (config.json and
    generation_config.json, an int or a list each); () for the other runners."""
    if config.runner.kind != "paged":
        return ()
    from schedkit.runners.paged.loader import resolve_model_path

    folder = resolve_model_path(config.model.name, config.model.seed)
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for t in eos if isinstance(eos, list) else [eos]:
            if type(t) is int and t >= 0 and t not in ids:
                ids.append(t)
    return tuple(ids)
