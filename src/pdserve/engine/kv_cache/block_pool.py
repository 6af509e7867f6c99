"""The block pool: every KV block, a free list in eviction order, and the prefix-cache index.

Invariants:
- Block 0 is the null block. It is never handed out; padded tokens write into it.
- A block is in the free list iff its ``ref_cnt`` is 0. A free block may still hold a
  cached prefix (``block_hash`` set): it stays findable until it is handed out again,
  which evicts it (least recently freed first).
- ``cached`` maps a block hash to the one block that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:  # evict its cached prefix
                if self.cached.get(blk.block_hash) is blk:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing free ones from the free list)."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free list's tail in the given
        order (so pass a request's blocks tail first: its last blocks are evicted first)."""
        for blk in blocks:
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, blk: KVCacheBlock, block_hash: bytes) -> None:
        if blk.block_hash is not None:
            return
        if block_hash in self.cached:  # another block already holds this prefix
            return
        blk.block_hash = block_hash
        self.cached[block_hash] = blk

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for blk in self.blocks[1:]:
            blk.block_hash = None
        self.cached.clear()
        return True
