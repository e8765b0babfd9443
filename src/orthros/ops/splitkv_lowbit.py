"""Split-KV attention over a low-bit cache: a few queries, int4 / int2 keys and values
dequantized on the fly (the layout of `ops/lowbit.py`, the parts of `LowBitStaticCache`).

The structure is `ops/splitkv.py`'s: one program per (row, KV head, split),
the G * M queries of a KV head as the rows of one tile, an online softmax
over the split's keys (clipped to what the queries can see), the same
log-sum-exp merge. What changes is where a key tile comes from: each slot j
of a tile is loaded from exactly one of

    j < NS             the bf16 sinks
    NS <= j < bound    the packed storage: byte j, d // P, bits (d % P) * b (b = 4 or 2, P = 8 / b), times the
                       key group's (scale, zero) of channel d / the value's of its group
    bound <= j         the bf16 ring, at j % R

(masked loads: a lane that does not read a part fetches nothing from it), and
the three are merged before the same two dots as the bf16 kernel.

A rotated cache (`ops/lowbit.py`: the packed slots hold K R and V R) splits
each dot in two: scores q . k over the bf16 lanes plus (q R) . (k R) over the
packed ones (q R computed once per call, before the launch), and the packed
lanes' values go to a second accumulator, multiplied by R once at the end of
each program (R is loaded only there: no D x D tile stays live in the loop).

A windowed query's keys lie at or above `bound` (the cache keeps at least W
slots in bf16), so with every row windowed the packed part is never touched.

Kept simple on purpose; what to profile first on the GPU (docs/long_context.md):
the predicated three-way load and the per-element dequantization (folding the key
scales into the query per group and the value scales into p would remove it),
the byte loaded P times (once per channel it holds), the rotation's second pair
of dots, and the split count.
"""

from __future__ import annotations

import functools

import torch

from .splitkv import MAX_ROWS, _num_sms, merge_splits_kernel


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitkv_lowbit_fwd(Q, QR, SK, SV, KQ, VQ, KS, KZ, VS, VZ, RK, RV, SLOT, QDOC, KDOC, BOUND, ROT, O, LSE,
                   sqb, sqm, sqh,
                   sqrb, sqrm, sqrh,  # q R (rotated caches)
                   ssb, sss, ssh,  # sinks (K and V alike)
                   skqb, skqs, skqh,  # packed K
                   svqb, svqs, svqh,  # packed V
                   sksb, ksg, sksh,  # key scale / zero [B, S / KG, Hkv, D]
                   svsb, svss, svsh,  # value scale / zero [B, S, Hkv, D / VG]
                   srb, srs, srh,  # ring
                   s_slot_b, s_qdoc_b, s_kdoc_b,
                   sob, sop, som, soh, slb, slp, slm,
                   M, S, Hkv, NS, R, KG, scale, window, window_rows, keys_per_split,
                   G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, ROTATED: tl.constexpr, IEEE: tl.constexpr):
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
        slot = tl.load(SLOT + b * s_slot_b + m, mask=rvalid, other=-1).to(tl.int64)
        qdoc = tl.load(QDOC + b * s_qdoc_b + m, mask=rvalid, other=-3).to(tl.int64)
        bound = tl.load(BOUND).to(tl.int64)
        start = split.to(tl.int64) * keys_per_split
        end = tl.minimum(start + keys_per_split, S)
        end = tl.minimum(end, tl.max(tl.where(rvalid, slot, -1), axis=0) + 1)
        if HAS_WINDOW:
            if window_rows >= M:  # every row is windowed: skip the keys before the window
                start = tl.maximum(start, tl.min(tl.where(rvalid, slot, S), axis=0) - window + 1)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        if ROTATED:  # q R for the packed lanes' scores, their values' accumulator
            qr = tl.load(QR + b * sqrb + m[:, None] * sqrm + h[:, None] * sqrh + d[None, :],
                         mask=rvalid[:, None] & dmask[None, :], other=0.0)
            acc_q = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        kbyte, vbyte = d // (8 // KBITS), d // (8 // VBITS)
        kshift = ((d % (8 // KBITS)) * KBITS).to(tl.int32)
        vshift = ((d % (8 // VBITS)) * VBITS).to(tl.int32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + n
            jvalid = j < end
            in_sink = jvalid & (j < NS)
            in_ring = jvalid & (j >= bound) & (j >= NS)
            in_q = jvalid & (j >= NS) & (j < bound)
            ms, mr, mq = (in_sink[:, None] & dmask[None, :], in_ring[:, None] & dmask[None, :],
                          in_q[:, None] & dmask[None, :])
            ring_j = j % R
            # keys: sinks | dequantized | ring
            k = tl.load(SK + b * ssb + j[:, None] * sss + kvh * ssh + d[None, :], mask=ms, other=0.0).to(tl.float32)
            kr = tl.load(RK + b * srb + ring_j[:, None] * srs + kvh * srh + d[None, :], mask=mr, other=0.0)
            kb = tl.load(KQ + b * skqb + j[:, None] * skqs + kvh * skqh + kbyte[None, :], mask=mq, other=0)
            grp = j // KG
            ks = tl.load(KS + b * sksb + grp[:, None] * ksg + kvh * sksh + d[None, :], mask=mq, other=0.0)
            kz = tl.load(KZ + b * sksb + grp[:, None] * ksg + kvh * sksh + d[None, :], mask=mq, other=0.0)
            kd = ((kb.to(tl.int32) >> kshift[None, :]) & ((1 << KBITS) - 1)).to(tl.float32) * ks.to(tl.float32) \
                + kz.to(tl.float32)
            if ROTATED:
                k = tl.where(mr, kr.to(tl.float32), k).to(q.dtype)  # zero on the packed lanes
                kd = tl.where(mq, kd, 0.0).to(q.dtype)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") + tl.dot(qr, tl.trans(kd), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k)) + tl.dot(qr, tl.trans(kd))
            else:
                k = tl.where(mr, kr.to(tl.float32), tl.where(mq, kd, k)).to(q.dtype)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
            kdoc = tl.load(KDOC + b * s_kdoc_b + j, mask=jvalid, other=-4).to(tl.int64)
            s = s * scale
            vis = (j[None, :] <= slot[:, None]) & (kdoc[None, :] == qdoc[:, None]) & jvalid[None, :]
            if HAS_WINDOW:
                vis = vis & ((slot[:, None] - j[None, :] < window) | (m[:, None] >= window_rows))
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            # values: sinks | dequantized | ring
            v = tl.load(SV + b * ssb + j[:, None] * sss + kvh * ssh + d[None, :], mask=ms, other=0.0).to(tl.float32)
            vr = tl.load(RV + b * srb + ring_j[:, None] * srs + kvh * srh + d[None, :], mask=mr, other=0.0)
            vb = tl.load(VQ + b * svqb + j[:, None] * svqs + kvh * svqh + vbyte[None, :], mask=mq, other=0)
            vg = d // VG
            vs = tl.load(VS + b * svsb + j[:, None] * svss + kvh * svsh + vg[None, :], mask=mq, other=0.0)
            vz = tl.load(VZ + b * svsb + j[:, None] * svss + kvh * svsh + vg[None, :], mask=mq, other=0.0)
            vd = ((vb.to(tl.int32) >> vshift[None, :]) & ((1 << VBITS) - 1)).to(tl.float32) * vs.to(tl.float32) \
                + vz.to(tl.float32)
            if ROTATED:
                v = tl.where(mr, vr.to(tl.float32), v).to(q.dtype)  # zero on the packed lanes
                vd = tl.where(mq, vd, 0.0).to(q.dtype)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
                    acc_q = acc_q * alpha[:, None] + tl.dot(p, vd.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    acc_q = acc_q * alpha[:, None] + tl.dot(p.to(vd.dtype), vd)
            else:
                v = tl.where(mr, vr.to(tl.float32), tl.where(mq, vd, v)).to(q.dtype)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if ROTATED:  # the packed lanes' values back from the rotated space: (sum p V R) R
            rot = tl.load(ROT + d[:, None] * D + d[None, :], mask=dmask[:, None] & dmask[None, :], other=0.0)
            acc += tl.dot(acc_q, rot, input_precision="ieee")
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(O + b * sob + split * sop + m[:, None] * som + h[:, None] * soh + d[None, :], o,
                 mask=rvalid[:, None] & dmask[None, :])
        tl.store(LSE + b * slb + split * slp + m * slm + h, lse, mask=rvalid)

    return splitkv_lowbit_fwd


def lowbit_splitkv_attention(q, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, q_slot, q_doc, k_doc,
                             bound, length: int, key_bits: int, value_bits: int, key_group: int, window=None, scale=None,
                             window_rows: int | None = None, rotation: torch.Tensor | None = None,
                             num_splits=None, block_n: int = 64, num_warps: int | None = None,
                             num_stages: int | None = None):
    """Queries q [B, M, H, D] (G * M <= MAX_ROWS) over the first `length` slots of a low-bit
    cache layer (`LowBitStaticCache.layer`); q_slot / q_doc [B, M], k_doc [B, >= length],
    bound: [1] int64 tensor (first slot read from the ring); rotation: R [D, D] fp32 of a
    rotated cache (`LowBitStaticCache.rotation`), None for an unrotated one. Same contract
    as `naive_attention` over `ops.lowbit.dense_kv(..., rotated=rotation is not None)`:
    -> [B, M, H, D] in q's dtype."""
    import triton

    B, M, H, D = q.shape
    Hkv = rk.shape[2]
    G = H // Hkv
    if G * M > MAX_ROWS:
        raise ValueError(f"split-KV takes at most {MAX_ROWS} query rows per KV head, got {G} x {M}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    VG = D // v_scale.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    slot = q_slot.expand(B, M)
    S = length
    if num_splits is None:
        want = max(1, 2 * _num_sms(q.device) // max(1, B * Hkv))
        num_splits = max(1, min(want, triton.cdiv(S, 4 * block_n)))
    per = triton.cdiv(triton.cdiv(max(S, 1), num_splits), block_n) * block_n
    P = max(1, triton.cdiv(S, per))
    o = torch.empty(B, P, M, H, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, P, M, H, device=q.device, dtype=torch.float32)
    if sk.shape[1] == 0:  # no sinks: any valid pointer (never read)
        sk, sv = rk, rv
    if rotation is not None and (rotation.shape != (D, D) or rotation.dtype != torch.float32
                                 or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous fp32 [{D}, {D}] matrix, got {tuple(rotation.shape)} "
                         f"{rotation.dtype}")
    qr = q if rotation is None else (q.float() @ rotation).to(q.dtype)  # [B, M, H, D], contiguous
    _kernel()[(B * Hkv, P)](
        q, qr, sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, slot, q_doc, k_doc, bound,
        q if rotation is None else rotation, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        qr.stride(0), qr.stride(1), qr.stride(2),
        sk.stride(0), sk.stride(1), sk.stride(2),
        kq.stride(0), kq.stride(1), kq.stride(2),
        vq.stride(0), vq.stride(1), vq.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        rk.stride(0), rk.stride(1), rk.stride(2),
        slot.stride(0), q_doc.stride(0), k_doc.stride(0),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
        M, S, Hkv, 0 if sk is rk else sk.shape[1], rk.shape[1], key_group, scale,
        0 if window is None else window, M if window_rows is None else window_rows, per,
        G=G, D=D, KBITS=key_bits, VBITS=value_bits, VG=VG, BLOCK_R=max(16, triton.next_power_of_2(G * M)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_WINDOW=window is not None, ROTATED=rotation is not None,
        IEEE=q.dtype == torch.float32,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None},
    )
    return merge_splits_kernel(o, lse, q.dtype)
