"""Allocating the paged KV cache, and sizing it from free memory on CUDA.

One tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` holds every
layer's K and V, so allocation succeeds or fails as a whole, before serving starts.
It is zero-filled: slots never written (block 0, the tail of a block) then read as
zeros, never as NaN that a masked-out attention weight of 0 would still propagate.
"""

from __future__ import annotations

import torch

from schedkit.errors import ConfigError
from schedkit.runners.paged.models import ModelArgs

GiB = 1 << 30


class KVCacheAllocationError(ConfigError):
    """The KV cache does not fit in memory (raised at start-up, before serving)."""


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def allocate_kv_cache(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) views, each ``[num_blocks, block_size, kv_heads, head_dim]``.

    Raises:
        KVCacheAllocationError: The cache would not fit (checked against available host
            memory on CPU; an allocation failure on CUDA), with the sizes involved.
    """
    need = num_blocks * bytes_per_block(args, block_size, dtype)
    if device.type == "cpu":
        avail = _host_available_bytes()
        if avail is not None and need > 0.9 * avail:
            raise KVCacheAllocationError(
                f"KV cache of cache.num_blocks={num_blocks} x block_size={block_size} needs "
                f"{need / GiB:.2f} GiB but only {avail / GiB:.2f} GiB of host memory is "
                "available; lower cache.num_blocks")
    shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
    try:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        raise KVCacheAllocationError(
            f"out of memory allocating the KV cache ({num_blocks} blocks x {block_size} tokens, "
            f"{need / GiB:.2f} GiB on {device}); lower cache.num_blocks or "
            f"runner.gpu_memory_utilization: {e}") from e
    return [(cache[i, 0], cache[i, 1]) for i in range(args.num_layers)]


def num_blocks_from_free_memory(args: ModelArgs, block_size: int, dtype: torch.dtype,
                                device: torch.device, utilization: float,
                                peak_activation_bytes: int, extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit in ``utilization`` of the GPU after weights, other processes'
    memory and the profiled activation peak (``extra_bytes_per_block``: a draft
    model's KV on the same blocks)."""
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    budget = total * utilization - others - max(peak_activation_bytes, weights)
    return max(0, int(budget // (bytes_per_block(args, block_size, dtype) + extra_bytes_per_block)))
