"""The KV cache manager: which blocks each request holds, and prefix-cache lookups.

Lifecycle per request: ``get_computed_blocks`` (pure lookup, no side effects) when it
is first scheduled, ``allocate_slots`` every step it runs (takes references on the
hits, allocates what the step needs, and commits newly full blocks to the prefix
cache), ``trim`` after a verify rejected drafts (the blocks past what is computed go
back to the pool), ``free`` once when it finishes or is preempted.
"""

from __future__ import annotations

from pdserve.core_types.utils import cdiv
from pdserve.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.kv_cache.hashing import hash_block
from pdserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_committed: dict[str, int] = {}  # blocks of the request already in the cache index
        # cumulative stats, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries ---------------------------------------------------------------------------
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, req.tokens_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``req`` in whole blocks, leaving >= 1 token to compute
        (none for a request that computes its whole prompt: prompt_logprobs)."""
        if not self.enable_caching or req.skips_prefix_cache:
            return [], 0
        self._update_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in req.block_hashes[:max_blocks]:
            blk = self.pool.get_cached_block(h)
            if blk is None:
                break
            hits.append(blk)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        commit: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) on top of the computed tokens.

        Returns the newly allocated blocks, or None (and changes nothing) if the pool is
        short. ``new_computed_blocks`` are prefix hits from ``get_computed_blocks``.
        ``commit=False`` keeps the new blocks out of the prefix cache (their contents
        arrive later, e.g. over a KV transfer; call ``commit`` once they have).
        """
        bs = self.block_size
        held = self.req_blocks.get(req.request_id, [])
        if not new_computed_blocks and held:
            # the common decode step: the held blocks still have room and at most the
            # token that fills the last block needs committing
            end = req.num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= len(held) * bs:
                if commit and end // bs > self.num_committed.get(req.request_id, 0):
                    self.commit(req, min(end, req.num_tokens))
                return []
        hits = new_computed_blocks or []
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        need = max(0, cdiv(total, self.block_size) - len(held) - len(hits))
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # hits sitting in the free list
        if need + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(need)
        blocks = self.req_blocks.setdefault(req.request_id, held)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if commit:
            # tokens whose ids are known after this step can be committed (their KV is
            # written by this step's forward before anyone can read it)
            self.commit(req, min(num_computed + num_new_tokens, req.num_tokens))
        return new_blocks

    def commit(self, req: Request, num_tokens: int) -> None:
        """Make the full blocks among the first ``num_tokens`` tokens findable by prefix."""
        if not self.enable_caching:
            return
        full = num_tokens // self.block_size
        start = self.num_committed.get(req.request_id, 0)
        if full <= start:
            return
        self._update_hashes(req, num_tokens)
        blocks = self.req_blocks[req.request_id]
        for i in range(start, full):
            self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_committed[req.request_id] = full

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.num_committed.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (slots of rejected
        drafts). They hold no committed prefix: only computed tokens are committed."""
        blocks = self.req_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
