"""`attend`: attention of queries over a cache layer's stored K/V, the kernel chosen here, once.

A cache writes and describes its storage (`ops.kv`); this module reads it:

    DenseKV   fp8 scales folded into the queries and the output; a decode step's read of a
              preallocated buffer as one opaque custom op (`decode_attention`); else `attention`
              (which asks `splitkv_takes` for the split-KV kernel; fp8 is dequantized where the
              kernel does not take the call).
    LowBitKV  windowed queries read the bf16 window; the others the low-bit reader of the
              split-KV op where it takes the call, else dequantize-then-attend.
    PagedKV   single queries by the paged reader, prompt chunks by gathering their keys.
    PagedLowBitKV  base rows read the bf16 twins as `PagedKV`; output rows the paged low-bit reader.
    ShardedKV a prefill shard's base rows read its halo as `DenseKV`; every other row reads this
              rank's keys (`partial_attention`, with the log-sum-exp) and the cache's `merge`
              combines the ranks' partials.

Shapes: q [B, M, H, D], q_slot [1 or B, M], q_doc [B, M], k_doc [B, S] -> [B, M, H, D].
`base_rows`: how many leading rows are base-stream rows (a paged read plans each stream's rows).
`window_rows`: only the first `window_rows` rows use `window` (both streams of decodes in one call);
`dense_start` may then be a pair (the base rows' hint, the output rows' hint), used where the two
groups run as two calls; so may `q_slot` and `q_doc` (concatenated only where one call takes both).
"""

from __future__ import annotations

import torch

from . import attention
from .kv import DenseKV, LowBitKV, PagedKV, PagedLowBitKV, ShardedKV
from .lowbit.format import dense_kv, packed_bound
from .lse import partial_attention
from .splitkv.common import splitkv_takes


def attend(q, kv, q_slot, q_doc, k_doc, window=None, scale=None, backend: str = "auto", dense_start=None,
           window_rows=None, base_rows: int = 0, sinks: int = 0):
    if isinstance(kv, PagedKV):  # its plans know every row: the slots and documents are not read
        from .paged_read import paged_attend

        return paged_attend(q, kv, window, scale, backend, window_rows, base_rows)
    if isinstance(kv, PagedLowBitKV):  # (its base rows' attention sinks: `kv.window.sinks`)
        from .paged_read import paged_lowbit_attend

        return paged_lowbit_attend(q, kv, window, scale, backend, window_rows, base_rows)
    if isinstance(kv, DenseKV):
        return _dense(q, kv, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows, sinks)
    if isinstance(kv, LowBitKV):
        return _lowbit(q, kv, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows, sinks)
    if isinstance(kv, ShardedKV):
        return _sharded(q, kv, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows, base_rows,
                        sinks)
    raise TypeError(f"attend reads DenseKV, LowBitKV, PagedKV, PagedLowBitKV or ShardedKV, got {type(kv).__name__}")


def _joined(q_slot, q_doc, B: int):
    """Slots and documents given per group (tuples) -> one [B, M] tensor each."""
    if isinstance(q_slot, tuple):
        q_slot = torch.cat([s if s.shape[0] == B else s.expand(B, s.shape[1]) for s in q_slot], 1)
    if isinstance(q_doc, tuple):
        q_doc = torch.cat(q_doc, 1)
    return q_slot, q_doc


def _groups(q_slot, q_doc, r: int, B: int, M: int):
    """(slots, documents) of rows [0, r) and [r, M), from tuples or from whole tensors."""
    if isinstance(q_slot, tuple):
        return (q_slot[0], q_doc[0]), (q_slot[1], q_doc[1])
    slot = q_slot.expand(B, M)
    return (slot[:, :r], q_doc[:, :r]), (slot[:, r:], q_doc[:, r:])


def _per_head(s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-KV-head scales [Hkv] -> [H, 1] in q's dtype (to fold into q [B, M, H, D] or an output)."""
    return s.repeat_interleave(q.shape[2] // s.shape[0])[:, None].to(q.dtype)


def _dense(q, kv: DenseKV, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows, sinks=0):
    """sinks: windowed rows' attention sinks, which keys from slot 0 hold, or a window's keys after its `head`."""
    k, v = kv.k, kv.v
    sinks = sinks if window is not None else 0
    if sinks and kv.head < min(kv.start, sinks):
        raise ValueError(f"attention sinks (sink_tokens={sinks}): these keys start at slot {kv.start} without the "
                         f"sinks below them (DenseKV.head={kv.head})")
    M = q.shape[1]
    pair = window is not None and window_rows is not None and window_rows < M
    if pair and not kv.capturable and not splitkv_takes(q, k.shape[2], backend, k, v):
        # windowed rows, then the others: one call each (the split-KV kernel takes both in one launch)
        r, (da, db) = window_rows, dense_start if isinstance(dense_start, tuple) else (None, None)
        (sa, qa), (sb, qb) = _groups(q_slot, q_doc, r, q.shape[0], M)
        a = _dense(q[:, :r], kv, sa, qa, k_doc, window, scale, backend, da, None, sinks)
        b = _dense(q[:, r:], kv, sb, qb, k_doc, None, scale, backend, db, None)
        return torch.cat([a, b], 1)
    if isinstance(dense_start, tuple):  # per-group hints: the rows run as one call
        dense_start = None
    q_slot, q_doc = _joined(q_slot, q_doc, q.shape[0])
    if kv.k_scale is not None:  # fp8: q . (s k) = (s q) . k per head
        q = q * _per_head(kv.k_scale, q)
    if kv.capturable:
        o = decode_attention(q, k, v, q_slot.expand(q.shape[0], -1), q_doc, k_doc,
                             0 if window is None else int(window), q.shape[-1] ** -0.5 if scale is None else scale,
                             -1 if window_rows is None else int(window_rows), int(sinks))
    else:
        if kv.start:  # keys from slot `start` on (a window's keys), after `head` sinks from slot 0
            k_doc, q_slot, dense_start = kv.key_docs(k_doc), kv.local(q_slot), kv.local(dense_start)
        if kv.k_scale is not None and dense_start is not None and window is not None and not sinks and not kv.head:
            w = DenseKV.seen(k, v, dense_start, None, window)  # a windowed chunk: dequantize only what it can see
            k, v, k_doc, q_slot, dense_start = w.k, w.v, w.key_docs(k_doc), w.local(q_slot), w.local(dense_start)
        fp8_kernel = k.dtype == torch.float8_e4m3fn and splitkv_takes(q, k.shape[2], backend, k, v)
        if k.dtype != q.dtype and not fp8_kernel:  # the split-KV kernel reads fp8 itself
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = attention(q, k, v, q_slot, q_doc, k_doc, window=window, scale=scale, backend=backend,
                      dense_start=dense_start, window_rows=window_rows, sinks=sinks)
    if kv.v_scale is not None:
        o = o * _per_head(kv.v_scale, o)
    return o


def _lowbit(q, kv: LowBitKV, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows, sinks=0):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel = splitkv_takes(q, kv.sk.shape[2], backend)
    sinks = sinks if window is not None else 0
    if kv.capturable:
        q_slot, q_doc = _joined(q_slot, q_doc, q.shape[0])
        return lowbit_decode_attention(q, *kv.parts(), q_slot.expand(q.shape[0], -1), q_doc, k_doc, kv.bound,
                                       0 if window is None else int(window), scale,
                                       -1 if window_rows is None else int(window_rows), kv.key_bits, kv.value_bits,
                                       kv.key_group, kv.rotation, kernel, int(sinks))
    if window_rows is not None and window is not None and window_rows < q.shape[1]:  # a one-token pair
        r = window_rows
        (sa, qa), (sb, qb) = _groups(q_slot, q_doc, r, q.shape[0], q.shape[1])
        a = _lowbit(q[:, :r], kv, sa, qa, k_doc, window, scale, backend, None, None, sinks)
        b = _lowbit(q[:, r:], kv, sb, qb, k_doc, None, scale, backend, None, None)
        return torch.cat([a, b], 1)
    q_slot, q_doc = _joined(q_slot, q_doc, q.shape[0])
    if window is not None:  # the base stream reads only its bf16 window (and the sinks below it)
        return _dense(q, kv.window, q_slot, q_doc, k_doc, window, scale, backend, dense_start, None, sinks)
    return _lowbit_outputs(q, kv, q_slot.expand(q.shape[0], -1), q_doc, k_doc, scale, backend, kernel)


def _lowbit_outputs(q, kv: LowBitKV, q_slot, q_doc, k_doc, scale, backend, kernel):
    """Prefill's output queries q [B, M, H, D] at slots q_slot [B, M]: a query at slot t reads the cache
    as a decode step at t would (low-bit below bound(t + 1)), so its logits do not depend on how the
    prompt was chunked. Queries are taken in groups of one bound."""
    if q.shape[1] == 0:  # a chunk without output positions
        return torch.zeros_like(q)
    L, g = kv.length, kv.key_group
    now = packed_bound(L, kv.recent, g)  # the cache's bound (kv.bound, without reading the tensor)
    bq = packed_bound(q_slot + 1, kv.recent, g)
    values = torch.unique(bq).tolist()
    if values == [now] and kernel:  # the ring holds [now, L)
        from .splitkv.lowbit import lowbit_splitkv_attention

        return lowbit_splitkv_attention(q, kv, q_slot, q_doc, k_doc, scale=scale)
    b0, hk, hv = kv.high
    o = None
    for b in values:
        kd, vd = dense_kv(*kv.parts(), b, L, kv.key_bits, kv.value_bits, kv.key_group, kv.rotation is not None)
        kd[:, b:], vd[:, b:] = hk[:, b - b0:].float(), hv[:, b - b0:].float()  # bf16 at and above b
        cols = (bq == b).any(0).nonzero()[:, 0]
        ob = attention(q[:, cols], kd.to(q.dtype), vd.to(q.dtype), q_slot[:, cols], q_doc[:, cols], k_doc,
                       scale=scale, backend=backend)
        if o is None and len(values) == 1:
            return ob
        o = q.new_zeros(q.shape) if o is None else o
        o[:, cols] = torch.where((bq[:, cols] == b)[..., None, None], ob, o[:, cols])
    return o


def _sharded(q, kv: ShardedKV, q_slot, q_doc, k_doc, window, scale, backend, dense_start, window_rows,
             base_rows: int, sinks: int = 0):
    """A context-parallel shard's read (slots and k_doc are global). With a halo (prefill) a group of
    base rows reads it here; any other group (all of them when decoding) reads this rank's keys and
    merges with the other ranks' partials, one `kv.merge` a call."""
    B, M = q.shape[:2]
    if kv.halo is not None and base_rows:
        if base_rows < M:  # the model keeps a shard's streams apart (`OrthrosModel.forward`)
            raise ValueError("a prefill shard's base rows and output rows must be read as separate groups")
        return _dense(q, kv.halo(), q_slot, q_doc, k_doc, window, scale, backend, dense_start, None, sinks)
    q_slot, q_doc = _joined(q_slot, q_doc, B)
    a, S = kv.shard.start, kv.shard.k.shape[1]
    slot, k_doc = q_slot.expand(B, M) - a, k_doc[:, a:a + S]
    w = M if window is None or window_rows is None else window_rows  # the rows that use the window
    parts = [partial_attention(q[:, i:j], kv.shard.k, kv.shard.v, slot[:, i:j], q_doc[:, i:j], k_doc, win, scale,
                               sinks=kv.sinks if sinks else 0)
             for i, j, win in ((0, w, window), (w, M, None)) if i < j]
    o, lse = (torch.cat(x, 1) for x in zip(*parts))
    return kv.merge(o, lse).to(q.dtype)


# ----------------------------------------------------------- a decode step's reads (capturable)
@torch.library.custom_op("orthros::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_slot: torch.Tensor, q_doc: torch.Tensor,
                     k_doc: torch.Tensor, window: int, scale: float, window_rows: int, sinks: int = 0) -> torch.Tensor:
    """A few queries [B, M, H, D] over a whole (possibly fp8) cache buffer; window 0 = none;
    window_rows -1 = the window applies to every query (see `ops.attention`); sinks: attention sinks.

    Opaque to torch.compile (one node in the graph), captured as is in CUDA graphs."""
    win = None if window == 0 else window
    rows = None if window_rows < 0 else window_rows
    if splitkv_takes(q, k.shape[2], "auto"):
        from .splitkv.dense import splitkv_attention

        # Queries that all have a window read at most `window` keys: one split, no merge
        # kernels after it.
        splits = 1 if win is not None and win <= 1024 and (rows is None or rows >= q.shape[1]) else None
        return splitkv_attention(q, k, v, q_slot, q_doc, k_doc, window=win, scale=scale, num_splits=splits,
                                 window_rows=rows, sinks=sinks).contiguous()
    k, v = k.to(q.dtype), v.to(q.dtype)
    return attention(q, k, v, q_slot, q_doc, k_doc, window=win, scale=scale, window_rows=rows,
                     sinks=sinks).contiguous()


@decode_attention.register_fake
def _(q, k, v, q_slot, q_doc, k_doc, window, scale, window_rows, sinks=0):
    return torch.empty_like(q)


@torch.library.custom_op("orthros::lowbit_decode_attention", mutates_args=())
def lowbit_decode_attention(q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
                            k_scale: torch.Tensor, k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                            rk: torch.Tensor, rv: torch.Tensor, q_slot: torch.Tensor, q_doc: torch.Tensor,
                            k_doc: torch.Tensor, bound: torch.Tensor, window: int, scale: float, window_rows: int,
                            key_bits: int, value_bits: int, key_group: int, rotation: torch.Tensor | None,
                            kernel: bool, sinks: int = 0) -> torch.Tensor:
    """A decode step's queries [B, M, H, D] over a low-bit cache (the whole capacity; the
    kernel clips to what each query sees). window 0 = none; window_rows -1 = every row;
    rotation: R [D, D] of a rotated cache, or None; kernel: the split-KV kernel, else
    dequantize-then-attend; v_scale / v_zero head-major as the cache stores them, [B, Hkv, C, NG];
    sinks: windowed rows' attention sinks (the first `sinks` slots).
    Opaque to torch.compile, captured as is in CUDA graphs."""
    v_scale, v_zero = v_scale.transpose(1, 2), v_zero.transpose(1, 2)
    win = None if window == 0 else window
    rows = None if window_rows < 0 else window_rows
    S = k_doc.shape[1]
    if kernel:
        from .splitkv.lowbit import lowbit_splitkv_attention

        kv = LowBitKV(sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, bound, S, key_bits, value_bits,
                      key_group, rotation)
        return lowbit_splitkv_attention(q, kv, q_slot, q_doc, k_doc, window=win, scale=scale,
                                        window_rows=rows, sinks=sinks).contiguous()
    kd, vd = dense_kv(sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, bound, S, key_bits, value_bits,
                      key_group, rotation is not None)
    return attention(q, kd.to(q.dtype), vd.to(q.dtype), q_slot, q_doc, k_doc, window=win, scale=scale,
                     window_rows=rows, sinks=sinks).contiguous()


@lowbit_decode_attention.register_fake
def _(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc, bound, window, scale,
      window_rows, key_bits, value_bits, key_group, rotation, kernel, sinks=0):
    return torch.empty_like(q)
