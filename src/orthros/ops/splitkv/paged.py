"""Paged attention for single queries: each query reads its own sequence's keys
from a shared block pool through a block table (no gather, no padding).

A serving engine keeps K/V of all requests in one pool of fixed-size blocks,
[num_blocks * block_size, Hkv, D] per layer; request r owns the blocks listed
in row r of `table` [R, max_blocks], so its token at position p lives at pool
slot `table[r, p // block_size] * block_size + p % block_size`. A decode
query (or a prompt's output query) at position `pos[r]` sees its keys
0..pos[r] (the last `window` of them with a window).

    paged_attention        — the op: Triton split-KV kernel on CUDA (one
                             program per (query, KV head, key split), the
                             G query heads of a KV head stacked in one tile,
                             splits merged by log-sum-exp), a gathered
                             reference elsewhere.
    paged_attention_ref    — the same function in plain PyTorch: gathers each
                             query's visible keys into a padded batch and
                             calls `naive_attention`.

Static shapes and no host sync on the kernel path (the split size is a
host-side argument), so a decode step that uses it can be captured in a CUDA
graph. fp8 pools are read as stored; the caller folds the K/V scales into the
queries and the output. With `sinks` S (and a window) a query also sees its
sequence's first S positions (attention sinks, `OrthrosConfig.sink_tokens`).
"""

from __future__ import annotations

import torch

from ..masks import PAD_DOC
from ..naive import naive_attention
from .common import merge_splits_kernel, split_plan, triton_available, use_fp16_dots


def paged_splits(max_len: int, rows: int, kv_heads: int, device, block_n: int = 64) -> int:
    """Keys per split for queries over at most `max_len` keys: enough programs to fill the GPU."""
    return split_plan(max_len, block_n, rows * kv_heads, device)[0]


def paged_attention(q, k_pool, v_pool, table, pos, block_size: int, window: int | None = None,
                    scale: float | None = None, keys_per_split: int | None = None, max_len: int | None = None,
                    out: torch.Tensor | None = None, sinks: int = 0):
    """Single queries over a paged pool.

    Args:
        q: [R, H, D] one query per row.
        k_pool, v_pool: [num_blocks * block_size, Hkv, D] (any float dtype, fp8 included).
        table: [R, max_blocks] int block ids of each row's sequence (entries past its length unused).
        pos: [R] int position of each query (it sees keys 0..pos, or the last `window` and the
            first `sinks`).
        keys_per_split: the kernel's split size (static: fixes the launch grid); default from
            `max_len` (the longest sequence, default table.shape[1] * block_size).
        out: [R, H, D] in q's dtype (a view is fine) to write the result into, instead of a new
            tensor: the kernels store there directly (no copy).
    Returns:
        [R, H, D] in q's dtype (`out` if given).
    """
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, contiguous in its last dim; got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
    if q.shape[0] == 0:
        return q.new_zeros(q.shape) if out is None else out
    if not (q.is_cuda and triton_available()):
        o = paged_attention_ref(q, k_pool, v_pool, table, pos, block_size, window, scale, sinks)
        return o if out is None else out.copy_(o)
    return paged_attention_kernel(q, k_pool, v_pool, table, pos, block_size, window, scale, keys_per_split, max_len,
                                  out, sinks=sinks)


def paged_attention_kernel(q, k_pool, v_pool, table, pos, block_size: int, window: int | None = None,
                           scale: float | None = None, keys_per_split: int | None = None,
                           max_len: int | None = None, out: torch.Tensor | None = None,
                           fp16_dots: bool | None = None, sinks: int = 0):
    """`paged_attention` through the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).
    fp16_dots: see `common.use_fp16_dots`."""
    import triton

    from .kernels import paged_fwd

    R, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    Hkv = k_pool.shape[1]
    G = H // Hkv
    cap = table.shape[1] * block_size
    block_n = 64
    if keys_per_split is None and window is not None and window <= 1024:
        keys_per_split = triton.cdiv(cap, block_n) * block_n  # a window's few keys: one split, no merge
    per = keys_per_split or paged_splits(max_len or cap, R, Hkv, q.device, block_n)
    P = max(1, triton.cdiv(cap, per))
    out = torch.empty(R, H, D, device=q.device, dtype=q.dtype) if out is None else out
    # one split: the kernel stores the result itself, in q's dtype; else fp32 partials to merge
    o = out[:, None] if P == 1 else torch.empty(R, P, H, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(R, P, H, device=q.device, dtype=torch.float32)
    paged_fwd[(R * Hkv, P)](
        q, k_pool, v_pool, table, pos, o, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        Hkv, scale, 0 if window is None else window, per,
        BS=block_size, G=G, D=D, BLOCK_R=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32,
        F16=use_fp16_dots(q, k_pool, fp16_dots), SINKS=sinks if window is not None else 0,
    )
    if P == 1:
        return out
    # the merge's layout is [B, P, M, H, D]: here B = R and M = 1
    merge_splits_kernel(o[:, :, None], lse[:, :, None], q.dtype, out=out[:, None])
    return out


def paged_attention_ref(q, k_pool, v_pool, table, pos, block_size: int, window: int | None = None,
                        scale: float | None = None, sinks: int = 0):
    """`paged_attention` by gathering: each row's visible keys (its sinks below the window, then
    [lo, pos]) into a padded [R, S, Hkv, D] batch (S = the longest span), then the reference op."""
    pos = pos.long()
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp_min(0)
    sinks = sinks if window is not None else 0
    span = int((pos - lo).max()) + 1
    ar = torch.arange(sinks + span, device=q.device)[None, :]
    j = torch.where(ar < sinks, ar, lo[:, None] + ar - sinks)  # [R, S] key positions: sinks, then the window
    valid = (j <= pos[:, None]) & ((ar >= sinks) | (j < lo[:, None]))
    jc = torch.where(valid, j, 0)
    slot = table.long().gather(1, jc // block_size) * block_size + jc % block_size
    k = k_pool[slot].to(q.dtype)  # [R, S, Hkv, D]
    v = v_pool[slot].to(q.dtype)
    k_doc = torch.where(valid, 0, PAD_DOC)
    q_slot = torch.full_like(pos, sinks + span - 1)[:, None]  # every gathered key is visible or padding
    o = naive_attention(q[:, None], k, v, q_slot, torch.zeros_like(q_slot), k_doc, scale=scale)
    return o[:, 0]
