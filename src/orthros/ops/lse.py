"""Partial attention results and their merge by log-sum-exps.

Attention over a key set split into disjoint parts is exact from each part's
softmax-normalised output and log-sum-exp: the split-KV kernel's splits, a
prefill chunk's past keys and causal block (`dense.sdpa_causal_offset`), the
shards of a context-parallel cache (`ops.attend` reads a `ShardedKV` with
`partial_attention`, `orthros.parallel` merges across ranks with `lse_merge`).
"""

from __future__ import annotations

import torch


def lse_merge(o, lse: torch.Tensor):
    """o: R partials [..., D] (a stacked tensor [R, ..., D] or a sequence), lse [R, ...]
    (natural log-sum-exp of each part's scaled scores) -> (o [..., D] fp32, lse [...]).
    Rows that see no key in any part get 0 and -inf. One fp32 partial at a time is
    materialised: no [R, ..., D] product."""
    top = lse.amax(0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)  # 0 for parts that see nothing
    total = w.sum(0)
    out = None
    for r in range(len(o)):
        term = o[r].to(torch.float32, copy=True).mul_(w[r][..., None])
        out = term if out is None else out.add_(term)
    out.div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
    return out, torch.log(total) + top[0]


KEY_CHUNK = 1 << 15  # keys per reference-op call where the split-KV kernel does not take a part


def partial_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, key_chunk: int = KEY_CHUNK,
                      sinks: int = 0):
    """Attention of a few queries over one part of the keys: (o [B, M, H, D] fp32, lse [B, M, H]),
    to be merged with the other parts' by `lse_merge`. Shapes as `naive_attention`; slots are
    the part's own (key i of k is slot i).

    Keys before every query's window are skipped (but the first `sinks`: windowed queries' attention
    sinks, for a part whose documents start at its first key); a part none of whose keys is visible
    returns lse = -inf (weight 0). The split-KV kernel where it takes the call (on CUDA, or under the
    Triton interpreter in tests), else the reference op on blocks of `key_chunk` keys, merged
    like parts."""
    from .naive import naive_attention
    from .splitkv.common import interpreting, splitkv_takes

    B, M, H, D = q.shape
    sinks = sinks if window is not None else 0
    if window is not None and k.shape[1]:
        lo = max(0, int(q_slot.min()) - window + 1)
        h = min(lo, sinks)  # the sinks below the window stay, before it (slots closed up)
        k, v = (torch.cat([x[:, :h], x[:, lo:]], 1) for x in (k, v))
        k_doc, q_slot = torch.cat([k_doc[:, :h], k_doc[:, lo:]], 1), q_slot - lo + h
    S = k.shape[1]
    if S == 0:
        return q.new_zeros(B, M, H, D, dtype=torch.float32), q.new_full((B, M, H), float("-inf"), dtype=torch.float32)
    if splitkv_takes(q, k.shape[2], "triton" if interpreting() else "auto"):
        from .splitkv.dense import splitkv_attention

        return splitkv_attention(q.contiguous(), k, v, q_slot, q_doc, k_doc, window=window, scale=scale,
                                 return_lse=True, sinks=sinks)
    os_, lses = [], []
    for s in range(0, S, key_chunk):
        e = s + key_chunk
        o, lse = naive_attention(q, k[:, s:e], v[:, s:e], q_slot - s, q_doc, k_doc[:, s:e], window=window,
                                 scale=scale, return_lse=True, sinks=sinks if s == 0 else 0)
        os_.append(o.float())
        lses.append(lse)
    if len(os_) == 1:
        return os_[0], lses[0]
    return lse_merge(torch.stack(os_), torch.stack(lses))
