"""Attention over a block pool as one forward's rows read it (`ops.kv.PagedKV`, from `PagedStepCache`;
a low-bit pool's `PagedLowBitKV`: its base rows as below over the bf16 twins, its output rows by the
paged low-bit reader, `splitkv/lowbit_paged.py`).

    single queries (a decode's base and output rows, a prompt's output row)
        the paged reader of the split-KV op: each reads its own blocks through the block
        table, no copy;
    a prompt chunk's base rows
        the chunk's visible keys (its window, or everything before it for `attention="full"`)
        gathered from the blocks into one contiguous run, then `attention` with the
        dense-chunk hint (SDPA / FlexAttention, as in an ordinary chunked prefill).
"""

from __future__ import annotations

import torch

from . import attention
from .kv import PagedKV, PagedLowBitKV, PagedRows
from .splitkv.paged import paged_attention

FP8 = torch.float8_e4m3fn


def paged_attend(q, kv: PagedKV, window, scale, backend, window_rows, base_rows: int):
    """q [1, M, H, D] (packed rows): the first `base_rows` rows are base-stream rows, the rest output
    rows; window_rows: a decode pair's base rows use `window`, its output rows none."""
    H, Hkv = q.shape[2], kv.k.shape[1]
    if kv.k_scale is not None:  # fold the K scale into the queries (q . (s k) = (s q) . k per head)
        q = q * kv.k_scale.repeat_interleave(H // Hkv)[:, None].to(q.dtype)
    if window_rows is not None:  # both streams of decodes: [base rows | output rows]
        r = window_rows
        o = q.new_empty(q.shape)  # both calls store into it: no concatenation
        _single(kv, q[:, :r], kv.base, window, scale, out=o[:, :r])
        _single(kv, q[:, r:], kv.out, None, scale, out=o[:, r:])
    elif base_rows and not kv.chunks:  # every segment is one token: rows in order
        o = _single(kv, q, kv.base, window, scale)
    elif base_rows:
        o = q.new_empty(q.shape)
        if kv.base.rows.numel():
            o[:, kv.base.rows] = _single(kv, q[:, kv.base.rows], kv.base, window, scale)
        for d in kv.chunks:
            kd, vd = _gather(kv, d.slots, q.dtype)
            n, m = d.r1 - d.r0, d.q_slot.shape[1]
            # A windowed chunk's compiled kernels are specialised to its length: a length off
            # the engine's chunk grid is padded onto it (`PagedStepCache`) or, past its longest
            # length, runs the blocked op, so no step ever waits for a compilation.
            grid = kv.compiled_chunks
            off_grid = m % 128 if grid is None else not compiled_shape(grid, m, d.slots.numel(), window, kv.sinks)
            be = "chunked" if window is not None and q.is_cuda and off_grid else backend
            # q[0, r0:r1][None], not q[:, r0:r1]: its batch stride is then the chunk's own, not
            # the step's row count (compiled kernels guard on strides: every new mix of decodes
            # beside a chunk would compile it again, 1.5 s steps on an H200)
            qc = q[0, d.r0:d.r1]
            if m > n:
                qc = torch.cat([qc, qc.new_zeros(m - n, *qc.shape[1:])])
            oc = attention(qc[None], kd, vd, d.q_slot, d.q_doc, d.k_doc, window=window, scale=scale,
                           backend=be, dense_start=d.dense_start, sinks=kv.sinks)
            o[:, d.r0:d.r1] = oc[:, :n]
    else:
        o = _single(kv, q, kv.out, window, scale)
    if kv.v_scale is not None:
        o = o * kv.v_scale.repeat_interleave(H // Hkv)[:, None].to(o.dtype)
    return o


def compiled_shape(grid, m: int, keys: int, window: int | None, sinks: int) -> bool:
    """Whether a windowed chunk of `m` query rows over `keys` keys has a shape the serving warm-up
    compiled (`ModelRunner.compile_chunks`): a length of the grid, and the key count of a chunk that
    starts its sequence (m keys) or starts past its first window and sinks (sinks + W - 1 + m). A
    chunk starting inside the first window (after a short prefix-cache hit) has another count: it
    runs the blocked op rather than compile a kernel in a serving step."""
    return m in grid and (window is None or keys in (m, sinks + window - 1 + m))


def _single(kv: PagedKV, q, single: PagedRows, window, scale, out=None):
    """q [1, R, H, D], one query per row of `single` -> [1, R, H, D] (into `out` if given); windowed
    queries also see their sequence's first `kv.sinks` positions."""
    if q.shape[1] == 0:
        return q if out is None else out
    o = paged_attention(q[0], kv.k, kv.v, single.table, single.pos, kv.block_size, window=window, scale=scale,
                        max_len=single.max_len, out=None if out is None else out[0], sinks=kv.sinks)
    return o[None]


def _gather(kv: PagedKV, slots: torch.Tensor, dtype: torch.dtype):
    """K, V at pool slots [S] as one contiguous run [1, S, Hkv, D] in `dtype` (fp8: unscaled)."""
    k, v = kv.k, kv.v
    if k.dtype == FP8:  # no fp8 indexing kernels everywhere: index the bytes
        k, v = k.view(torch.uint8)[slots].view(FP8), v.view(torch.uint8)[slots].view(FP8)
    else:
        k, v = k[slots], v[slots]
    return k[None].to(dtype), v[None].to(dtype)


def paged_lowbit_attend(q, kv: PagedLowBitKV, window, scale, backend, window_rows, base_rows: int):
    """`paged_attend` over a low-bit pool: base rows read the bf16 twins (`kv.window`), output rows
    (the rows after `window_rows` of a decode pair, or a group without base rows) the low-bit reader."""
    from .splitkv.lowbit_paged import paged_lowbit_attention

    if window_rows is not None:  # both streams of decodes: [base rows | output rows]
        r = window_rows
        o = q.new_empty(q.shape)
        _single(kv.window, q[:, :r], kv.window.base, window, scale, out=o[:, :r])
        paged_lowbit_attention(q[0, r:], kv, kv.out, kv.out_twins, scale, out=o[0, r:])
        return o
    if base_rows:
        return paged_attend(q, kv.window, window, scale, backend, None, base_rows)
    return paged_lowbit_attention(q[0], kv, kv.out, kv.out_twins, scale)[None]
