"""A paged KV cache: one pool of fixed-size blocks shared by many sequences,
and the cache object one mixed forward (decodes and prompt chunks) reads.

    PagedKVPool    — per layer K/V [num_blocks * block_size, Hkv, D] (the model's
                     dtype, bf16, or fp8 e4m3 with per-(layer, KV head) scales).
                     Which blocks belong to whom is the caller's bookkeeping
                     (a serving engine's block manager). Its low-bit form (int4 / int2 /
                     k4v2, packed blocks and bf16 twins): `paged_lowbit.PagedLowBitPool`.
    Segment        — a run of new tokens of one sequence in a forward: its
                     tokens, the position of the first, the sequence's block
                     table, and whether its last token is an output position.
    PagedStepCache — the forward's cache: packs the segments as one row
                     [1, T] (each segment its own document), builds the
                     `Layout` and, as the layers call it, writes each new
                     token's K/V to its block slot and computes attention.

A decode is a segment of one token with an output; a prompt's chunks without
its last token have no output position and run the base stream only (SPEC
§2). `write` stores the new K/V and describes, per stream, what the rows read (`ops.kv.PagedKV`);
`ops.attend` reads it by segment (`ops/paged_read.py`):

    single queries (a decode's base and output rows, a prompt's output row)
        the paged reader of the split-KV op: each reads its own blocks through
        the block table, no copy (a Triton kernel on CUDA);
    a prompt chunk's base rows
        the chunk's visible keys (its window, or everything before it for
        `attention="full"`) gathered from the blocks into one contiguous run,
        then `ops.attention` with the dense-chunk hint (SDPA / FlexAttention,
        as in an ordinary chunked prefill).

The layers call `write` like any cache's; the model never learns about blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.kv import PagedChunk, PagedKV, PagedLowBitKV, PagedRows
from .layout import Layout
from .paged_lowbit import PagedLowBitPool, lowbit_bytes_per_token
from .static_cache import FP8, FP8_MARGIN, FP8_MAX, LOWBIT_KV_DTYPES, kv_storage_dtype


def kv_bytes_per_token(config, model_dtype: torch.dtype, kv_dtype: str = "auto") -> float:
    """Bytes of K + V one token takes over all layers (a low-bit pool: packed, with the scales'
    share; its bf16 twin blocks are a fixed cost apart, `paged_lowbit.twin_bytes_per_block`)."""
    if kv_dtype in LOWBIT_KV_DTYPES:
        return lowbit_bytes_per_token(config, kv_dtype)
    item = torch.empty(0, dtype=kv_storage_dtype(kv_dtype, model_dtype)).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * item


class PagedKVPool:
    """K/V storage of `num_blocks` blocks of `block_size` tokens for every layer."""

    def __init__(self, config, num_blocks: int, block_size: int, device, dtype: torch.dtype, kv_dtype: str = "auto"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        L, Hkv, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.num_layers, self.num_blocks, self.block_size = L, num_blocks, block_size
        self.device, self.dtype = torch.device(device), dtype
        self.storage = kv_storage_dtype(kv_dtype, dtype)
        self.fp8 = self.storage == FP8
        n = num_blocks * block_size
        # zeros, not empty: slots never written must not hold NaN bit patterns
        self.k = [torch.zeros(n, Hkv, D, device=device, dtype=self.storage) for _ in range(L)]
        self.v = [torch.zeros(n, Hkv, D, device=device, dtype=self.storage) for _ in range(L)]
        self.k_scale = torch.ones(L, Hkv, device=device, dtype=torch.float32)
        self.v_scale = torch.ones(L, Hkv, device=device, dtype=torch.float32)
        self.scaled = [False] * L
        # Prompt-chunk lengths whose windowed attention runs the compiled (shape-specialised)
        # kernel; any other length runs the blocked op. None: every multiple of 128. A serving
        # engine sets the lengths its token budget cuts and compiles them before serving.
        self.compiled_chunks: frozenset[int] | None = None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at pool slots [T].

        fp8: each layer's scales are fixed by the first tokens ever written (their absmax
        x FP8_MARGIN, rounded up to a power of two, as `StaticOrthrosCache` does) and never
        change after, so blocks written by one request stay valid for every other
        (prefix caching); later values beyond the range saturate at +-448."""
        if self.fp8:
            if not self.scaled[layer]:
                for s, x in ((self.k_scale, k), (self.v_scale, v)):
                    amax = x.detach().abs().float().amax(dim=(0, 2))
                    s[layer] = torch.exp2(torch.ceil(torch.log2((amax * FP8_MARGIN / FP8_MAX).clamp_min(2.0**-60))))
                self.scaled[layer] = True
            k = (k.float() / self.k_scale[layer][:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            v = (v.float() / self.v_scale[layer][:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            # index_copy_ has no fp8 kernels: copy the bytes
            self.k[layer].view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
            self.v[layer].view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
            return
        self.k[layer].index_copy_(0, slots, k.to(self.storage))
        self.v[layer].index_copy_(0, slots, v.to(self.storage))

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype):
        """K, V at pool slots [S] as one contiguous run [1, S, Hkv, D] in `dtype` (fp8: unscaled)."""
        k, v = self.k[layer], self.v[layer]
        if self.fp8:  # no fp8 indexing kernels everywhere: index the bytes
            k, v = k.view(torch.uint8)[slots].view(FP8), v.view(torch.uint8)[slots].view(FP8)
        else:
            k, v = k[slots], v[slots]
        return k[None].to(dtype), v[None].to(dtype)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


@dataclass
class Segment:
    tokens: list[int]  # the new tokens of this forward
    start: int  # position of tokens[0] in its sequence (= tokens already in the cache)
    blocks: list[int]  # the sequence's block table, covering start + len(tokens) tokens
    output: bool  # the last token is an output position (a decode, or a prompt's last chunk)


_Dense = PagedChunk  # a prompt chunk's base rows (`ops.kv.PagedChunk`)
_Single = PagedRows  # rows of one query each (`ops.kv.PagedRows`)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without synchronizing it: on CUDA through pinned memory, copied
    asynchronously (the host allocator keeps the pinned copy until the copy is done). A pageable
    copy would wait for every kernel queued before it, so the next step's inputs could not be
    prepared while this step's forward runs."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PagedStepCache:
    """The cache of one forward over `segments` (see the module docstring).

    Attributes:
        input_ids: [1, T] the segments' tokens, packed.
        layout: the forward's `Layout` (RoPE positions, output rows).
        slots: [T] pool slot of every new token.
    Implements `models.kv.KVCache`.
    """

    reference_reads = False

    def __init__(self, pool: PagedKVPool | PagedLowBitPool, config, segments: list[Segment]):
        if not segments:
            raise ValueError("a forward needs at least one segment")
        self.pool = pool
        dev, bs = pool.device, pool.block_size
        kg = pool.key_group if isinstance(pool, PagedLowBitPool) else None
        groups = []  # low-bit: (pool slot, position) of the first slot of each key group completed here
        self.base_window = None if config.attention == "full" else config.window_size
        # attention sinks: a windowed chunk's keys begin with its sequence's first positions below its window
        self.sinks = getattr(config, "sink_tokens", 0) if self.base_window is not None else 0
        tokens, pos, doc, out_idx, slots = [], [], [], [], []
        base_single, out_single, dense = [], [], []  # (segment, position) / _Dense
        max_blocks = max(len(s.blocks) for s in segments)
        table = torch.zeros(len(segments), max_blocks, dtype=torch.int32)
        for i, s in enumerate(segments):
            n = len(s.tokens)
            if n == 0 or len(s.blocks) * bs < s.start + n:
                raise ValueError(f"segment {i}: {n} tokens from position {s.start} need "
                                 f"{-(-(s.start + n) // bs)} blocks, it has {len(s.blocks)}")
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
            r0 = len(tokens)
            p = torch.arange(s.start, s.start + n)
            tokens += s.tokens
            pos.append(p)
            doc += [i] * n
            slots.append(table[i].long()[p // bs] * bs + p % bs)
            if kg:
                gp = torch.arange(-(-(s.start + 1) // kg) - 1, (s.start + n) // kg) * kg
                groups.append(torch.stack([table[i].long()[gp // bs] * bs + gp % bs, gp]))
            if n == 1:
                base_single.append((r0, i, s.start))
            else:
                a = 0 if self.base_window is None else max(0, s.start - self.base_window + 1)
                ns = min(a, self.sinks)
                kp = torch.cat([torch.arange(ns), torch.arange(a, s.start + n)])
                ks = table[i].long()[kp // bs] * bs + kp % bs
                m = self._padded_rows(n, s.start - a)
                if m > n:  # keys past the chunk's last one: no real query sees them (causal)
                    ks = torch.cat([ks, ks[-1:].expand(m - n)])
                qs = (ns + s.start - a + torch.arange(m, device=dev))[None]
                dense.append(_Dense(r0, r0 + n, ns + s.start - a, upload(ks, dev), qs, torch.zeros_like(qs),
                                    torch.zeros(1, ks.numel(), dtype=torch.long, device=dev)))
            if s.output:
                out_single.append((len(out_idx), i, s.start + n - 1))
                out_idx.append(r0 + n - 1)
        self.input_ids = upload(torch.tensor(tokens, dtype=torch.long), dev)[None]
        self.slots = upload(torch.cat(slots), dev)
        self.table = upload(table, dev)
        self._dense = dense
        self._base_single = self._single(base_single)
        self._out_single = self._single(out_single)
        T, N = len(tokens), len(out_idx)
        base_pos = upload(torch.cat(pos), dev)[None]
        base_doc = upload(torch.tensor(doc, dtype=torch.long), dev)[None]
        oi = upload(torch.tensor(out_idx, dtype=torch.long), dev)[None]
        self.layout = Layout(
            base_slot=torch.arange(T, device=dev)[None], base_pos=base_pos, base_doc=base_doc,
            key_doc=base_doc, out_idx=oi, out_valid=torch.ones_like(oi, dtype=torch.bool),
            out_slot=oi.clone(), out_pos=base_pos.gather(1, oi), out_doc=base_doc.gather(1, oi),
            next_pos=base_pos[:, -1] + 1, last_doc=base_doc[:, -1], pairs=not dense and N == T)
        self.num_outputs = N
        self._groups = tuple(upload(torch.cat(groups, 1), dev)) if kg else None
        self._lowbit = None  # the low-bit pool's plan of this forward (made by its first layer)

    @classmethod
    def static_decode(cls, pool: PagedKVPool, input_ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      table: torch.Tensor, max_len: int, sinks: int = 0) -> "PagedStepCache":
        """A decode-only forward over caller-owned buffers (one token per row, each an output):
        input_ids [1, B], pos [B], slots [B], table [B, max_blocks]. Nothing here reads them on
        the host, so a forward through this cache can be captured in a CUDA graph and replayed
        after the buffers are refilled in place; `max_len` bounds every sequence (it fixes the
        attention kernel's launch grid); `sinks`: the model's attention sinks (`sink_tokens`)."""
        self = cls.__new__(cls)
        self.pool, self.sinks = pool, sinks
        B, dev = input_ids.shape[1], input_ids.device
        self.input_ids, self.slots, self.table = input_ids, slots, table
        rows = torch.arange(B, device=dev)
        self._dense = []
        self._base_single = self._out_single = _Single(rows, table, pos, max_len)
        base_pos = pos[None]
        doc = rows[None]
        self.layout = Layout(base_slot=rows[None], base_pos=base_pos, base_doc=doc, key_doc=doc, out_idx=rows[None],
                             out_valid=torch.ones(1, B, dtype=torch.bool, device=dev), out_slot=rows[None].clone(),
                             out_pos=base_pos, out_doc=doc, next_pos=base_pos[:, -1] + 1, last_doc=doc[:, -1],
                             pairs=True)
        self.num_outputs = B
        self._groups = self._lowbit = None
        return self

    def _padded_rows(self, n: int, dense_start: int) -> int:
        """Queries to run for a windowed chunk of n tokens: a chunk off the engine's compiled
        grid (a prompt's last chunk, a short prompt) is padded to the next compiled length
        at the same key offset, if there is one, so that it runs the compiled kernel rather
        than the blocked op (the padded rows' outputs are dropped)."""
        grid, W = self.pool.compiled_chunks, self.base_window
        if grid is None or W is None or n in grid or dense_start not in (0, W - 1):
            return n
        return min((g for g in grid if g > n), default=n)

    def _single(self, items) -> _Single:
        dev = self.pool.device
        rows = torch.tensor([r for r, _, _ in items], dtype=torch.long)
        seg = torch.tensor([i for _, i, _ in items], dtype=torch.long)
        pos = [p for _, _, p in items]
        return _Single(upload(rows, dev), self.table[upload(seg, dev)],
                       upload(torch.tensor(pos, dtype=torch.long), dev),
                       max(pos, default=0) + 1)

    # ----------------------------------------------------------- the layers' API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # every slot is addressed through the plan, not a shared key axis

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> PagedKV | PagedLowBitKV:
        """Write the new tokens' k, v [1, T, Hkv, D] to their blocks; return what this forward's rows
        read (`ops.attend` plans them by stream)."""
        pool = self.pool
        if isinstance(pool, PagedLowBitPool):
            if layer_idx == 0:  # every forward (a captured one too) makes its addresses again
                self._lowbit = pool.plan(self, self._groups)
            return pool.write(layer_idx, self._lowbit, self._out_single, k[0], v[0], self.slots)
        pool.write(layer_idx, self.slots, k[0], v[0])
        scales = (pool.k_scale[layer_idx], pool.v_scale[layer_idx]) if pool.fp8 else (None, None)
        return PagedKV(pool.k[layer_idx], pool.v[layer_idx], pool.block_size, self._base_single, self._out_single,
                       self._dense, pool.compiled_chunks, *scales, sinks=self.sinks)
