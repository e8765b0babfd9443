"""Who sees whom: the one definition of the attention masks.

Every op (naive, FlexAttention, Triton) uses `visible`, written with plain
tensor arithmetic so it broadcasts over whole index grids (naive op) and
also works on the scalar index tensors of a FlexAttention `mask_mod`.

Indices:
    slot  — a token's index on the key axis (its place in the KV cache).
    doc   — a document id; keys are visible only inside the query's document.
            Padding carries doc -1, so it is never visible from real tokens;
            an invalid (padded) output query carries doc -2 and sees nothing.
    rank  — a key's place in its document (0 for the document's first key): the
            first `sinks` keys of a document stay visible to windowed queries
            (attention sinks; `OrthrosConfig.sink_tokens`).
"""

from __future__ import annotations

import torch

PAD_DOC = -1
NO_QUERY_DOC = -2


def visible(q_slot, k_slot, q_doc, k_doc, window: int | None, sinks: int = 0, k_rank=None):
    """Causal (k_slot <= q_slot), same document, and inside `window` if given.

    `window` counts the current token: with window W, key j is visible from
    slot t iff t - W < j <= t (flash-attn's `window_size=(W-1, 0)`). With
    `sinks` S > 0 a windowed query also sees its document's first S keys
    (`k_rank` < S, see `doc_rank`), as StreamingLLM's attention sinks.
    """
    m = (k_slot <= q_slot) & (k_doc == q_doc)
    if window is not None:
        near = q_slot - k_slot < window
        if sinks:
            near = near | (k_rank < sinks)
        m = m & near
    return m


def doc_rank(k_doc):
    """Each key's place in its document, long [B, S], from the keys' document ids [B, S].

    A document's keys are one run of equal ids (packed rows, padding before or after);
    the rank counts from the run's first key."""
    B, S = k_doc.shape
    idx = torch.arange(S, device=k_doc.device).expand(B, S)
    start = torch.ones_like(k_doc, dtype=torch.bool)
    start[:, 1:] = k_doc[:, 1:] != k_doc[:, :-1]
    first = torch.where(start, idx, 0).cummax(1).values
    return idx - first


def sliding_window_mask(window: int):
    """A FlexAttention-style `mask_mod(b, h, q_idx, kv_idx)` for plain SWA."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def causal_mask(b, h, q_idx, kv_idx):
    """A FlexAttention-style `mask_mod` for full causal attention."""
    return kv_idx <= q_idx
