"""Blocked attention on SDPA: the CPU path (and the fallback anywhere).

With the `dense_start` promise (one document per row, no padding) the
masks are simple shapes and `sdpa_cpu.dense_attention` needs no document
lookups: causal, unmasked, or a band of C x (C + W - 1) scores per chunk.

A windowed stream at consecutive slots (the base stream) with documents or
padding is the same band with the documents in its mask
(`sdpa_cpu.band_attention`). Otherwise queries are cut into chunks; each chunk attends only to the key
range its queries can see (`key_bounds`), through SDPA under the exact mask
of that chunk (`sdpa_cpu.masked_attention`); with attention sinks, plus the sink keys before
that range, gathered. For the base stream (window W,
chunk C) that is C x (C + W - 1) scores per chunk, so a whole pass touches
O(T * W) scores and never a T x T matrix. For the output stream it is
O(M * S) in chunks of bounded size.

Both compute `naive_attention`'s function in its compute dtype (fp32, fp64
for fp64 inputs), so results equal it up to rounding; SDPA's kernel gives
the gradients.
"""

from __future__ import annotations

import torch

from .blocks import key_bounds
from .masks import doc_rank
from .sdpa_cpu import MASK_BUDGET, band_attention, dense_attention, masked_attention


def chunked_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, dense_start=None, chunk=None,
                      sinks: int = 0):
    """Same contract as `naive_attention` (shapes, masks, empty rows -> 0)."""
    B, M, H, D = q.shape
    S = k.shape[1]
    if M == 0 or S == 0:
        return q.new_zeros(B, M, H, D)
    sinks = sinks if window is not None else 0
    if dense_start is not None and chunk is None and not sinks:
        return dense_attention(q, k, v, dense_start, window, scale)
    if window is not None and chunk is None and q_slot.shape[0] == 1 and not sinks:  # consecutive base-stream slots
        s0 = q_slot[0, 0]
        run = (q_slot[0] - s0 == torch.arange(M, device=q.device)).all()
        first, run = torch.stack([s0.long(), run.long()]).tolist()  # one host sync
        if run:
            return band_attention(q, k, v, first, q_doc, k_doc, window, scale)
    lo, hi = key_bounds(q_slot, q_doc, k_doc, window)
    if chunk is None:
        span = S if window is None else min(S, window + 256)
        chunk = max(16, min(1024, MASK_BUDGET // max(1, B * span)))
        if window is not None:  # a chunk of C queries reads C + W - 1 keys: keep C near a few W
            chunk = min(chunk, max(64, 2 * window))
    n = -(-M // chunk)
    # One host sync for every chunk's key range.
    lo_c = torch.nn.functional.pad(lo, (0, n * chunk - M), value=S).view(B, n, chunk).amin((0, 2))
    hi_c = torch.nn.functional.pad(hi, (0, n * chunk - M), value=-1).view(B, n, chunk).amax((0, 2))
    ranges = torch.stack([lo_c, hi_c], 1).tolist()
    slot = q_slot.expand(B, M)
    if sinks:  # each chunk also reads the sink keys before its range, gathered (`masks.visible`)
        rank = doc_rank(k_doc)
        sink_keys = ((rank < sinks) & (k_doc >= 0)).any(0).nonzero()[:, 0]  # every row's (the mask sorts them)
    outs = []
    for i, (a, b) in enumerate(ranges):
        s, e = i * chunk, min(M, (i + 1) * chunk)
        if b < a:  # no query of this chunk sees any key
            outs.append(q.new_zeros(B, e - s, H, D))
            continue
        if sinks:
            idx = torch.cat([sink_keys[sink_keys < a], torch.arange(a, b + 1, device=k.device)])
            outs.append(masked_attention(q[:, s:e], k[:, idx], v[:, idx], slot[:, s:e], q_doc[:, s:e], k_doc[:, idx],
                                         window=window, scale=scale, k_slot=idx, sinks=sinks, k_rank=rank[:, idx]))
            continue
        outs.append(masked_attention(q[:, s:e], k[:, a:b + 1], v[:, a:b + 1], slot[:, s:e] - a, q_doc[:, s:e],
                                     k_doc[:, a:b + 1], window=window, scale=scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

