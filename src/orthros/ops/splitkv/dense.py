"""Split-KV (flash-decoding) attention of a few queries over dense K/V [B, S, Hkv, D] (16-bit or fp8).

Prefill's single output query and every decoding step read the whole KV
cache with a handful of queries: one program per (row, KV head) would leave
most of the GPU idle. The key axis is cut into P splits, one program per
(row, KV head, split) computes a partial softmax over its keys for all the
queries of that head group (the G query heads of a KV head and the M
queries stacked as G*M rows of one tile), and a log-sum-exp merge combines
the P partial results:

    lse = logsumexp_p lse_p,    o = sum_p exp(lse_p - lse) * o_p

Each program also clips its keys to the queries' visible range (their
slots, and slot - window + 1 with a window), so a windowed query over a 1M
cache only touches W keys. Offsets are 64-bit: a 1M x 8 x 128 cache has
2^30 elements and rows of a batch lie beyond 2^31.

Forward only (inference). Triton is imported on first use.
"""

from __future__ import annotations

import torch

from .common import MAX_ROWS, launch_options, merge_splits_kernel, split_plan, use_fp16_dots


def splitkv_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, num_splits=None,
                      block_n: int | None = None, return_lse: bool = False, window_rows: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, maxnreg: int | None = None,
                      fp16_dots: bool | None = None, sinks: int = 0):
    """Same contract as `naive_attention`, for G * M <= MAX_ROWS (no autograd).
    window_rows: only the first `window_rows` queries use `window` (see `ops.attention`).
    sinks: windowed queries also see their document's first `sinks` keys (`masks.visible`).
    num_splits / block_n / num_warps / num_stages / maxnreg (registers a thread, NVIDIA): launch
    tuning (defaults: heuristics / Triton's). fp16_dots: see `use_fp16_dots`."""
    import triton

    from .kernels import splitkv_fwd

    B, M, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    if G * M > MAX_ROWS:
        raise ValueError(f"split-KV takes at most {MAX_ROWS} query rows per KV head, got {G} x {M}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    scale = D ** -0.5 if scale is None else scale
    slot = q_slot.expand(B, M)
    sinks = sinks if window is not None else 0
    first = slot
    if sinks:  # each query's document starts at its first key (documents are runs of keys)
        keys = torch.arange(S, device=q.device)
        first = torch.where(k_doc[:, None, :] == q_doc[:, :, None], keys, S).amin(-1)  # [B, M]
    if block_n is None:
        # 1-byte keys: 128-key tiles (16 KB of K per iteration) stream better than 64 (H200, a 1M
        # fp8 cache, benchmarks/splitkv_sweep.py: 0.96 vs 1.24 ms per layer); 2-byte keys keep 64
        block_n = 128 if k.element_size() == 1 and D <= 128 else 64
    per, P = split_plan(S, block_n, B * Hkv, q.device, num_splits)
    o = torch.empty(B, P, M, H, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, P, M, H, device=q.device, dtype=torch.float32)
    ieee = q.dtype == torch.float32
    splitkv_fwd[(B * Hkv, P)](
        q, k, v, slot, q_doc, k_doc, first, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        slot.stride(0), q_doc.stride(0), k_doc.stride(0), first.stride(0),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        M, S, Hkv, scale, 0 if window is None else window, M if window_rows is None else window_rows, per,
        G=G, D=D, BLOCK_R=max(16, triton.next_power_of_2(G * M)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None, IEEE=ieee,
        F16=use_fp16_dots(q, k, fp16_dots), SINKS=sinks,
        **launch_options(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg),
    )
    out, lse_out = merge_splits_kernel(o, lse, q.dtype, return_lse=True)
    return (out, lse_out) if return_lse else out
