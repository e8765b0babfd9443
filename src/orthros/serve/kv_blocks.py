"""KV blocks: which pool blocks each request holds, and the prefix cache.

The KV memory of all requests is one pool of `num_blocks` fixed-size blocks
(`models.paged_cache.PagedKVPool`); this module only does the bookkeeping,
on the host. A request holds a list of block ids (its block table); a block
can be held by several requests at once (a shared prompt prefix), so each
has a reference count.

Prefix caching is exact: the base stream's K/V at position t depend only on
the tokens 0..t (sliding-window or causal attention over earlier base tokens;
output tokens never make K/V), so a full block is identified by the hash of
its tokens chained with its parent's hash, and any request whose prompt
starts with the same tokens can read it instead of recomputing it. Blocks
whose last holder finished stay in the cache until their memory is needed.

Eviction keeps hot prefixes (a document many users ask about) through a flood
of one-off prompts: a segmented LRU. A cached block that was never read back
from the cache waits in the *probation* list; one that served a prefix hit at
least once goes to the *protected* list when it is freed. New memory comes
from empty blocks first, then from probation, then from protected, each in
order of eviction priority (least recently freed first, and a request's tail
blocks before its head). So a hot document's blocks are evicted only once
every block that served no hit is gone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    id: int
    ref: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    hits: int = 0  # prefix-cache hits it served since it was filled


@dataclass
class BlockTable:
    """One request's blocks; `hashes[i]` is block i's chained hash once it is full."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


def chain_hash(parent: int | None, tokens) -> int:
    """A block's identity: its tokens and its parent's hash (128-bit: a collision would
    silently serve another prompt's K/V, so Python's 64-bit `hash` is not enough)."""
    h = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16,
                        key=b"" if parent is None else parent.to_bytes(16, "little"))
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, twins=None):
        """twins: a low-bit pool's `kv_twins.TwinBlocks` (which blocks keep a bf16 copy), or None."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.twins = twins
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # and probation
        self.protected: OrderedDict[int, None] = OrderedDict()  # free cached blocks that served a hit
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.hit_tokens = 0  # prompt tokens served from the prefix cache (for metrics)
        self.query_tokens = 0

    # ------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached but unused: evictable)."""
        return len(self.free) + len(self.protected)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------ allocation
    def _take(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref == 0:
            (self.protected if block_id in self.protected else self.free).pop(block_id)
        b.ref += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (evicting cached ones: probation before protected, oldest first);
        ValueError if fewer are free."""
        if n > self.num_free:
            raise ValueError(f"{n} KV blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            bid, _ = (self.free or self.protected).popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None:  # evicted from the prefix cache
                if self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                b.hash = None
            b.ref, b.hits = 1, 0
            if self.twins is not None:
                self.twins.drop(bid)
            out.append(bid)
        return out

    def release(self, table: BlockTable) -> None:
        """Drop a request's hold on its blocks; tail blocks become the first to evict."""
        for bid in reversed(table.blocks):
            b = self.blocks[bid]
            b.ref -= 1
            if b.ref == 0:
                if b.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # nothing cached in it: reuse first
                elif b.hits:
                    self.protected[bid] = None
                else:
                    self.free[bid] = None
        table.blocks, table.hashes = [], []

    # --------------------------------------------------------- prefix cache
    def match_prefix(self, tokens: list[int], table: BlockTable) -> int:
        """Take the longest cached run of full blocks that starts `tokens` into `table`
        (which must be empty); return how many tokens it covers. At least one token is
        always left to compute: the last prompt token's forward makes the first output.
        A low-bit pool's run ends where the bf16 twins its continuation reads are kept."""
        assert not table.blocks
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        parent = None
        run = []
        for i in range((len(tokens) - 1) // bs):
            h = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            bid = self.cached.get(h)
            if bid is None:
                break
            run.append((h, bid))
            parent = h
        while run and self.twins is not None and not self.twins.has([b for _, b in run], len(run) * bs):
            run.pop()
        for h, bid in run:
            self._take(bid)
            self.blocks[bid].hits += 1
            table.blocks.append(bid)
            table.hashes.append(h)
        n = len(table.blocks) * bs
        self.hit_tokens += n
        self.query_tokens += len(tokens)
        return n

    def register_full(self, tokens: list[int], computed: int, table: BlockTable) -> None:
        """After a step: record the hashes of the blocks now full of computed K/V."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(table.hashes) < min(computed // bs, len(table.blocks)):
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else None
            h = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            table.hashes.append(h)
            b = self.blocks[table.blocks[i]]
            if b.hash is None and h not in self.cached:  # the first copy of a block wins
                b.hash = h
                self.cached[h] = b.id

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (e.g. after the fp8 scales change)."""
        for bid in list(self.free) + list(self.protected):
            b = self.blocks[bid]
            if b.hash is not None:
                self.cached.pop(b.hash, None)
                b.hash, b.hits = None, 0
        self.free.update(self.protected)  # nothing cached in them now
        self.protected.clear()
