"""FlexAttention for many queries, forward and backward.

The mask is `masks.visible` written as a FlexAttention `mask_mod` over the
query's slot and document and the key's document (captured index tensors).
The block mask is never derived from a T x T evaluation: `block_states`
classifies 128 x 128 tiles from per-tile summaries of the key ranges, and
`BlockMask.from_kv_blocks` takes the result directly. For a plain causal
batch (`dense_start` given) the mask needs no index tensors at all.

FlexAttention's generated kernels index with 32-bit integers, so a tensor
of 2^31 elements or more (a 1M-token, 32-head query) breaks them: queries
are cut into chunks that stay under the limit, and each chunk gets only the
keys it can see.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .blocks import PAD_K_DOC, PAD_Q_DOC, block_states, dense_bounds, key_bounds
from .kv import DenseKV
from .masks import doc_rank, visible

BQ = BK = 128  # FlexAttention's tile sizes
INT32_LIMIT = 2**31 - 1


@functools.cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention is the eager reference (it builds the dense
    # score matrix); only the compiled one runs the block-sparse kernel.
    if not compiled:
        return flex_attention
    # One compiled kernel per shape: past dynamo's default of 8 variants a call would
    # silently run the eager reference, which needs T x T memory (2 TB at 128K).
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    return torch.compile(flex_attention, dynamic=False)


def _ordered(sel: torch.Tensor):
    """bool [B, Qb, Kb] -> (count int32 [B, 1, Qb], column order int32 [B, 1, Qb, Kb])."""
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


def make_block_mask(states: torch.Tensor, mask_mod, M: int, S: int, need_backward: bool = True):
    """A FlexAttention BlockMask from tile states [B, Qb, Kb] (see `block_states`)."""
    from torch.nn.attention.flex_attention import BlockMask

    pn, pi = _ordered(states == 1)
    fn, fi = _ordered(states == 2)
    return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=(BQ, BK), mask_mod=mask_mod,
                                    seq_lengths=(M, S), compute_q_blocks=need_backward)


def _pad_to(x: torch.Tensor, n: int, value) -> torch.Tensor:
    return x if x.shape[1] == n else F.pad(x, (0, n - x.shape[1]), value=value)


_DENSE_MASKS: dict = {}


def _with_sinks(states: torch.Tensor, sink_keys: torch.Tensor) -> torch.Tensor:
    """Tile states [B, Qb, Kb] with every key tile that holds a sink key (bool [B, S]) at least
    partial: the mask then decides, per query, which of them it sees."""
    B, Kb = states.shape[0], states.shape[2]
    n = Kb * BK
    keys = F.pad(sink_keys, (0, n - sink_keys.shape[1])) if n > sink_keys.shape[1] else sink_keys[:, :n]
    tiles = keys.reshape(sink_keys.shape[0], Kb, BK).any(-1).to(states.dtype)[:, None]  # [B, 1, Kb]
    return torch.maximum(states, tiles)


def tile_states(slot, qdoc, k_doc, window, sinks: int = 0):
    """(tile states [B, Qb, Kb], rows that see no key [B, M], each key's rank in its document or None)
    of queries at slots `slot` / documents `qdoc` [B, M] over keys of documents k_doc [B, S].

    Rows that can see no key (invalid output queries, tile padding) are pointed at key 0 (and
    zeroed afterwards): no softmax over an empty row, in either pass."""
    lo, hi = key_bounds(slot, qdoc, k_doc, window)
    none = lo > hi
    lo, hi = torch.where(none, 0, lo), torch.where(none, 0, hi)
    states = block_states(lo, hi, k_doc.shape[1], BQ, BK, qdoc, k_doc)
    rank = None
    if sinks:
        rank = doc_rank(k_doc)
        states = _with_sinks(states, (rank < sinks) & (k_doc >= 0))
    return states, none, rank


def _dense_block_mask(start: int, M: int, S: int, window, device, need_backward: bool, sinks: int = 0):
    """The block mask of a plain causal batch. Every layer of a forward asks for the
    same one, so the last few are kept (building one costs ~40 small launches)."""
    key = (start, M, S, window, str(device), need_backward, sinks)
    if key not in _DENSE_MASKS:
        lo, hi = dense_bounds(start, M, window, device)
        states = block_states(lo, hi, S, BQ, BK)  # [1, Qb, Kb]: broadcast over the batch
        if sinks and window is not None:  # one document from slot 0: its first keys are slots 0..sinks-1
            states = _with_sinks(states, (torch.arange(S, device=device) < sinks)[None])
        q_off = torch.full((), start, dtype=torch.long, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            qs = q_idx + q_off
            m = kv_idx <= qs
            if window is not None:
                near = qs - kv_idx < window
                if sinks:
                    near = near | (kv_idx < sinks)
                m = m & near
            return m

        if len(_DENSE_MASKS) >= 8:
            _DENSE_MASKS.pop(next(iter(_DENSE_MASKS)))
        _DENSE_MASKS[key] = make_block_mask(states, mask_mod, M, S, need_backward)
    return _DENSE_MASKS[key]


def _one_call(q, k, v, q_slot, q_doc, k_doc, window, scale, dense_start, sinks: int = 0):
    """One FlexAttention call, all tensors already under the int32 limit."""
    B, M, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    need_backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # Queries are padded to whole tiles: torch 2.11's kernels fail to compile for a partial
    # query tile (NoValidChoicesError), and output-stream calls (SFT) would otherwise
    # compile once per query count. Padded rows are sliced off the output.
    nq = -(-M // BQ) * BQ
    if nq != M:
        q = F.pad(q, (0, 0, 0, 0, 0, nq - M))
    if dense_start is not None:
        block_mask = _dense_block_mask(dense_start, nq, S, window, q.device, need_backward, sinks)
    else:
        slot = _pad_to(q_slot.long().expand(B, M), nq, 0).contiguous()
        qdoc = _pad_to(q_doc.long(), nq, PAD_Q_DOC).contiguous()
        states, none, rank = tile_states(slot, qdoc, k_doc, window, sinks)
        nk = states.shape[2] * BK
        kdoc = _pad_to(k_doc.long(), nk, PAD_K_DOC).contiguous()  # the kernel's tail reads stay in bounds
        krank = _pad_to(rank, nk, 0).contiguous() if sinks else None

        def mask_mod(b, h, q_idx, kv_idx):
            seen = visible(slot[b, q_idx], kv_idx, qdoc[b, q_idx], kdoc[b, kv_idx], window,
                           sinks, krank[b, kv_idx] if sinks else None)
            return seen | (none[b, q_idx] & (kv_idx == 0))

        block_mask = make_block_mask(states, mask_mod, nq, S, need_backward)
    Dp = max(16, 1 << (D - 1).bit_length())  # the kernels want a power-of-two head dim
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if Dp != D:  # zero columns change no score and add zero output columns
        qt, kt, vt = (F.pad(x, (0, Dp - D)) for x in (qt, kt, vt))
    o = _flex(q.is_cuda)(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=H != Hkv)
    o = o[:, :, :M, :D].transpose(1, 2)
    if dense_start is None:
        o = torch.where(none[:, :M, None, None], 0.0, o)  # zero upstream gradient for those rows too
    return o


def flex_attention_op(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, dense_start=None,
                      limit: int = INT32_LIMIT, sinks: int = 0):
    """Same contract as `naive_attention`. `dense_start`: the caller guarantees
    q_slot[:, i] == dense_start + i and one document per row, no padding.
    `sinks`: windowed queries also see their document's first `sinks` keys."""
    sinks = sinks if window is not None else 0
    B, M, H, D = q.shape
    S = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    if M == 0 or S == 0:
        return q.new_zeros(B, M, H, D)
    Dp = max(16, 1 << (D - 1).bit_length())
    chunk = M
    if max(B * M * H * Dp, B * S * k.shape[2] * Dp) > limit:
        chunk = max(BQ, (limit // (B * H * Dp)) // BQ * BQ)
    if dense_start is not None:
        # Keys are visible only in [dense_start - window + 1, dense_start + M), and the first `sinks`: slice
        # them (a chunk past the sinks reads the sinks, then its window: as many keys for every later chunk)
        outs = []
        for s in range(0, M, chunk):
            e = min(M, s + chunk)
            w = DenseKV.seen(k, v, dense_start + s, e - s, window, sinks)  # the sinks below a window first
            ks, vs = w.k, w.v
            if not w.head and k.stride(1) < k.stride(2):
                # heads-major storage ([B, H, S, D], a growing cache as transformers' DynamicCache keeps it):
                # the window's strides change with S, and the compiled kernel, specialised to strides as to
                # shapes, would be built again for every chunk of a chunked prefill (1.6-2 s each on an
                # H100). Copied into the kernel's own layout: a no-op where the slice is the whole cache.
                ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (ks, vs))
            if ks.numel() // D * Dp > limit:
                raise ValueError(f"{ks.shape[1]} keys x {k.shape[2]} heads exceed FlexAttention's 32-bit indexing; "
                                 "use the split-KV op or a shorter call")
            outs.append(_one_call(q[:, s:e], ks, vs, None, None, None, window, scale, w.local(dense_start + s), sinks))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if chunk == M:
        return _one_call(q, k, v, q_slot, q_doc, k_doc, window, scale, None, sinks)
    lo, hi = key_bounds(q_slot, q_doc, k_doc, None if sinks else window)  # sinks: from each document's start
    outs = []
    slot = q_slot.expand(B, M)
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        a, b = int(lo[:, s:e].min().clamp(0, S)), int(hi[:, s:e].max()) + 1
        b = max(a, b)
        if (b - a) * B * k.shape[2] * Dp > limit:
            raise ValueError(f"{b - a} keys x {k.shape[2]} heads exceed FlexAttention's 32-bit indexing; "
                             "use the split-KV op or a shorter call")
        if b == a:
            outs.append(q.new_zeros(B, e - s, H, D))
            continue
        outs.append(_one_call(q[:, s:e], k[:, a:b], v[:, a:b], slot[:, s:e] - a, q_doc[:, s:e], k_doc[:, a:b],
                              window, scale, None, sinks))
    return torch.cat(outs, 1)
