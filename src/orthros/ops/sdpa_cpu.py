"""Orthros attention through `F.scaled_dot_product_attention`: the CPU fast path.

On CPU, SDPA runs a flash kernel (blocked online softmax, fp32 or fp64
accumulation, a bool mask, native GQA, a backward that recomputes the
scores) for fp32, fp64 and bf16 alike. These functions compute exactly
`naive_attention`'s function with it, in the reference's compute dtype
(fp32; fp64 for fp64 inputs), so results match it up to rounding:

    dense_attention  — the caller's `dense_start` promise (one document per
        row, no padding, queries at consecutive slots): no document lookups.
        Full causal from slot 0 is SDPA's `is_causal`; a single query over
        its whole prefix needs no mask; a sliding window is a causal head
        (the first W slots see every earlier key) and a uniform band: chunks
        of C queries, each over its C + W - 1 keys, cut from K/V as
        overlapping strided views (`unfold`, no copy) so that every chunk
        goes through one SDPA call under one [C, C + W - 1] mask.
    band_attention   — the base stream of any batch (documents, padding, a
        cache offset): the same unfolded band, its mask also comparing the
        documents of each chunk's queries and keys.
    masked_attention — any documents / padding / windows / slots, one chunk
        of queries over a key range, with the mask of `masks.visible`.

A row that sees no key gets 0 and zero gradients: its mask is opened to
every key (no NaN from an empty softmax) and its output is replaced by 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import PAD_K_DOC, PAD_Q_DOC
from .masks import visible

MASK_BUDGET = 1 << 22  # mask elements per SDPA call (B * queries * keys), ~16 MB as fp32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference's compute dtype: fp64 stays fp64, everything else runs in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def band_chunk(window: int) -> int:
    """Queries per chunk of the band (C queries read C + W - 1 keys). Measured on CPU
    (fp32, D = 64, T = 1K-4K): C = 32 is fastest for W = 128 forward and backward, 32-64
    for W = 512; larger chunks waste scores ((C + W - 1) / W), smaller ones add blocks."""
    return min(64, max(32, window // 8))


def _sdpa(q, k, v, mask=None, causal=False, scale=None):
    """q [N, H, M, D], k/v [N, Hkv, L, D] (any strides, last dim contiguous) -> [N, H, M, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _heads_first(x):
    return x.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D] (a view)


def _single_query(q, k, v, scale):
    """One query per row over all of k/v: no mask. q [B, 1, H, D] -> [B, 1, H, D].
    GQA as a view: the G query heads of a KV head become G query rows."""
    B, _, H, D = q.shape
    Hkv = k.shape[2]
    o = _sdpa(q.reshape(B, Hkv, H // Hkv, D), _heads_first(k), _heads_first(v), scale=scale)
    return o.reshape(B, 1, H, D)


def _offset_causal(q, k, v, start: int, scale):
    """Queries at slots start..start+M-1 over keys 0..start+M-1, causal (bottom-right):
    q [B, M, H, D], k/v [B, start + M, Hkv, D]. In query chunks to bound the mask."""
    B, M, H, D = q.shape
    if start == 0:
        return _heads_first(_sdpa(_heads_first(q), _heads_first(k), _heads_first(v), causal=True, scale=scale))
    if M == 1:
        return _single_query(q, k, v, scale)
    step = max(1, MASK_BUDGET // (start + M))
    outs = []
    for s in range(0, M, step):
        e = min(M, s + step)
        i = torch.arange(start + s, start + e, device=q.device)[:, None]
        mask = torch.arange(start + e, device=q.device)[None] <= i  # [e - s, start + e]
        outs.append(_sdpa(_heads_first(q[:, s:e]), _heads_first(k[:, :start + e]), _heads_first(v[:, :start + e]),
                          mask, scale=scale))
    return _heads_first(torch.cat(outs, 2))


def _band(q, k, v, first: int, window: int, scale, q_doc=None, k_doc=None):
    """Queries at slots first..first+M-1, each over its last W key slots: q [B, M, H, D],
    k/v [B, S >= first + M, Hkv, D] -> [B, M, H, D]. Without documents every query must see
    W keys (first >= W - 1); with q_doc [B, M] and k_doc [B, S] the mask also keeps each
    query inside its document, and key slots before 0 are padding that nobody sees."""
    B, M, H, D = q.shape
    docs = q_doc is not None
    a = first - window + 1  # first key slot any query reads
    lead = max(0, -a)  # key slots before 0 (only with documents)
    k, v = k[:, a + lead:first + M], v[:, a + lead:first + M]
    if M == 1 and not docs:
        return _single_query(q, k, v, scale)
    C = min(M, band_chunk(window))
    n = -(-M // C)
    L = C + window - 1
    pad = n * C - M  # queries (and their keys) padded at the end; dropped from the output
    if pad:
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
    if pad or lead:
        k, v = F.pad(k, (0, 0, 0, 0, lead, pad)), F.pad(v, (0, 0, 0, 0, lead, pad))
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None]
    mask = (j >= i) & (j < i + window)  # chunk-relative: query i (slot a + W - 1 + cC + i), key j (slot a + cC + j)
    if docs:
        kd = F.pad(k_doc[:, a + lead:first + M], (lead, pad), value=PAD_K_DOC).unfold(1, L, C)  # [B, n, L]
        qd = F.pad(q_doc, (0, pad), value=PAD_Q_DOC).reshape(B, n, C, 1)
        mask = mask & (qd == kd[:, :, None, :])  # [B, n, C, L]
        seen = mask.any(-1, keepdim=True)
        mask = (mask | ~seen)[:, :, None]  # rows that see nothing read every key (finite), then give 0
    outs = []
    for b in range(B):  # flattening (row, chunk) is a view only for one row at a time
        qc = q[b].reshape(n, C, H, D).transpose(1, 2)  # [n, H, C, D]
        kc = k[b].unfold(0, L, C).transpose(2, 3)  # [n, Hkv, L, D], overlapping views
        vc = v[b].unfold(0, L, C).transpose(2, 3)
        outs.append(_sdpa(qc, kc, vc, mask[b] if docs else mask, scale=scale).transpose(1, 2).reshape(n * C, H, D))
    o = torch.stack(outs) if B > 1 else outs[0][None]
    if docs:
        o = torch.where(seen.view(B, n * C, 1, 1), o, o.new_zeros(()))
    return o[:, :M]


def band_attention(q, k, v, first: int, q_doc, k_doc, window: int, scale: float | None = None):
    """`naive_attention` for queries at consecutive slots first..first+M-1 (the base stream)
    with a window and any documents / padding: q [B, M, H, D], q_doc [B, M], k/v [B, S, Hkv, D],
    k_doc [B, S] -> [B, M, H, D]."""
    cdt = compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = _band(q.to(cdt), k.to(cdt), v.to(cdt), first, window, scale, q_doc.expand(q.shape[0], -1), k_doc)
    return o.to(q.dtype)


def dense_attention(q, k, v, start: int, window: int | None = None, scale: float | None = None):
    """`naive_attention` for a plain causal batch: one document per row, no padding, query i
    at slot start + i. q [B, M, H, D], k/v [B, S >= start + M, Hkv, D] -> [B, M, H, D]."""
    B, M, H, D = q.shape
    end = start + M
    cdt = compute_dtype(q.dtype)
    scale = D ** -0.5 if scale is None else scale
    qf, kf, vf = q.to(cdt), k[:, :end].to(cdt), v[:, :end].to(cdt)  # keys past the last query are never seen
    if window is None or window >= end:  # the window holds every key of every query
        return _offset_causal(qf, kf, vf, start, scale).to(q.dtype)
    head = max(0, min(end, window) - start)  # queries at slots < W see every earlier key
    parts = []
    if head:
        parts.append(_offset_causal(qf[:, :head], kf[:, :start + head], vf[:, :start + head], start, scale))
    if head < M:
        parts.append(_band(qf[:, head:], kf, vf, start + head, window, scale))
    o = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return o.to(q.dtype)


def masked_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, k_slot=None, sinks: int = 0,
                     k_rank=None):
    """`naive_attention` (same arguments and result) through SDPA with the full [M, S] mask:
    for one chunk of queries over the key range it can see. k_slot [S]: the keys' slots when they
    are not 0..S-1 (a gathered set); sinks, k_rank [B, S]: attention sinks (`masks.visible`)."""
    B, M, H, D = q.shape
    S = k.shape[1]
    cdt = compute_dtype(q.dtype)
    scale = D ** -0.5 if scale is None else scale
    k_slot = torch.arange(S, device=q.device) if k_slot is None else k_slot
    mask = visible(q_slot[:, :, None], k_slot[None, None, :], q_doc[:, :, None], k_doc[:, None, :], window,
                   sinks, None if k_rank is None else k_rank[:, None, :])
    seen = mask.any(-1, keepdim=True)  # [B, M, 1]
    mask = mask | ~seen  # rows that see nothing read every key (finite), then give 0
    o = _sdpa(_heads_first(q.to(cdt)), _heads_first(k.to(cdt)), _heads_first(v.to(cdt)), mask[:, None], scale=scale)
    o = _heads_first(o)
    return torch.where(seen[..., None], o, o.new_zeros(())).to(q.dtype)
