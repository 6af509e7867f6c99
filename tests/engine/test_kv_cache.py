from _requests import make_request

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.engine.kv_cache.block_pool import BlockPool
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request


def _req(rid: str, ids: list[int]) -> Request:
    return make_request(rid, ids, SamplingParams())


def test_block_pool_reserves_null_block_and_counts_refs():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert 0 not in [b.block_id for b in blocks]
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3  # the touched block still has one reference
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 4


def test_prefix_hits_and_lru_eviction():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 10) is not None
    kv.free("a")
    assert kv.num_free_blocks == 5
    b = _req("b", list(range(9)))  # shares the 2 full blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    # a lookup has no side effects
    assert kv.num_free_blocks == 5
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.num_free_blocks == 2  # 2 revived hits + 1 new block
    # the last block can never be a hit: at least one token is computed
    c = _req("c", list(range(8)))
    _, n = kv.get_computed_blocks(c)
    assert n == 4
    kv.free("b")
    # allocating everything evicts the cached prefixes
    d = _req("d", [99] * 20)
    assert kv.allocate_slots(d, 20) is not None
    assert kv.get_computed_blocks(_req("e", list(range(9))))[1] == 0
    kv.free("d")
    assert kv.num_free_blocks == 5


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req("r", list(range(12)))
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("r") == []


def test_trim_gives_back_the_blocks_past_the_computed_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("r", list(range(8)))
    kv.allocate_slots(r, 8, num_lookahead_tokens=5)  # 13 tokens: 4 blocks
    assert kv.num_blocks("r") == 4 and kv.num_free_blocks == 5
    kv.trim("r", 9)  # tokens 0..8 need 3 blocks
    assert kv.num_blocks("r") == 3 and kv.num_free_blocks == 6
    kv.trim("r", 12)  # never grows
    assert kv.num_blocks("r") == 3
    kv.free("r")
    assert kv.num_free_blocks == 9
