"""Which blocks of a low-bit KV pool keep a bf16 twin (`models.paged_lowbit`), on the host.

A low-bit pool stores every block packed; a sequence reads in bf16 only its sink slots (in its
block 0) and its slots from its bound on, bound(n) = max(0, n - recent) // key_group * key_group
for a query at position n - 1 (`ops.lowbit.format.packed_bound`): so those blocks, and the
blocks a step writes, keep a bf16 copy in a twin block. Each step the scheduler says which blocks
its running requests need (`needed`, `retain`): those twins are pinned; the others stay filled, in
least-recently-released order, until a twin is wanted for another block. A prefix-cache hit can use
a run of cached blocks only if the twins its continuation reads are still there (`has`, asked by
`BlockPool.match_prefix`): then it reads exactly what the request that wrote them read.

The pool holds enough twins that the running requests' needs always fit (`twins_for`).
"""

from __future__ import annotations

from collections import OrderedDict

from ..ops.lowbit.format import packed_bound


def twins_for(max_num_seqs: int, budget: int, block_size: int, recent: int, key_group: int) -> int:
    """Twin blocks for `max_num_seqs` requests and a step budget of `budget` tokens: what they can pin at
    once (per request block 0, the blocks from its bound on, and its chunk's; one scratch block), and as
    many again for the tails of cached prefixes."""
    tail = (recent + key_group) // block_size
    return 1 + max_num_seqs * (3 + tail) + budget // block_size + max_num_seqs * (1 + tail)


class TwinBlocks:
    def __init__(self, num_twins: int, num_blocks: int, block_size: int, sinks: int, recent: int, key_group: int,
                 reserved: tuple[int, ...] = ()):
        """Bookkeeping of `num_twins` twins for blocks 0 .. num_blocks - 1; `reserved` blocks (the engine's
        scratch block) keep theirs for good."""
        if num_twins < 1 + len(reserved):
            raise ValueError(f"{num_twins} twin blocks are too few")
        self.block_size, self.sinks, self.recent, self.key_group = block_size, sinks, recent, key_group
        self.twin_of = [-1] * num_blocks
        self.block_of = [-1] * num_twins
        self.free = list(range(num_twins - 1, -1, -1))  # empty twins (popped from the end: 0 first)
        self.lru: OrderedDict[int, None] = OrderedDict()  # filled twins nobody pins, least recent first
        self.pinned: set[int] = set()
        self.changed: dict[int, int] = {}  # block -> twin, not yet in the device map
        self.reserved = frozenset(reserved)
        self.retain(())

    @property
    def num_twins(self) -> int:
        return len(self.block_of)

    def bound(self, n: int) -> int:
        return packed_bound(n, self.recent, self.key_group)

    def needed(self, blocks: list[int], computed: int, new: int = 0) -> list[int]:
        """The blocks a request with `computed` tokens in its cache and `new` to run now reads or writes
        in bf16: block 0 (its sinks) and the blocks from bound(computed + 1) to its last token."""
        last = computed + new - 1
        if last < 0 or not blocks:
            return []
        bs = self.block_size
        out = blocks[self.bound(computed + 1) // bs: last // bs + 1]
        return out + blocks[:1] if self.sinks and out[:1] != blocks[:1] else out

    def has(self, blocks: list[int], computed: int) -> bool:
        """Whether the twins a request continuing after `computed` cached tokens reads are all kept."""
        return all(self.twin_of[b] >= 0 for b in self.needed(blocks, computed, 1))  # (the new token's block: not
        # among `blocks`, the cached ones)

    def retain(self, wanted) -> None:
        """Pin the twins of the blocks in `wanted` (and the reserved ones), giving a twin to those that
        have none; unpin every other."""
        want = set(wanted) | self.reserved
        for t in list(self.pinned):
            if self.block_of[t] not in want:
                self.pinned.discard(t)
                self.lru[t] = None
        missing = []
        for b in want:
            t = self.twin_of[b]
            if t < 0:
                missing.append(b)
            elif t not in self.pinned:
                self.lru.pop(t, None)
                self.pinned.add(t)
        for b in missing:
            t = self._take()
            self.twin_of[b], self.block_of[t] = t, b
            self.pinned.add(t)
            self.changed[b] = t

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        if not self.lru:
            raise RuntimeError(f"all {self.num_twins} bf16 twin blocks are pinned")
        t, _ = self.lru.popitem(last=False)
        self._forget(self.block_of[t])
        return t

    def _forget(self, b: int) -> None:
        self.twin_of[b] = -1
        self.changed[b] = -1

    def drop(self, b: int) -> None:
        """Block b was handed out afresh: its twin (if any) holds nothing of its new contents."""
        t = self.twin_of[b]
        if t < 0 or b in self.reserved:
            return
        self._forget(b)
        self.block_of[t] = -1
        self.lru.pop(t, None)
        self.pinned.discard(t)
        self.free.append(t)

    def take_changes(self) -> tuple[list[int], list[int]]:
        """(blocks, twins) changed since the last call, for `PagedLowBitPool.set_twins`."""
        ch, self.changed = self.changed, {}
        return list(ch), list(ch.values())
