"""The fp32 reference of Orthros attention: SPEC §1 in code.

One function serves both streams. The base stream calls it with its own
slots as queries and a window; the output stream with the output
positions' slots and no window (full causal cross-attention over the
cache). Every fast path is tested against this function.
"""

from __future__ import annotations

import torch

from .masks import doc_rank, visible


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_slot: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    return_probs: bool = False,
    sinks: int = 0,
):
    """Masked softmax attention, computed in fp32 (fp64 for fp64 inputs).

    Args:
        q: [B, M, H, D] queries (M base tokens, or M output tokens).
        k, v: [B, S, Hkv, D] the layer's KV cache; H % Hkv == 0 (GQA:
            query head h reads kv head h // (H // Hkv)).
        q_slot: [B, M] (or [1, M]) the key-axis index of each query's token.
        q_doc: [B, M] document id of each query; k_doc: [B, S] of each key.
        window: sliding window (counts the current token) or None for full.
        sinks: with a window, each query also sees its document's first `sinks` keys.
        scale: softmax scale, default D ** -0.5.
        return_lse: also return the log-sum-exp [B, M, H] (-inf for rows
            that see no key), for split-KV merging.
        return_probs: also return the attention probabilities [B, H, M, S]
            in q's dtype (0 on masked keys; all 0 for a row that sees no key).

    Returns:
        o: [B, M, H, D] in q's dtype. A query that sees no key gets 0.
    """
    B, M, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D ** -0.5 if scale is None else scale
    qf = q.to(cdt).transpose(1, 2)  # [B, H, M, D]
    kf = k.to(cdt).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]
    vf = v.to(cdt).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    k_slot = torch.arange(S, device=q.device)
    rank = doc_rank(k_doc)[:, None, :] if sinks and window is not None else None
    mask = visible(q_slot[:, :, None], k_slot[None, None, :], q_doc[:, :, None], k_doc[:, None, :], window,
                   sinks, rank)
    mask = mask[:, None]  # [B, 1, M, S]
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see nothing
    p = torch.exp(s - m)  # exp(-inf) = 0 on masked entries
    l = p.sum(dim=-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    if return_probs:  # the output made from the returned probabilities (they get gradients, as eager attention's)
        probs = p / l_safe
        return torch.matmul(probs, vf).transpose(1, 2).to(q.dtype), probs.to(q.dtype)
    o = torch.matmul(p, vf) / l_safe
    o = o.transpose(1, 2).to(q.dtype)
    if return_lse:
        lse = (m + torch.log(l)).squeeze(-1).transpose(1, 2)  # [B, M, H]
        return o, lse
    return o
