"""Which keys can a query see, at the level of ranges and tiles.

Fast paths never build a [M, S] mask. They need two coarser facts:

    key_bounds   — per query, a key range [lo, hi] that holds every key it
                   sees (lo > hi: it sees none). O(S log S) from the doc ids.
    block_states — per (query tile, key tile): 0 = nothing visible,
                   1 = partly visible (apply the mask), 2 = fully visible.
                   Built from per-tile summaries of the bounds and doc ids,
                   so it costs O(M/BQ · S/BK), never O(M · S).

Both are exact supersets: a key outside [lo, hi] is never visible, a tile
marked 0 holds no visible key, and a tile marked 2 holds only visible keys.
"""

from __future__ import annotations

import torch

# Doc ids used to pad query / key rows up to whole tiles: they match nothing.
PAD_Q_DOC = -3
PAD_K_DOC = -4


def key_bounds(q_slot, q_doc, k_doc, window: int | None):
    """Per query, the key range [lo, hi] (long [B, M]) that holds every visible key.

    hi is the query's slot (keys after it are invisible); lo is the first key
    of its document, raised to slot - window + 1 with a window. A query whose
    document owns no key gets lo = S > hi.
    """
    B, M = q_doc.shape
    S = k_doc.shape[1]
    dev = k_doc.device
    slot = q_slot.long().expand(B, M)
    qd, kd = q_doc.long(), k_doc.long()
    if S == 0:
        return torch.zeros_like(slot), torch.full_like(slot, -1)
    # Sort keys by (doc, slot); the first entry of a doc is its first key.
    enc = kd * (S + 1) + torch.arange(S, device=dev)
    enc = enc.sort(dim=1).values
    pos = torch.searchsorted(enc, (qd * (S + 1)).contiguous())
    first = enc.gather(1, pos.clamp_max(S - 1))
    has = (pos < S) & (torch.div(first, S + 1, rounding_mode="floor") == qd)
    lo = torch.where(has, first - qd * (S + 1), S)
    if window is not None:
        lo = torch.maximum(lo, slot - window + 1)
    hi = slot.clamp(max=S - 1)
    lo = torch.where(has, lo, S)
    return lo, hi


def dense_bounds(start: int, M: int, window: int | None, device):
    """`key_bounds` for a plain causal batch: query i sits at slot start + i, one document."""
    slot = start + torch.arange(M, device=device)[None]
    lo = torch.zeros_like(slot) if window is None else (slot - window + 1).clamp_min(0)
    return lo, slot


def _tiles(x: torch.Tensor, size: int, fill) -> torch.Tensor:
    """[B, N] -> [B, ceil(N / size), size], padded with `fill`."""
    B, N = x.shape
    n = -(-N // size) * size
    if n != N:
        x = torch.cat([x, x.new_full((B, n - N), fill)], dim=1)
    return x.view(B, n // size, size)


def block_states(lo, hi, S: int, BQ: int, BK: int, q_doc=None, k_doc=None):
    """Tile states int8 [B, ceil(M/BQ), ceil(S/BK)]: 0 none, 1 partial, 2 full.

    lo, hi: [B, M] from `key_bounds`; q_doc [B, M], k_doc [B, S] (None: one
    document everywhere). A tile is full only if every query in it sees every
    key in it: all bounds cover the tile, and queries and keys share one doc.
    """
    B, M = lo.shape
    big = torch.iinfo(torch.long).max // 4
    lo_t, hi_t = _tiles(lo, BQ, big), _tiles(hi, BQ, -1)
    lo_min, lo_max = lo_t.amin(-1), lo_t.amax(-1)  # [B, Qb]
    hi_min, hi_max = hi_t.amin(-1), hi_t.amax(-1)
    nk = -(-S // BK)
    k0 = torch.arange(nk, device=lo.device) * BK  # first key of each tile
    k1 = (k0 + BK).clamp(max=S) - 1  # last key
    some = (k1[None, None] >= lo_min[..., None]) & (k0[None, None] <= hi_max[..., None])
    full = (k0[None, None] >= lo_max[..., None]) & (k1[None, None] <= hi_min[..., None])
    full &= (k0 + BK <= S)[None, None]
    if q_doc is not None:
        qd = _tiles(q_doc.long().expand(B, M), BQ, PAD_Q_DOC)
        kd = _tiles(k_doc.long(), BK, PAD_K_DOC)
        q_one = (qd.amin(-1) == qd.amax(-1))  # [B, Qb]
        k_one = (kd.amin(-1) == kd.amax(-1))  # [B, Kb]
        same = q_one[..., None] & k_one[:, None] & (qd[..., 0][..., None] == kd[..., 0][:, None])
        full &= same
    full &= some
    return some.to(torch.int8) + full.to(torch.int8)
