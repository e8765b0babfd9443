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


def test_a_hot_prefix_survives_a_flood_of_one_off_prompts():
    """Segmented LRU: a document whose blocks served a prefix hit outlives blocks that never did,
    however recently those were freed; it goes once nothing else is left to evict."""
    pool = BlockPool(8, 2)
    doc = [7, 7, 8, 8]  # a hot document: two full blocks

    def serve(prompt):
        t = BlockTable()
        hit = pool.match_prefix(prompt, t)
        t.blocks += pool.allocate(pool.blocks_for(len(prompt)) - len(t.blocks))
        pool.register_full(prompt, len(prompt), t)
        pool.release(t)
        return hit

    assert serve(doc + [1]) == 0  # first reader computes it
    assert serve(doc + [2]) == 4  # a second user: a hit; its blocks are now protected
    for i in range(20):  # one-off prompts of three blocks each, all freed after the document
        assert serve([100 + i] * 6) == 0
    assert pool.num_free == 8
    assert serve(doc + [3]) == 4  # still cached (least-recently-freed alone would have evicted it)
    pool.allocate(8)  # everything: the protected blocks go last, but they go
    assert pool.match_prefix(doc + [4], BlockTable()) == 0


def test_without_hits_eviction_is_least_recently_freed():
    pool = BlockPool(4, 2)
    a, b = BlockTable(pool.allocate(2)), BlockTable(pool.allocate(2))
    pool.register_full([1, 1, 2, 2], 4, a)
    pool.register_full([3, 3, 4, 4], 4, b)
    pool.release(a)
    pool.release(b)
    pool.allocate(2)  # a's blocks, freed first, go first
    assert pool.match_prefix([1, 1, 2, 2, 0], BlockTable()) == 0
    assert pool.match_prefix([3, 3, 4, 4, 0], BlockTable()) == 4
