"""The Triton kernel of `ops/splitkv/lowbit_paged.py` (described there); imports triton, imported on
first use."""

import triton
import triton.language as tl

from .kernels import _head_group
from .lowbit_kernel import _dot, _softmax_step, _unpack


@triton.jit
def _bf16_tile(qd, TK, TV, ts, stks, stkh, stvs, stvh, kvh, d, jv, dmask, m_i, l_i, acc, acc_p,
               DT: tl.constexpr, IEEE: tl.constexpr):
    """One tile of bf16 keys at twin slots ts [N] folded into the bf16 part."""
    kvm = jv[:, None] & dmask[None, :]
    k = tl.load(TK + ts[:, None] * stks + kvh * stkh + d[None, :], mask=kvm, other=0.0).to(DT)
    v = tl.load(TV + ts[:, None] * stvs + kvh * stvh + d[None, :], mask=kvm, other=0.0).to(DT)
    p, alpha, m_i, l_i = _softmax_step(_dot(qd, tl.trans(k), IEEE), jv[None, :], m_i, l_i)
    acc = acc * alpha[:, None] + _dot(p.to(DT), v, IEEE)
    return m_i, l_i, acc, acc_p * alpha[:, None]


@triton.jit
def _channels(ROW, d, mask, BITS: tl.constexpr):
    """Levels [N, D] of packed rows at ROW [N, 1] read a channel at a time: channel d's byte (d // P),
    shifted to its bit plane (the `CHANNELS` study; `_unpack` is the interleaving read)."""
    P: tl.constexpr = 8 // BITS
    b = tl.load(ROW + (d // P)[None, :], mask=mask, other=0)
    return ((b >> ((d % P) * BITS).to(tl.uint8)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit(do_not_specialize=["s_table", "s_twins", "sor", "slr"])
def paged_lowbit_fwd(Q, QR, TK, TV, KQ, VQ, KS, KZ, VS, VZ, TABLE, TWINS, POS, O, LSE,
                     sqr, sqh, sqrr, sqrh, stks, stkh, stvs, stvh,
                     skqs, skqh, svqs, svqh,
                     skss, sksh,  # key scale / zero [N * BS / KG, Hkv, D]
                     svss, svsh,  # value scale / zero [N * BS, Hkv, D / VG]
                     s_table, s_twins, sor, sop, soh, sox, slr, slp,
                     Hkv, NS, recent, KG, qscale, keys_per_split,
                     BS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                     VG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_D: tl.constexpr, IEEE: tl.constexpr, CHANNELS: tl.constexpr):
    DT: tl.constexpr = tl.float32 if IEEE else Q.dtype.element_ty
    PK: tl.constexpr = 8 // KBITS
    PV: tl.constexpr = 8 // VBITS
    split = tl.program_id(1)
    r, kvh, gvalid, h, d, dmask = _head_group(Hkv, G, BLOCK_R, BLOCK_D, D)
    qmask = gvalid[:, None] & dmask[None, :]
    q = tl.load(Q + r * sqr + h[:, None] * sqh + d[None, :], mask=qmask, other=0.0)
    qd = (q.to(tl.float32) * qscale).to(DT)  # softmax scale and log2(e) folded in
    qr = tl.load(QR + r * sqrr + h[:, None] * sqrh + d[None, :], mask=qmask, other=0.0)  # q R (or q)
    qp = (qr.to(tl.float32) * qscale).to(DT)
    pos = tl.load(POS + r).to(tl.int32)
    bound = tl.maximum(pos + 1 - recent, 0) // KG * KG
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, pos + 1)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)  # the bf16 slots' values
    acc_p = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)  # the packed slots' values (V R space if rotated)
    TB = TABLE + r * s_table
    TT = TWINS + r * s_twins
    n = tl.arange(0, BLOCK_N)

    # sinks [0, NS): block 0's twin
    t0 = tl.load(TT).to(tl.int64)
    se = tl.minimum(end, NS)
    for j0 in range(start, se, BLOCK_N):
        j = j0 + n
        m_i, l_i, acc, acc_p = _bf16_tile(qd, TK, TV, t0 * BS + j, stks, stkh, stvs, stvh, kvh, d, j < se, dmask,
                                          m_i, l_i, acc, acc_p, DT, IEEE)

    # packed [NS, bound): tiles of BLOCK_Q slots (a divisor of KG, itself of BS): one block, one key group
    lo = tl.maximum(start, NS)
    hi = tl.minimum(end, bound)
    nq = tl.arange(0, BLOCK_Q)
    ck = tl.arange(0, BLOCK_D // PK)
    cv = tl.arange(0, BLOCK_D // PV)
    for j0 in range(lo // BLOCK_Q * BLOCK_Q, hi, BLOCK_Q):
        j = j0 + nq
        jv = (j >= lo) & (j < hi)
        s0 = tl.load(TB + j0 // BS).to(tl.int64) * BS + j0 % BS  # the tile's first pool slot
        slot = s0 + nq
        grp = s0 // KG
        ks = tl.load(KS + grp * skss + kvh * sksh + d, mask=dmask, other=0.0).to(tl.float32)
        kz = tl.load(KZ + grp * skss + kvh * sksh + d, mask=dmask, other=0.0).to(tl.float32)
        if CHANNELS:  # each channel's byte loaded for it and shifted to its bit plane (a study: `launch`)
            k = _channels(KQ + slot[:, None] * skqs + kvh * skqh, d, jv[:, None] & dmask[None, :], KBITS)
        else:
            kb = tl.load(KQ + slot[:, None] * skqs + kvh * skqh + ck[None, :],
                         mask=jv[:, None] & (ck < D // PK)[None, :], other=0)
            k = _unpack(kb, KBITS, tl.float32)
        k = k * ks[None, :] + kz[None, :]
        p, alpha, m_i, l_i = _softmax_step(_dot(qp, tl.trans(k.to(DT)), IEEE), jv[None, :], m_i, l_i)
        vsz = slot[:, None] * svss + kvh * svsh + (d // VG)[None, :]
        vm = jv[:, None] & dmask[None, :]
        vs = tl.load(VS + vsz, mask=vm, other=0.0).to(tl.float32)
        vz = tl.load(VZ + vsz, mask=vm, other=0.0).to(tl.float32)
        if CHANNELS:
            v = _channels(VQ + slot[:, None] * svqs + kvh * svqh, d, vm, VBITS)
        else:
            vb = tl.load(VQ + slot[:, None] * svqs + kvh * svqh + cv[None, :],
                         mask=jv[:, None] & (cv < D // PV)[None, :], other=0)
            v = _unpack(vb, VBITS, tl.float32)
        v = v * vs + vz
        acc = acc * alpha[:, None]
        acc_p = acc_p * alpha[:, None] + _dot(p.to(DT), v.to(DT), IEEE)

    # bf16 [max(bound, NS), pos]: the twins
    for j0 in range(tl.maximum(start, tl.maximum(bound, NS)), end, BLOCK_N):
        j = j0 + n
        jv = j < end
        tb = tl.load(TT + j // BS, mask=jv, other=0).to(tl.int64)
        m_i, l_i, acc, acc_p = _bf16_tile(qd, TK, TV, tb * BS + j % BS, stks, stkh, stvs, stvh, kvh, d, jv, dmask,
                                          m_i, l_i, acc, acc_p, DT, IEEE)

    seen = l_i > 0
    linv = 1.0 / tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    ob = O + r * sor + split * sop + h[:, None] * soh + d[None, :]
    tl.store(ob, acc * linv[:, None], mask=qmask)
    tl.store(ob + sox, acc_p * linv[:, None], mask=qmask)
    tl.store(LSE + r * slr + split * slp + h, lse, mask=gvalid)
