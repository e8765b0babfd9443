"""What an attention op reads: a description of one layer's stored K/V.

A cache writes new K/V and hands the op one of these (`models.kv.KVCache.write`); the op
(`ops.attend`) picks the kernel from it. Four storages:

    DenseKV   K/V [B, S, Hkv, D] on one key axis (16-bit, fp32, or fp8 e4m3 with per-head
              scales): no cache, `OrthrosCache`, `StaticOrthrosCache`, a low-bit cache's
              bf16 window.
    PagedKV   a block pool [num_blocks * block_size, Hkv, D] read through block tables
              (`PagedStepCache`): single queries by the paged kernel, prompt chunks by
              gathering their visible keys.
    LowBitKV  a low-bit cache layer: bf16 sinks and ring, int4 / int2 packed slots with their
              scales (`ops/lowbit/format.py`, `LowBitStaticCache`).
    PagedLowBitKV  the same format in a block pool (`PagedLowBitPool`): packed blocks read through
              block tables, their bf16 twins (sinks, window) read as a `PagedKV`.
    ShardedKV one rank's shard of a context-parallel cache (`parallel.ShardedCache`): dense
              K/V of its slots, and the exchanges that reach the other ranks' keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class DenseKV:
    """K/V [B, S, Hkv, D] whose key j is slot `start + j` of the layer; with `head` > 0 keys j < head are
    slots 0 .. head - 1 (attention sinks below a window) and key j >= head is slot `start + j - head`.

    k_scale / v_scale: [Hkv] fp32 for fp8 storage (the stored values times these), else None.
    capturable: a decode step's read of a whole preallocated buffer: the op then runs as one
    opaque custom op (captured as is in CUDA graphs; the kernels clip to the filled slots)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    start: int = 0
    capturable: bool = False
    head: int = 0

    @classmethod
    def window(cls, k, v, start: int, sink_k=None, sink_v=None) -> "DenseKV":
        """Keys k, v [B, S, Hkv, D] from slot `start`, after the sinks sink_k / sink_v [B, >= h, Hkv, D] (slots
        0 ..) below them: h = min(start, sinks) of those go first (`head`); none given, none."""
        h = 0 if sink_k is None else min(start, sink_k.shape[1])
        if h:
            k, v = torch.cat([sink_k[:, :h], k], 1), torch.cat([sink_v[:, :h], v], 1)
        return cls(k, v, start=start, head=h)

    @classmethod
    def seen(cls, k, v, first: int, rows: int | None, window: int | None, sinks: int = 0) -> "DenseKV":
        """The keys of k, v [B, S, Hkv, D] (key j = slot j, one document) that queries at slots `first` ..
        `first + rows - 1` can see: from slot first - window + 1 on, after the `sinks` below it, up to the last
        query's slot (rows None: to the end). The one place a dense chunk's keys are cut to its window."""
        S = k.shape[1]
        b = S if rows is None else min(S, first + rows)
        a = 0 if window is None else max(0, first - window + 1)
        if a <= sinks:  # the window reaches down to the sinks
            a = 0
        return cls.window(k[:, a:b], v[:, a:b], a, k[:, :sinks] if sinks else None, v[:, :sinks] if sinks else None)

    def local(self, slot):
        """A slot (int or tensor) of the layer as an index into these keys."""
        return slot if slot is None else slot - self.start + self.head

    def key_docs(self, k_doc: torch.Tensor) -> torch.Tensor:
        """The layer's key documents [B, >= slots] for these keys [B, S]."""
        a, h = self.start, self.head
        win = k_doc[:, a: a + self.k.shape[1] - h]
        return torch.cat([k_doc[:, :h], win], 1) if h else win


@dataclass
class PagedRows:
    """Query rows of one key each: `rows` [R] into the step's queries, block `table` [R, max_blocks],
    `pos` [R] (each query sees keys 0..pos of its sequence); `max_len` bounds every sequence."""

    rows: torch.Tensor
    table: torch.Tensor
    pos: torch.Tensor
    max_len: int


@dataclass
class PagedChunk:
    """A prompt chunk's base rows [r0, r1) over the keys gathered by `slots` [S] (pool slots in
    position order); its queries run `q_slot.shape[1]` rows (padded onto a compiled length)."""

    r0: int
    r1: int
    dense_start: int  # slot of the first query in the gathered keys
    slots: torch.Tensor
    q_slot: torch.Tensor  # [1, rows]
    q_doc: torch.Tensor  # [1, rows] zeros
    k_doc: torch.Tensor  # [1, S] zeros

    @property
    def rows(self) -> int:
        """Queries the attention call runs: r1 - r0, or more, padded to a compiled length."""
        return self.q_slot.shape[1]


@dataclass
class PagedKV:
    """One layer of a block pool k / v [num_blocks * block_size, Hkv, D] as one forward's rows read it.

    base / out: the single-key rows of each stream; chunks: the prompt chunks' base rows;
    compiled_chunks: chunk lengths whose windowed attention runs a compiled kernel (None: every
    multiple of 128); k_scale / v_scale: fp8 scales [Hkv], or None; sinks: windowed rows also see their
    sequence's first `sinks` positions (a chunk's gathered keys begin with those below its window)."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    base: PagedRows
    out: PagedRows
    chunks: list[PagedChunk] = field(default_factory=list)
    compiled_chunks: frozenset[int] | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    sinks: int = 0


@dataclass
class LowBitKV:
    """One layer of a low-bit cache (`ops/lowbit/format.py`): bf16 sinks sk / sv [B, NS, Hkv, D], packed
    kq / vq [B, C, Hkv, D * bits / 8], key scale / zero [B, C / key_group, Hkv, D], value scale / zero
    [B, C, Hkv, D / VG], bf16 ring rk / rv [B, ring, Hkv, D]; `bound` [1] int64 (first slot read from the
    ring), `length` slots read; rotation R [D, D] fp32 of a rotated cache, else None; capturable: a
    decode step's read (one opaque custom op).

    window: the base stream's bf16 keys (`DenseKV`), which windowed queries read instead.
    high: (b0, hk, hv) the bf16 K/V of slots [b0, length) of a prefill chunk, for queries of that
    chunk whose bound lies below the cache's (the reference path)."""

    sk: torch.Tensor
    sv: torch.Tensor
    kq: torch.Tensor
    vq: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    rk: torch.Tensor
    rv: torch.Tensor
    bound: torch.Tensor
    length: int
    key_bits: int
    value_bits: int
    key_group: int
    rotation: torch.Tensor | None = None
    recent: int = 0  # slots kept in bf16 at least: bound(L) = (L - recent) // key_group * key_group
    window: DenseKV | None = None
    high: tuple | None = None
    capturable: bool = False

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The storage in the kernels' argument order: (sk, sv, kq, vq, k_scale, k_zero, v_scale,
        v_zero, rk, rv)."""
        return (self.sk, self.sv, self.kq, self.vq, self.k_scale, self.k_zero, self.v_scale, self.v_zero,
                self.rk, self.rv)


@dataclass
class PagedLowBitKV:
    """One layer of a low-bit block pool as one forward's rows read it (`models.paged_lowbit`).

    Every block holds its slots packed (`ops/lowbit/format.py`; a key group lies inside one block):
    kq / vq [N * block_size, Hkv, D * bits / 8], key scale / zero [N * block_size / key_group, Hkv, D],
    value scale / zero [N * block_size, Hkv, D / VG]. A block a reader still needs in bf16 (its
    window, the sinks of block 0) also has a bf16 twin block; `window` describes the twins as a
    `PagedKV` (block tables of twin blocks), which the base rows read. The output rows `out`
    (block tables of packed blocks, `out_twins` [R, max_blocks] the twin of each) read, for a
    query at position t: positions below `sinks` from block 0's twin, [sinks, bound(t + 1)) packed,
    the rest from the twins, bound(n) = max(0, n - recent) // key_group * key_group (what
    `LowBitStaticCache` reads at that position). rotation: R [D, D] fp32 of a rotated pool, else None."""

    window: PagedKV
    out: PagedRows
    out_twins: torch.Tensor
    kq: torch.Tensor
    vq: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    key_bits: int
    value_bits: int
    key_group: int
    sinks: int
    recent: int
    rotation: torch.Tensor | None = None

    def packed(self) -> tuple[torch.Tensor, ...]:
        """(kq, vq, k_scale, k_zero, v_scale, v_zero): the kernels' argument order."""
        return self.kq, self.vq, self.k_scale, self.k_zero, self.v_scale, self.v_zero


@dataclass
class ShardedKV:
    """One layer of a context-parallel cache as one rank reads it (`parallel.ShardedCache`). The
    cache supplies the communication, `ops.attend` the kernels.

    shard: this rank's K/V (`start`: its first slot).
    merge: (o [B, M, H, D] fp32, lse [B, M, H]) of this rank's keys -> the exact output over every
        rank's keys (an all-gather); every rank calls it for the same rows, in the same order.
    halo: set while the rows are this rank's shard of a prompt (prefill): a call returning what the
        shard's base rows see, the window's slots before the shard (from earlier ranks) then the
        shard, as `DenseKV`; those rows then read it here, with no merge. A collective too: every
        rank calls it when its base rows are read. None (decoding: replicated rows): every row
        reads this rank's keys and merges."""

    shard: DenseKV
    merge: Callable
    halo: Callable | None = None
    sinks: int = 0  # windowed rows' attention sinks among this shard's keys (the first shard's first slots)
