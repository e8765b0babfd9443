"""Layout: where every token of a forward call sits.

Computed once per forward from the inputs and the cache, then read by every
layer. Slots index the key axis (the cache), positions drive RoPE,
documents stop attention across packed sequences and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.masks import NO_QUERY_DOC, PAD_DOC
from ..ops.tracing import exporting


@dataclass
class Layout:
    base_slot: torch.Tensor  # [1, T] key-axis index of each new token
    base_pos: torch.Tensor  # [B, T] RoPE position
    base_doc: torch.Tensor  # [B, T] document id (PAD_DOC for padding)
    key_doc: torch.Tensor  # [B, S] document id of every key (cache + new)
    out_idx: torch.Tensor  # [B, N] output positions, indices into 0..T-1 (0 where invalid)
    out_valid: torch.Tensor  # [B, N] bool
    out_slot: torch.Tensor  # [B, N]
    out_pos: torch.Tensor  # [B, N]
    out_doc: torch.Tensor  # [B, N] (NO_QUERY_DOC where invalid: sees nothing)
    next_pos: torch.Tensor  # [B] RoPE position of the next token after this call
    last_doc: torch.Tensor  # [B] current document after this call
    # Kernel hints (`ops.attention(dense_start=...)`); they change no result. Set when every
    # row is one document without padding: the slot of each stream's first query (its
    # queries then sit at consecutive slots), or None.
    base_dense: int | None = None
    out_dense: int | None = None
    # Every new token is its own sequence's output row, in order (a serving engine's decode-only
    # step, rows packed as [1, T]): the model may run both streams as one tensor, as it does for
    # [B, 1] decodes.
    pairs: bool = False
    # The base rows are one rank's shard of a context-parallel prompt, the output rows replicated on
    # every rank (`parallel.context`): each stream runs alone (its own GEMMs, never joined), so the
    # replicated rows round alike on every rank and every rank reads (collectively) the same groups.
    shard: bool = False
    # A decode step whose two streams travel as one group of rows (`forward_streams` sets it, once
    # a step): that group's (slots [B, T + N], documents [B, T + N]), so that each layer's attention
    # reads them without concatenating them again.
    joined_rows: tuple | None = None


def pad_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [B, T] -> (idx [B, N], valid [B, N]): each row's True positions, left-aligned."""
    B, T = mask.shape
    n = int(mask.sum(1).max()) if mask.numel() else 0
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :n]
    valid = torch.arange(n, device=mask.device)[None, :] < mask.sum(1, keepdim=True)
    return torch.where(valid, order, torch.zeros_like(order)), valid


def build_layout(
    B: int,
    T: int,
    device: torch.device,
    out_idx: torch.Tensor,
    out_valid: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
) -> Layout:
    """See `Layout`. `attention_mask` is [B, T] or [B, past + T] (1 = real token).

    Packed sequences follow transformers' flattening convention: a position
    id of 0 starts a new document.
    """
    past = 0 if cache is None else cache.get_seq_length()
    valid = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask[:, -T:].bool()
    if past:
        pos0, doc0 = cache.next_pos, cache.last_doc
    else:
        pos0 = torch.zeros(B, dtype=torch.long, device=device)
        doc0 = torch.full((B,), -1, dtype=torch.long, device=device)
    if position_ids is None:
        pos = (pos0[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)
        doc = torch.where(valid, doc0.clamp_min(0)[:, None].expand(B, T), PAD_DOC)
    else:
        pos = position_ids.long().expand(B, T)
        starts = pos == 0
        if not past:
            starts[:, 0] = True
        doc = doc0[:, None] + starts.long().cumsum(1)
        doc = torch.where(valid, doc, PAD_DOC)
    last_real = T - 1 - valid.flip(1).int().argmax(1)  # index of each row's last real token
    next_pos = torch.where(valid.any(1), pos.gather(1, last_real[:, None]).squeeze(1) + 1, pos0)
    real_docs = torch.where(valid, doc, -1)
    last_doc = torch.maximum(doc0, real_docs.amax(1)) if T else doc0
    key_doc = doc if not past else torch.cat([cache.key_doc, doc], dim=1)
    base_slot = (past + torch.arange(T, device=device))[None, :]
    base_dense, out_dense = dense_hints(key_doc, out_idx, out_valid, past)
    return Layout(
        base_slot=base_slot,
        base_pos=pos,
        base_doc=doc,
        key_doc=key_doc,
        out_idx=out_idx,
        out_valid=out_valid,
        out_slot=past + out_idx,
        out_pos=pos.gather(1, out_idx),
        out_doc=torch.where(out_valid, doc.gather(1, out_idx), NO_QUERY_DOC),
        next_pos=next_pos,
        last_doc=last_doc,
        base_dense=base_dense,
        out_dense=out_dense,
    )


def dense_hints(key_doc, out_idx, out_valid, past: int) -> tuple[int | None, int | None]:
    """(base_dense, out_dense) for `Layout`, with one host sync (none under torch.export,
    which cannot trace one: the hints are then left unset, which changes no result)."""
    B, N = out_idx.shape
    if key_doc.numel() == 0 or exporting():
        return None, None
    one_doc = (key_doc == key_doc[:, :1]).all() & (key_doc[:, 0] >= 0).all()
    if N == 0:
        return (past if bool(one_doc) else None), None
    run = out_valid.all() & (out_idx == out_idx[:1, :1] + torch.arange(N, device=out_idx.device)).all()
    flags = torch.stack([one_doc.long(), run.long(), out_idx[0, 0]]).tolist()
    if not flags[0]:
        return None, None
    return past, (past + flags[2] if flags[1] else None)
