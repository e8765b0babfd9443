"""Split-KV (flash-decoding) attention for a few queries over a long cache.

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

import functools
import os

import torch

MAX_ROWS = 64  # G * M queries per program tile


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitkv_fwd(Q, K, V, SLOT, QDOC, KDOC, O, LSE,
                    sqb, sqm, sqh, skb, sks, skh, svb, svs, svh,
                    s_slot_b, s_qdoc_b, s_kdoc_b,
                    sob, sop, som, soh, slb, slp, slm,
                    M, S, Hkv, scale, window, window_rows, keys_per_split,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid // Hkv).to(tl.int64)
        kvh = pid % Hkv
        r = tl.arange(0, BLOCK_R)
        m = r // G
        h = kvh * G + r % G
        rvalid = m < M
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(Q + b * sqb + m[:, None] * sqm + h[:, None] * sqh + d[None, :],
                    mask=rvalid[:, None] & dmask[None, :], other=0.0)
        if F16:  # fp8 K/V: dots in fp16 (e4m3 -> fp16 is one conversion for two values, -> bf16 three)
            qf = q.to(tl.float32)
            big = tl.max(tl.max(tl.abs(qf), 1), 0)
            qs = tl.where(big > 16384.0, tl.exp2(14.0 - tl.ceil(tl.log2(big))), 1.0)  # a power of two: exact
            q = (qf * qs).to(tl.float16)
            scale = scale / qs
        slot = tl.load(SLOT + b * s_slot_b + m, mask=rvalid, other=-1).to(tl.int64)
        qdoc = tl.load(QDOC + b * s_qdoc_b + m, mask=rvalid, other=-3).to(tl.int64)
        # This split's keys, clipped to what the queries can see.
        start = split.to(tl.int64) * keys_per_split
        end = tl.minimum(start + keys_per_split, S)
        end = tl.minimum(end, tl.max(tl.where(rvalid, slot, -1), axis=0) + 1)
        if HAS_WINDOW:
            if window_rows >= M:  # every row is windowed: skip the keys before the window
                start = tl.maximum(start, tl.min(tl.where(rvalid, slot, S), axis=0) - window + 1)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + n
            jvalid = j < end
            kv_mask = jvalid[:, None] & dmask[None, :]
            k = tl.load(K + b * skb + j[:, None] * sks + kvh * skh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            kdoc = tl.load(KDOC + b * s_kdoc_b + j, mask=jvalid, other=-4).to(tl.int64)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            vis = (j[None, :] <= slot[:, None]) & (kdoc[None, :] == qdoc[:, None]) & jvalid[None, :]
            if HAS_WINDOW:
                vis = vis & ((slot[:, None] - j[None, :] < window) | (m[:, None] >= window_rows))  # rows past window_rows: no window
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + j[:, None] * svs + kvh * svh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(O + b * sob + split * sop + m[:, None] * som + h[:, None] * soh + d[None, :], o,
                 mask=rvalid[:, None] & dmask[None, :])
        tl.store(LSE + b * slb + split * slp + m * slm + h, lse, mask=rvalid)

    return splitkv_fwd


@functools.cache
def _merge_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitkv_merge(O, LSE, OUT, LSE_OUT, P, M, H,
                      sob, sop, som, soh, slb, slp, slm, s_out_b, s_out_m, s_out_h, s_lo_b, s_lo_m,
                      D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)  # one (row, query, head)
        h = pid % H
        m = (pid // H) % M
        b = (pid // (H * M)).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        top = tl.full([], float("-inf"), tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            lse = tl.load(LSE + b * slb + p * slp + m * slm + h, mask=p < P, other=float("-inf"))
            top = tl.maximum(top, tl.max(lse, 0))
        top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: the weights below are 0
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            pmask = p < P
            w = tl.exp(tl.load(LSE + b * slb + p * slp + m * slm + h, mask=pmask, other=float("-inf")) - top)
            o = tl.load(O + b * sob + p[:, None] * sop + m * som + h * soh + d[None, :],
                        mask=pmask[:, None] & dmask[None, :], other=0.0)
            total += tl.sum(w, 0)
            acc += tl.sum(w[:, None] * o, 0)
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(OUT + b * s_out_b + m * s_out_m + h * s_out_h + d, out.to(OUT.dtype.element_ty), mask=dmask)
        tl.store(LSE_OUT + b * s_lo_b + m * s_lo_m + h, tl.log(total) + top)

    return splitkv_merge


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def use_fp16_dots(q: torch.Tensor, k: torch.Tensor, want: bool | None = None) -> bool:
    """Whether a kernel over fp8 K/V runs its dots in fp16 (None: wherever it can, i.e. 16-bit
    queries over fp8 keys). Hopper converts e4m3 to fp16 two values per instruction, but to bf16
    only through fp16, one more instruction per value: in a kernel that streams a 1M fp8 cache,
    those conversions are most of its instructions. fp16 holds every e4m3 value exactly and bf16
    queries to 3 more mantissa bits; queries above 2^14 are scaled by a power of two first.
    ORTHROS_FP8_DOTS=bf16 in the environment makes None mean bf16 dots (for A/B runs)."""
    can = k.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)
    if want and not can:
        raise ValueError(f"fp16 dots are for 16-bit queries over fp8 keys, got {q.dtype} over {k.dtype}")
    if want is None:
        return can and os.environ.get("ORTHROS_FP8_DOTS", "fp16") != "bf16"
    return bool(want)


def launch_options(**options) -> dict:
    """The Triton launch options given (num_warps, num_stages, maxnreg, ...): None means Triton's default."""
    return {k: v for k, v in options.items() if v is not None}


def splitkv_attention(q, k, v, q_slot, q_doc, k_doc, window=None, scale=None, num_splits=None,
                      block_n: int | None = None, return_lse: bool = False, window_rows: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, maxnreg: int | None = None,
                      fp16_dots: bool | None = None):
    """Same contract as `naive_attention`, for G * M <= MAX_ROWS (no autograd).
    window_rows: only the first `window_rows` queries use `window` (see `ops.attention`).
    num_splits / block_n / num_warps / num_stages / maxnreg (registers a thread, NVIDIA): launch
    tuning (defaults: heuristics / Triton's). fp16_dots: see `use_fp16_dots`."""
    import triton

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
    if block_n is None:
        # 1-byte keys: 128-key tiles (16 KB of K per iteration) stream better than 64 (H200, a 1M
        # fp8 cache, benchmarks/splitkv_sweep.py: 0.96 vs 1.24 ms per layer); 2-byte keys keep 64
        block_n = 128 if k.element_size() == 1 and D <= 128 else 64
    if num_splits is None:
        want = max(1, 2 * _num_sms(q.device) // max(1, B * Hkv))
        num_splits = max(1, min(want, triton.cdiv(S, 4 * block_n)))
    per = triton.cdiv(triton.cdiv(max(S, 1), num_splits), block_n) * block_n
    P = max(1, triton.cdiv(S, per))
    o = torch.empty(B, P, M, H, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, P, M, H, device=q.device, dtype=torch.float32)
    ieee = q.dtype == torch.float32
    _kernel()[(B * Hkv, P)](
        q, k, v, slot, q_doc, k_doc, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        slot.stride(0), q_doc.stride(0), k_doc.stride(0),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        M, S, Hkv, scale, 0 if window is None else window, M if window_rows is None else window_rows, per,
        G=G, D=D, BLOCK_R=max(16, triton.next_power_of_2(G * M)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None, IEEE=ieee,
        F16=use_fp16_dots(q, k, fp16_dots),
        **launch_options(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg),
    )
    out, lse_out = merge_splits_kernel(o, lse, q.dtype, return_lse=True)
    return (out, lse_out) if return_lse else out


def merge_splits_kernel(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, return_lse: bool = False):
    """Partial results o [B, P, M, H, D], lse [B, P, M, H] (fp32) of P splits -> [B, M, H, D] in
    `dtype` (and the merged lse [B, M, H]): one merge kernel (the PyTorch `merge_splits` is a
    dozen launches per call), none for P = 1."""
    import triton

    B, P, M, H, D = o.shape
    if P == 1:
        out, lse_out = o[:, 0].to(dtype), lse[:, 0]
    else:
        out = torch.empty(B, M, H, D, device=o.device, dtype=dtype)
        lse_out = torch.empty(B, M, H, device=o.device, dtype=torch.float32)
        _merge_kernel()[(B * M * H,)](
            o, lse, out, lse_out, P, M, H,
            o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
            out.stride(0), out.stride(1), out.stride(2), lse_out.stride(0), lse_out.stride(1),
            D=D, BLOCK_P=min(64, triton.next_power_of_2(P)), BLOCK_D=max(16, triton.next_power_of_2(D)),
        )
    return (out, lse_out) if return_lse else out
