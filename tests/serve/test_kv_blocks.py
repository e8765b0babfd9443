"""Block bookkeeping: reference counts, the prefix cache (exact full blocks, at least one token
left to compute), eviction order."""

import pytest

from orthros.serve.kv_blocks import BlockPool, BlockTable


def test_allocate_release_and_errors():
    pool = BlockPool(4, 2)
    t = BlockTable(pool.allocate(3))
    assert pool.num_used == 3 and pool.num_free == 1
    with pytest.raises(ValueError, match="2 KV blocks asked for, 1 free"):
        pool.allocate(2)
    pool.release(t)
    assert pool.num_used == 0 and t.blocks == []


def test_prefix_match_shares_full_blocks_only():
    pool = BlockPool(16, 4)
    a = list(range(10))
    ta = BlockTable(pool.allocate(3))
    pool.register_full(a, 10, ta)  # blocks 0-3 and 4-7 are full; 8-9 is not
    assert len(ta.hashes) == 2
    tb = BlockTable()
    assert pool.match_prefix(a[:8] + [99, 98], tb) == 8
    assert tb.blocks == ta.blocks[:2] and pool.blocks[ta.blocks[0]].ref == 2
    tc = BlockTable()
    assert pool.match_prefix([0, 1, 2, 7] + a[4:], tc) == 0  # a different first block: nothing matches
    td = BlockTable()
    assert pool.match_prefix(a[:8], td) == 4  # the last token is always recomputed
    for t in (ta, tb, td):
        pool.release(t)
    assert pool.num_used == 0


def test_cached_blocks_survive_until_evicted():
    pool = BlockPool(3, 2)
    t = BlockTable(pool.allocate(2))
    pool.register_full([1, 2, 3, 4], 4, t)
    pool.release(t)
    assert pool.num_free == 3
    t2 = BlockTable()
    assert pool.match_prefix([1, 2, 3, 4, 5], t2) == 4  # still cached after release
    pool.release(t2)
    pool.allocate(3)  # needs every block: the cached ones are evicted
    assert pool.cached == {} and pool.match_prefix([1, 2, 3, 4, 5], BlockTable()) == 0


def test_prefix_caching_off():
    pool = BlockPool(4, 2, prefix_caching=False)
    t = BlockTable(pool.allocate(2))
    pool.register_full([1, 2, 3, 4], 4, t)
    assert pool.match_prefix([1, 2, 3, 4, 5], BlockTable()) == 0
