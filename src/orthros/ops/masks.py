"""Who sees whom: the one definition of the attention masks.

Every op (naive, FlexAttention, Triton) uses `visible`, written with plain
tensor arithmetic so it broadcasts over whole index grids (naive op) and
also works on the scalar index tensors of a FlexAttention `mask_mod`.

Indices:
    slot  — a token's index on the key axis (its place in the KV cache).
    doc   — a document id; keys are visible only inside the query's document.
            Padding carries doc -1, so it is never visible from real tokens;
            an invalid (padded) output query carries doc -2 and sees nothing.
"""

from __future__ import annotations

PAD_DOC = -1
NO_QUERY_DOC = -2


def visible(q_slot, k_slot, q_doc, k_doc, window: int | None):
    """Causal (k_slot <= q_slot), same document, and inside `window` if given.

    `window` counts the current token: with window W, key j is visible from
    slot t iff t - W < j <= t (flash-attn's `window_size=(W-1, 0)`).
    """
    m = (k_slot <= q_slot) & (k_doc == q_doc)
    if window is not None:
        m = m & (q_slot - k_slot < window)
    return m


def sliding_window_mask(window: int):
    """A FlexAttention-style `mask_mod(b, h, q_idx, kv_idx)` for plain SWA."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def causal_mask(b, h, q_idx, kv_idx):
    """A FlexAttention-style `mask_mod` for full causal attention."""
    return kv_idx <= q_idx
