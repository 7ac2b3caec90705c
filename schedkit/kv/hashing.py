"""Chained block hashes for prefix caching (docs/scheduler-behaviour.md#block-hashes).

``hash_i = H(parent || tokens of block i || extra keys of block i)`` where ``parent``
is ``hash_{i-1}``, or ``NONE_HASH`` for block 0. Only FULL blocks are hashed.

The byte serialization is unambiguous: a little-endian header carries the parent
length and the token count, tokens are packed as little-endian int64, and the extra
keys (tagged tuples of str/int/bytes, e.g. ``("cache_salt", salt)`` or
``("lora", name, path)``) follow as their ``repr``, which is injective for those types.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

from schedkit.errors import ConfigError

BlockHash = bytes
"""The digest of one full block (16 bytes for xxhash, 32 for sha256)."""

ExtraKeys = tuple[tuple[object, ...], ...]
"""Tagged extra keys of one block, e.g. ``(("lora", "name", "/path"),)``."""

NONE_HASH_SEED = "schedkit-none-hash"
"""Seed of the parent hash of block 0 when ``PYTHONHASHSEED`` is unset."""

DEFAULT_HASH_ALGO = "xxhash"

HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "xxhash": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}

_HEADER = struct.Struct("<HI")
_NEEDS_BYTESWAP = sys.byteorder != "little"


def get_hash_function(algo: str) -> Callable[[bytes], bytes]:
    """Return the digest function of a hash algorithm.

    Args:
        algo: ``"xxhash"`` (xxh3_128) or ``"sha256"``.
    Returns:
        A function mapping bytes to the digest bytes.
    Raises:
        ConfigError: the algorithm is unknown.
    """
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError as e:
        raise ConfigError(
            f"Unknown prefix-caching hash algorithm {algo!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from e


def compute_none_hash(algo: str = DEFAULT_HASH_ALGO) -> BlockHash:
    """Compute the parent hash of block 0 for ``algo``.

    The seed is ``PYTHONHASHSEED`` when set, else the fixed ``NONE_HASH_SEED``, so
    hashes are reproducible across processes by default. Reads the environment on
    every call; modules use the cached ``NONE_HASHES``.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = NONE_HASH_SEED
    return get_hash_function(algo)(seed.encode("utf-8"))


NONE_HASHES: dict[str, BlockHash] = {algo: compute_none_hash(algo) for algo in HASH_FUNCTIONS}
"""``NONE_HASH`` of each algorithm, computed once at import."""

NONE_HASH: BlockHash = NONE_HASHES[DEFAULT_HASH_ALGO]
"""``NONE_HASH`` of the default algorithm."""


def serialize_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> bytes:
    """Serialize one block unambiguously (see the module docstring)."""
    toks = array("q", token_ids)
    if _NEEDS_BYTESWAP:
        toks.byteswap()
    data = _HEADER.pack(len(parent), len(toks)) + parent + toks.tobytes()
    if extra_keys:
        data += repr(tuple(extra_keys)).encode("utf-8")
    return data


def hash_block_tokens(
    algo: str,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash one block.

    Args:
        algo: ``"xxhash"`` or ``"sha256"``.
        parent: The previous block's hash, or None for block 0 (uses ``NONE_HASH``).
        token_ids: The block's token ids.
        extra_keys: Tagged extra keys of the block; None or empty when there are none.
    Returns:
        The block hash.
    """
    fn = get_hash_function(algo)
    if parent is None:
        parent = NONE_HASHES[algo]
    return fn(serialize_block(parent, token_ids, extra_keys))


class BlockHasher:
    """Incrementally extends a request's list of full-block hashes.

    Called by the request every time tokens are appended (prompt at construction,
    each output token), in the scheduler process. The common case, no newly completed
    block, is a single length comparison.
    """

    __slots__ = ("block_size", "algo", "_hash_fn", "_none_hash")

    def __init__(self, block_size: int, algo: str = DEFAULT_HASH_ALGO) -> None:
        """Create a hasher.

        Args:
            block_size: Tokens per hash block (>= 1).
            algo: ``"xxhash"`` (default, fastest) or ``"sha256"``.
        Raises:
            ConfigError: Unknown algorithm or block size < 1.
        """
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self._hash_fn = get_hash_function(algo)
        self._none_hash = NONE_HASHES[algo]

    def extend(
        self,
        token_ids: Sequence[int],
        hashes: list[BlockHash],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> None:
        """Append the hash of every full block of ``token_ids`` not yet in ``hashes``.

        Mutates ``hashes`` only; idempotent when called repeatedly with the same tokens.

        Args:
            token_ids: All tokens of the request (prompt followed by outputs).
            hashes: The request's hash list; its length is the number of blocks hashed.
            cache_salt: Salt mixed into block 0 only, as ``("cache_salt", salt)``.
            lora: ``(adapter name, adapter path)``, mixed into every block as
                ``("lora", name, path)``.
        """
        bs = self.block_size
        num_hashed = len(hashes)
        if len(token_ids) < (num_hashed + 1) * bs:
            return
        num_full = len(token_ids) // bs
        fn = self._hash_fn
        lora_keys: ExtraKeys = (("lora", lora[0], lora[1]),) if lora is not None else ()
        parent = hashes[-1] if num_hashed else self._none_hash
        for i in range(num_hashed, num_full):
            extra = lora_keys
            if i == 0 and cache_salt is not None:
                extra = lora_keys + (("cache_salt", cache_salt),)
            parent = fn(serialize_block(parent, token_ids[i * bs : (i + 1) * bs], extra))
            hashes.append(parent)
