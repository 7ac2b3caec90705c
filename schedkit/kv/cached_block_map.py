"""Prefix-cache map from block hash to the blocks carrying it (docs/scheduler-behaviour.md#cached-block-map)."""

from __future__ import annotations

from schedkit.kv.hashing import BlockHash


class CachedBlockMap:
    """Maps a block hash to the blocks carrying it (docs/scheduler-behaviour.md#cached-block-map).

    Several physical blocks may share one hash. A key maps to a bare block id in the
    common single-block case and to an insertion-ordered dict of ids otherwise.
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[BlockHash, int | dict[int, None]] = {}

    def get(self, block_hash: BlockHash) -> int | None:
        """Return the first inserted surviving block with this hash, or None."""
        v = self._map.get(block_hash)
        if v is None or isinstance(v, int):
            return v
        return next(iter(v))

    def get_all(self, block_hash: BlockHash) -> list[int]:
        """Return every block with this hash, in insertion order."""
        v = self._map.get(block_hash)
        if v is None:
            return []
        return [v] if isinstance(v, int) else list(v)

    def insert(self, block_hash: BlockHash, block_id: int) -> None:
        """Add ``block_id`` under ``block_hash``."""
        m = self._map
        v = m.get(block_hash)
        if v is None:
            m[block_hash] = block_id
        elif isinstance(v, int):
            m[block_hash] = {v: None, block_id: None}
        else:
            v[block_id] = None

    def index_of(self, block_hash: BlockHash, block_id: int) -> int:
        """Position of ``block_id`` among the blocks of ``block_hash`` (insertion order)."""
        return self.get_all(block_hash).index(block_id)

    def insert_at(self, block_hash: BlockHash, block_id: int, index: int) -> None:
        """Put ``block_id`` back under ``block_hash`` at ``index`` (undo of a removal)."""
        ids = self.get_all(block_hash)
        ids.insert(index, block_id)
        self._map[block_hash] = ids[0] if len(ids) == 1 else dict.fromkeys(ids)

    def pop(self, block_hash: BlockHash, block_id: int) -> int | None:
        """Remove ``block_id`` from ``block_hash``; a non-matching id is a no-op.

        Returns:
            ``block_id`` if it was removed, else None.
        """
        m = self._map
        v = m.get(block_hash)
        if v is None:
            return None
        if isinstance(v, int):
            if v != block_id:
                return None
            del m[block_hash]
            return block_id
        if block_id not in v:
            return None
        del v[block_id]
        if len(v) == 1:
            m[block_hash] = next(iter(v))
        return block_id

    def clear(self) -> None:
        """Forget every entry."""
        self._map.clear()

    def __len__(self) -> int:
        """Number of distinct hashes."""
        return len(self._map)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._map
