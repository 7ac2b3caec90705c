"""Block hashing (docs/scheduler-behaviour.md#block-hashes)."""

from __future__ import annotations

import hashlib

import pytest
import xxhash

from schedkit.errors import ConfigError
from schedkit.kv import BlockHasher, compute_none_hash, hash_block_tokens
from schedkit.kv.hashing import (
    NONE_HASH,
    NONE_HASH_SEED,
    NONE_HASHES,
    get_hash_function,
    serialize_block,
)

ALGOS = ["xxhash", "sha256"]


def test_digest_lengths_and_algorithms_differ():
    toks = list(range(16))
    x = hash_block_tokens("xxhash", None, toks)
    s = hash_block_tokens("sha256", None, toks)
    assert len(x) == 16 and len(s) == 32
    assert x == xxhash.xxh3_128_digest(serialize_block(NONE_HASHES["xxhash"], toks))
    assert s == hashlib.sha256(serialize_block(NONE_HASHES["sha256"], toks)).digest()


def test_none_hash_deterministic_fixed_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert compute_none_hash("sha256") == hashlib.sha256(NONE_HASH_SEED.encode()).digest()
    assert compute_none_hash("xxhash") == xxhash.xxh3_128_digest(NONE_HASH_SEED.encode())
    assert compute_none_hash("xxhash") == compute_none_hash("xxhash")


def test_none_hash_uses_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert compute_none_hash("sha256") == hashlib.sha256(b"1234").digest()
    assert compute_none_hash("xxhash") == xxhash.xxh3_128_digest(b"1234")


def test_module_none_hash_matches_current_environment():
    assert NONE_HASH == NONE_HASHES["xxhash"] == compute_none_hash("xxhash")
    assert NONE_HASHES["sha256"] == compute_none_hash("sha256")


def test_unknown_algorithm_raises():
    with pytest.raises(ConfigError, match="md5"):
        get_hash_function("md5")
    with pytest.raises(ConfigError):
        BlockHasher(16, "md5")
    with pytest.raises(ConfigError):
        BlockHasher(0)


@pytest.mark.parametrize("algo", ALGOS)
def test_parent_none_means_none_hash(algo):
    toks = [1, 2, 3]
    assert hash_block_tokens(algo, None, toks) == hash_block_tokens(algo, NONE_HASHES[algo], toks)


def test_serialization_is_unambiguous():
    p = b"p" * 16
    # Token boundaries, extra keys and parent lengths cannot alias each other.
    assert serialize_block(p, [1, 2], None) == serialize_block(p, [1, 2], ())
    assert serialize_block(p, [1, 2]) != serialize_block(p, [1, 2, 0])
    assert serialize_block(p, [256]) != serialize_block(p, [1, 1])
    assert serialize_block(p, [1], (("cache_salt", "a,b"),)) != serialize_block(
        p, [1], (("cache_salt", "a"), ("cache_salt", "b"))
    )
    assert serialize_block(b"ab", [1]) != serialize_block(b"a", [1])
    assert serialize_block(p, [-1]) != serialize_block(p, [2**63 - 1])


@pytest.mark.parametrize("algo", ALGOS)
def test_chaining(algo):
    bs = 4
    toks = list(range(10))
    hashes: list[bytes] = []
    BlockHasher(bs, algo).extend(toks, hashes)
    assert len(hashes) == 2  # partial last block is not hashed
    h0 = hash_block_tokens(algo, None, toks[0:4])
    h1 = hash_block_tokens(algo, h0, toks[4:8])
    assert hashes == [h0, h1]
    # Changing block 0 changes every later hash.
    other: list[bytes] = []
    BlockHasher(bs, algo).extend([99] + toks[1:], other)
    assert other[0] != h0 and other[1] != h1


@pytest.mark.parametrize("algo", ALGOS)
def test_incremental_extend_equals_one_shot(algo):
    bs = 3
    toks = list(range(20))
    hasher = BlockHasher(bs, algo)
    one_shot: list[bytes] = []
    hasher.extend(toks, one_shot)
    incremental: list[bytes] = []
    for i in range(1, len(toks) + 1):
        hasher.extend(toks[:i], incremental)
        assert len(incremental) == i // bs
    assert incremental == one_shot
    hasher.extend(toks, incremental)  # idempotent
    assert incremental == one_shot


def test_cache_salt_only_in_block_zero():
    bs = 4
    toks = list(range(12))
    salted: list[bytes] = []
    BlockHasher(bs, "sha256").extend(toks, salted, cache_salt="salt1")
    h0 = hash_block_tokens("sha256", None, toks[:4], (("cache_salt", "salt1"),))
    h1 = hash_block_tokens("sha256", h0, toks[4:8])
    h2 = hash_block_tokens("sha256", h1, toks[8:12])
    assert salted == [h0, h1, h2]
    plain: list[bytes] = []
    BlockHasher(bs, "sha256").extend(toks, plain)
    assert plain[0] != salted[0]
    other_salt: list[bytes] = []
    BlockHasher(bs, "sha256").extend(toks, other_salt, cache_salt="salt2")
    assert other_salt[0] == hash_block_tokens("sha256", None, toks[:4], (("cache_salt", "salt2"),))
    assert other_salt[0] != salted[0]


def test_lora_in_every_block_and_before_salt():
    bs = 2
    toks = [5, 6, 7, 8]
    lora = ("test_lora_adapter", "/path/to/lora")
    key = ("lora", *lora)
    hashes: list[bytes] = []
    BlockHasher(bs, "xxhash").extend(toks, hashes, cache_salt="s", lora=lora)
    h0 = hash_block_tokens("xxhash", None, toks[:2], (key, ("cache_salt", "s")))
    h1 = hash_block_tokens("xxhash", h0, toks[2:], (key,))
    assert hashes == [h0, h1]


def test_extend_does_not_touch_partial_block():
    hashes: list[bytes] = []
    hasher = BlockHasher(16)
    hasher.extend(list(range(15)), hashes)
    assert hashes == []
    hasher.extend(list(range(16)), hashes)
    assert len(hashes) == 1
