"""Find a model folder (a built-in name or a local path) and load it into a CausalLM.

Checkpoints are transformers folders: ``config.json`` plus ``*.safetensors``. Their
separate q/k/v and gate/up weights are copied into the fused projections. Every problem
(no folder, no weights, an unsupported architecture, a missing or misshapen weight) is a
:class:`ConfigError` raised before serving starts.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from schedkit.config import cache_dir
from schedkit.errors import ConfigError
from schedkit.runners.paged.models import CausalLM, ModelArgs, model_args_from_hf
from schedkit.runners.paged.models.llama import RotaryEmbedding


def _tiny(family: str) -> Callable[[Path, int], None]:
    def build(path: Path, seed: int) -> None:
        from schedkit.runners.paged.builder import build_random_model, tiny_config

        cfg = tiny_config(family, vocab_size=32000, hidden_size=256, intermediate_size=768,
                          num_layers=4, num_heads=8, num_kv_heads=2, max_position_embeddings=4096)
        build_random_model(path, cfg, seed=seed)
    return build


def _qwen05b_shape(path: Path, seed: int) -> None:
    """Random weights in the shape of Qwen2.5-0.5B (the peer benchmark's model)."""
    from schedkit.runners.paged.builder import build_random_model, tiny_config

    cfg = tiny_config("qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_layers=24, num_heads=14, num_kv_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, tie_word_embeddings=True)
    build_random_model(path, cfg, seed=seed)


def _smollm2(path: Path, seed: int) -> None:
    from schedkit.runners.paged.convert_gguf import convert_smollm2

    convert_smollm2(path)


BUILTIN_MODELS: dict[str, tuple[Callable[[Path, int], None], bool]] = {
    "tiny-llama": (_tiny("llama"), True),
    "tiny-qwen2": (_tiny("qwen2"), True),
    "smollm2-135m-instruct": (_smollm2, False),
    "qwen2.5-0.5b-shape": (_qwen05b_shape, True),
}
"""name -> (builder writing the folder, whether the model seed is part of its identity)."""


def resolve_model_path(name: str, seed: int = 0) -> Path:
    """The folder of ``name``: a built-in model (built or converted into the cache on
    first use) or a local transformers folder.

    Raises:
        ConfigError: Not a built-in name and not a usable folder.
    """
    if name in BUILTIN_MODELS:
        build, seeded = BUILTIN_MODELS[name]
        path = cache_dir() / "models" / (f"{name}-seed{seed}" if seeded else name)
        if not (path / "config.json").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            # One builder at a time (replicas starting together on a cold cache): the
            # others wait, then find the folder built.
            with open(path.with_name(path.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (path / "config.json").is_file():
                    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                    build(tmp, seed)
                    shutil.rmtree(path, ignore_errors=True)  # a half-written folder of a killed run
                    tmp.replace(path)
        return path
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.name = {name!r}: neither a built-in model "
                          f"({', '.join(BUILTIN_MODELS)}) nor an existing folder")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.name = {name!r}: the folder has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model.name = {name!r}: the folder has no *.safetensors weights "
                          "(other weight formats are not supported)")
    return path


def read_model_args(path: Path) -> ModelArgs:
    """Parse ``path/config.json`` (ConfigError if unreadable or unsupported)."""
    source = str(path / "config.json")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{source}: cannot read: {e}") from e
    return model_args_from_hf(cfg, source)


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_LAYER = re.compile(r"(model\.layers\.\d+|layer)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)$")


def _shard_of(name: str, args: ModelArgs) -> tuple[str, int, int] | None:
    """(fused parameter, row offset, rows) for a q/k/v or gate/up weight, else None."""
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, block, proj, kind = m.groups()
    if block == "self_attn":
        offset, rows = {"q": (0, args.q_size), "k": (args.q_size, args.kv_size),
                        "v": (args.q_size + args.kv_size, args.kv_size)}[proj]
        return f"{layer}.self_attn.qkv_proj.{kind}", offset, rows
    offset = 0 if proj == "gate" else args.intermediate_size
    return f"{layer}.mlp.gate_up_proj.{kind}", offset, args.intermediate_size


def _copy_into(params: Mapping[str, torch.Tensor], name: str, tensor: torch.Tensor, args: ModelArgs,
               source: str) -> tuple[str, int] | None:
    """Copy one checkpoint tensor into its (slice of a) parameter; returns what it filled."""
    shard = _shard_of(name, args)
    if shard is not None:
        target, offset, rows = shard
        dest = params[target].narrow(0, offset, rows) if target in params else None
    else:
        target, offset = name, 0
        dest = params.get(name)
    if dest is None:
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings):
            return None
        raise ConfigError(f"{source}: unexpected weight {name!r} (unsupported model variant?)")
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ConfigError(f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, the config "
                          f"implies {tuple(dest.shape)}")
    dest.copy_(tensor)
    return target, offset


def load_model(path: Path, args: ModelArgs, *, dtype: torch.dtype, device: torch.device,
               max_positions: int, first_layers: int | None = None) -> CausalLM:
    """Build a :class:`CausalLM` on ``device`` and fill it from ``path/*.safetensors``
    (with ``first_layers``: only that many decoder layers, then the final norm and head).

    Raises:
        ConfigError: The checkpoint does not match ``args``, or has fewer than
            ``first_layers`` layers.
    """
    from safetensors import safe_open

    if first_layers is not None:
        if not 1 <= first_layers <= args.num_layers:
            raise ConfigError(f"{path}: cannot keep the first {first_layers} of its {args.num_layers} layers")
        args = dataclasses.replace(args, num_layers=first_layers)

    with torch.device("meta"):
        model = CausalLM(args, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb = RotaryEmbedding(args, max_positions).to(device)

    def tensors() -> Iterator[tuple[str, torch.Tensor, str]]:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    layer = _LAYER_INDEX.match(name)
                    if first_layers is not None and layer is not None and int(layer.group(1)) >= first_layers:
                        continue  # a model truncated to its first layers
                    yield name, f.get_tensor(name), str(file)

    fill_parameters(model, tensors(), args, str(path))
    return model.eval()


def fill_parameters(module: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor, str]],
                    args: ModelArgs, where: str) -> None:
    """Copy checkpoint tensors (name, tensor, file), named as in transformers, into
    ``module``'s parameters (fusing q/k/v and gate/up).

    Raises:
        ConfigError: A tensor no parameter takes, of the wrong shape, or a parameter
            (or a slice of a fused one) that no tensor filled.
    """
    params = dict(module.named_parameters())
    offsets = {"qkv_proj": (0, args.q_size, args.q_size + args.kv_size),
               "gate_up_proj": (0, args.intermediate_size)}
    expected = {(n, off) for n in params
                for off in offsets.get(n.split(".")[-2], (0,))}
    filled: set[tuple[str, int]] = set()
    with torch.no_grad():
        for name, tensor, source in tensors:
            got = _copy_into(params, name, tensor, args, source)
            if got is not None:
                filled.add(got)
    missing = sorted({n for n, _ in expected - filled})
    if missing:
        raise ConfigError(f"{where}: checkpoint lacks weights for {missing[:6]}"
                          f"{' ...' if len(missing) > 6 else ''}")
