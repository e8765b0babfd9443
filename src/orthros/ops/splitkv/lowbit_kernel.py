"""The Triton code of `ops/splitkv/lowbit.py` (the design is described there). A module of its
own because the kernel calls Triton helpers, which must be module globals; it imports triton
and is itself imported on first use."""

import struct

import triton
import triton.language as tl

from ..lowbit.write_kernel import _rotate
from .kernels import _dot, _query_rows


@triton.jit
def _as_operand(n, DT: tl.constexpr):
    """Integer levels (< 128) -> MAGIC + n in DT (MAGIC 0 in fp32), exactly."""
    if DT == tl.bfloat16:
        return (n.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)  # 128.0 = 0x4300
    elif DT == tl.float16:
        return (n.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)  # 1024.0 = 0x6400
    else:
        return n.to(tl.float32)

@triton.jit
def _unpack(x, BITS: tl.constexpr, DT: tl.constexpr):
    """Packed bytes [..., C] -> levels [..., C * 8 / BITS] in channel order (lowest bits
    first), as `_as_operand` operands."""
    mask: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        return tl.interleave(_as_operand(x & mask, DT), _as_operand(x >> 4, DT))
    else:  # 2 bits: interleave(interleave(n0, n2), interleave(n1, n3)) is n0 n1 n2 n3
        n0 = _as_operand(x & mask, DT)
        n1 = _as_operand((x >> 2) & mask, DT)
        n2 = _as_operand((x >> 4) & mask, DT)
        n3 = _as_operand(x >> 6, DT)
        return tl.interleave(tl.interleave(n0, n2), tl.interleave(n1, n3))

# Levels of packed bytes as exact fp16 values (0 .. 2^bits - 1), every bit plane of the bytes at
# once. On the GPU by inline PTX, four bytes a call: prmt spreads bytes 0, 1 (2, 3) of a word into
# the low bytes of two fp16 lanes, lop3 masks one plane's bits and ors in the exponent of 1024 in
# one instruction, so a lane holds 1024 + n * 2^(bits * plane) (exact), and one packed fp16 fma or
# subtraction per two levels takes 1024 off and the plane's weight out, exactly. So a level costs
# (2 + 2P) / (4P) prmt / lop3 and half a packed fp16 op, instead of per-element shifts, masks,
# 16-bit ors and the repacking of 16-bit values into pairs that plain Triton ops compile to
# (benchmarks/dequant_probe.py counts both). The interpreter cannot run PTX: `_levels` there is
# the same map in plain ops (what the tests check the kernel's logic with; the PTX itself against
# an emulation of its instructions, tests/ops/test_lowbit_ptx.py).
def _levels_ptx(bits: int) -> str:
    """The PTX block for `bits`-bit levels: outputs $0 .. $(2P - 1) (two registers a plane, P = 8 / bits),
    input $2P (four packed bytes)."""
    P = 8 // bits
    pair = lambda x: f"0x{int.from_bytes(struct.pack('<e', x), 'little') * 0x10001:08x}"  # fp16 bits, both lanes
    regs = ["mg"] + [f"s{i}, o{i}" for i in range(1, P)]
    lines = [f".reg .b32 t0, t1, {', '.join(regs)};", f"mov.b32 mg, {pair(1024.0)};"]
    for i in range(1, P):  # plane i lanes hold 1024 + n * w, w = 2^(bits * i): (x / w) - 1024 / w is n
        w = 2.0 ** (bits * i)
        lines += [f"mov.b32 s{i}, {pair(1 / w)};", f"mov.b32 o{i}, {pair(-1024.0 / w)};"]
    lines += [f"prmt.b32 t0, ${2 * P}, 0, 0x4140;", f"prmt.b32 t1, ${2 * P}, 0, 0x4342;"]
    for i in range(P):
        mask = ((1 << bits) - 1) << (bits * i)
        lines += [f"lop3.b32 ${2 * i + h}, t{h}, 0x{mask * 0x10001:08x}, mg, 0xea;" for h in (0, 1)]
    lines += ["sub.f16x2 $0, $0, mg;", "sub.f16x2 $1, $1, mg;"]
    for i in range(1, P):
        lines += [f"fma.rn.f16x2 ${2 * i + h}, ${2 * i + h}, s{i}, o{i};" for h in (0, 1)]
    return "{\n    " + "\n    ".join(lines) + "\n}"


LEVELS4_PTX = tl.constexpr(_levels_ptx(4))
LEVELS2_PTX = tl.constexpr(_levels_ptx(2))


@triton.jit
def _levels(x, BITS: tl.constexpr, PTX: tl.constexpr):
    """Packed bytes x (uint8) -> the levels of each bit plane (plane i: bits i * BITS ..), fp16."""
    if PTX:
        if BITS == 4:
            return tl.inline_asm_elementwise(asm=LEVELS4_PTX, constraints="=r,=r,=r,=r,r", args=[x],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(asm=LEVELS2_PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x],
                                             dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                             pack=4)
    else:
        if BITS == 4:
            return (x & 15).to(tl.float16), (x >> 4).to(tl.float16)
        else:
            return ((x & 3).to(tl.float16), ((x >> 2) & 3).to(tl.float16), ((x >> 4) & 3).to(tl.float16),
                    (x >> 6).to(tl.float16))


@triton.jit
def _split_planes(x, DK: tl.constexpr, PK: tl.constexpr):
    """x [DK * PK] in channel order -> its PK bit planes [DK] (plane i: channels c * PK + i)."""
    if PK == 2:
        return tl.split(tl.reshape(x, [DK, 2]))
    else:
        even, odd = tl.split(tl.reshape(x, [DK, 2, 2]))  # planes (0, 2) and (1, 3)
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        return p0, p1, p2, p3


@triton.jit
def _f16_keys(qh, lv, ks, kz):
    """Scores of fp16 query planes qh [BLOCK_R, DK] over key levels lv [BLOCK_Q, DK] of one plane,
    dequantized in fp16 with that plane's per-channel scale / zero [DK]."""
    return tl.dot(qh, tl.trans(lv * ks[None, :] + kz[None, :]))


@triton.jit
def _plane_scores(qk, kb, PLANE: tl.constexpr, KS_g, KZ_g, ci, PK: tl.constexpr, KBITS: tl.constexpr,
                  DT: tl.constexpr, MAGIC: tl.constexpr, IEEE: tl.constexpr):
    """Bit plane PLANE of a packed key tile kb [BLOCK_Q, D / PK] (channels ci * PK + PLANE):
    its share of the scores of qk [BLOCK_R, D / PK] (those channels of q, scaled), and of the bias."""
    ks = tl.load(KS_g + ci * PK + PLANE).to(tl.float32)
    kz = tl.load(KZ_g + ci * PK + PLANE).to(tl.float32)
    qs = (qk * ks[None, :]).to(DT)
    bias = tl.sum(qk * kz[None, :], 1) - MAGIC * tl.sum(qs.to(tl.float32), 1)
    kn = _as_operand((kb >> (PLANE * KBITS)) & ((1 << KBITS) - 1), DT)
    return _dot(qs, tl.trans(kn), IEEE), bias

@triton.jit
def _value_scales(p, VS_b, VZ_b, j0, nq, gq, jv, svss, NG: tl.constexpr, DT: tl.constexpr, MAGIC: tl.constexpr):
    """A packed tile's value scales folded into p [BLOCK_R, BLOCK_Q]: (p * s_g as the dot's
    operand [BLOCK_NG, BLOCK_R, BLOCK_Q], the bias p . z_g - MAGIC * sum(p * s_g) [BLOCK_NG, BLOCK_R])."""
    t = tl.cast(j0, tl.int64) * svss  # the tile's first slot: 64-bit once, 32-bit within
    vsz = nq[None, :] * svss + gq
    vmask = jv[None, :] & (gq < NG)  # masked lanes 0: p is 0 there, and so must p * scale be
    vs = tl.load(VS_b + t + vsz, mask=vmask, other=0.0).to(tl.float32)  # [BLOCK_NG, BLOCK_Q]
    vz = tl.load(VZ_b + t + vsz, mask=vmask, other=0.0).to(tl.float32)
    ps = (p[None, :, :] * vs[:, None, :]).to(DT)
    return ps, tl.sum(p[None, :, :] * vz[:, None, :], 2) - MAGIC * tl.sum(ps.to(tl.float32), 2)

@triton.jit
def _along_channels(x, BLOCK_Q: tl.constexpr, BLOCK_NG: tl.constexpr, VPL: tl.constexpr):
    """Per-group values x [BLOCK_Q, NG] -> [BLOCK_Q, NG * VPL]: each repeated over its group's bytes."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK_Q, BLOCK_NG, VPL]), [BLOCK_Q, BLOCK_NG * VPL])

@triton.jit
def _dequant_plane(vb, PLANE: tl.constexpr, VBITS: tl.constexpr, vs, vz, DT: tl.constexpr):
    """Bit plane PLANE of packed value bytes vb, dequantized (level * scale + zero) into DT.
    The level becomes a float without an int-to-float conversion (16 a clock per SM on sm_90,
    an eighth of the FMA rate): n | bits(2^23) is the fp32 2^23 + n; taking 2^23 off is exact."""
    n = ((vb >> (PLANE * VBITS)) & ((1 << VBITS) - 1)).to(tl.int32)
    level = (n | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return (level * vs + vz).to(DT)

@triton.jit
def _tile_scales(KS_b, KZ_b, VS_b, VZ_b, j0, lo, hi, KG, ksg, svss, d, nq, gv):
    """The fp16 loop's scales of the packed tile at j0, as stored (nothing at or past hi is read):
    the key group's per-channel scale / zero [D] and the tokens' value scale / zero [BLOCK_Q, NG]."""
    kmask = (d * 0 + j0) < hi  # [D], all lanes alike (a scalar & tensor mask is not portable)
    grp = tl.cast(j0 // KG, tl.int64) * ksg
    ksv = tl.load(KS_b + grp + d, mask=kmask, other=0.0)
    kzv = tl.load(KZ_b + grp + d, mask=kmask, other=0.0)
    j = j0 + nq
    jv = ((j >= lo) & (j < hi))[:, None]
    vso = tl.cast(j0, tl.int64) * svss + nq[:, None] * svss + gv[None, :]
    return ksv, kzv, tl.load(VS_b + vso, mask=jv, other=0.0), tl.load(VZ_b + vso, mask=jv, other=0.0)

@triton.jit
def _q_plane(qbase, ci, rmask, PK: tl.constexpr, PLANE: tl.constexpr, qscale):
    return tl.load(qbase + ci[None, :] * PK + PLANE, mask=rmask, other=0.0).to(tl.float32) * qscale

@triton.jit
def _softmax_step(s, vis, m_i, l_i):
    """Scores s [BLOCK_R, N] (log2 units) -> (p, alpha, m_new, l_new) of the online softmax."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

@triton.jit
def _visible(j, jvalid, KDOC_b, slot, qdoc, m, window, window_rows, HAS_WINDOW: tl.constexpr,
             SINKS: tl.constexpr = 0):
    """SINKS > 0: windowed rows also see slots below SINKS (attention sinks of rows that start at slot 0)."""
    kdoc = tl.load(KDOC_b + j, mask=jvalid, other=-4).to(tl.int32)
    vis = (j[None, :] <= slot[:, None]) & (kdoc[None, :] == qdoc[:, None]) & jvalid[None, :]
    if HAS_WINDOW:  # rows past window_rows: no window
        near = (slot[:, None] - j[None, :] < window) | (m[:, None] >= window_rows)
        if SINKS > 0:
            near = near | (j[None, :] < SINKS)
        vis = vis & near
    return vis

@triton.jit
def _packed_visible(j, jvalid, KDOC_b, qdoc, prow):
    """`_visible` for packed slots: every row of a launch has slot >= bound + recent - 1 (the cache
    keeps at least W slots in bf16), so a packed slot is at or before every row's slot and out of
    every window: what is left is the document, and which rows read the packed part (prow)."""
    kdoc = tl.load(KDOC_b + j, mask=jvalid, other=-4).to(tl.int32)
    return (kdoc[None, :] == qdoc[:, None]) & prow[:, None] & jvalid[None, :]

@triton.jit
def _dense_tile(qd, k, v, vis, m_i, l_i, acc, BLOCK_NG: tl.constexpr, IEEE: tl.constexpr):
    """One tile of bf16 keys k [N, BLOCK_D] and values v [BLOCK_NG, N, BLOCK_VG]."""
    s = _dot(qd, tl.trans(k), IEEE)
    p, alpha, m_i, l_i = _softmax_step(s, vis, m_i, l_i)
    pb = tl.broadcast_to(p.to(v.dtype)[None, :, :], [BLOCK_NG, p.shape[0], p.shape[1]])
    acc = acc * alpha[None, :, None] + _dot(pb, v, IEEE)
    return m_i, l_i, acc, alpha

@triton.jit
def splitkv_lowbit_fwd(Q, QR, SK, SV, KQ, VQ, KS, KZ, VS, VZ, RK, RV, SLOT, QDOC, KDOC, BOUND, O, LSE,
                       sqb, sqm, sqh,
                       sqrb, sqrm, sqrh,  # q R (rotated caches)
                       ssb, sss, ssh,  # sinks (K and V alike)
                       skqb, skqs, skqh,  # packed K
                       svqb, svqs, svqh,  # packed V
                       sksb, ksg, sksh,  # key scale / zero [B, S / KG, Hkv, D]
                       svsb, svss, svsh,  # value scale / zero [B, S, Hkv, D / VG]
                       srb, srs, srh,  # ring
                       s_slot_b, s_qdoc_b, s_kdoc_b,
                       sob, sop, som, soh, sox, slb, slp, slm,
                       M, S, Hkv, NS, R, KG, qscale, window, window_rows, keys_per_split,
                       G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                       VG: tl.constexpr, NG: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_VG: tl.constexpr,
                       KEY_FOLD: tl.constexpr, VALUE_BYTES: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, ROTATED: tl.constexpr, WIDE: tl.constexpr,
                       PLANAR: tl.constexpr, VDQ: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr,
                       PTX: tl.constexpr, NO_PACKED: tl.constexpr = False, HB: tl.constexpr = 1,
                       RSCALE: tl.constexpr = 1.0, ATTN_SINKS: tl.constexpr = 0):
    # ATTN_SINKS > 0: windowed rows also see the sink slots below it (attention sinks; <= NS)
    # the dots' operand dtype: q's, fp32 for narrow packed tiles (see ops/splitkv/lowbit.py)
    DT: tl.constexpr = Q.dtype.element_ty if WIDE else tl.float32
    MAGIC: tl.constexpr = 128.0 if DT == tl.bfloat16 else (1024.0 if DT == tl.float16 else 0.0)
    PK: tl.constexpr = 8 // KBITS
    PV: tl.constexpr = 8 // VBITS
    split = tl.program_id(1)
    b, kvh, m, h, rvalid, d, dmask, q = _query_rows(Q, sqb, sqm, sqh, M, Hkv, G, D, BLOCK_R, BLOCK_D)
    qf = q.to(tl.float32) * qscale  # softmax scale and log2(e) folded in: scores in log2 units
    qd = qf.to(DT)
    if ROTATED and NO_PACKED:  # q R for the kernel that reads the packed slots, made here (one launch less)
        qr = _rotate(q.to(tl.float32), BLOCK_R, BLOCK_D, HB, RSCALE).to(QR.dtype.element_ty)
        tl.store(QR + b * sqrb + m[:, None] * sqrm + h[:, None] * sqrh + d[None, :], qr,
                 mask=rvalid[:, None] & dmask[None, :])
        qf_p = qr.to(tl.float32) * qscale
        qd_p = qf_p.to(DT)
    elif ROTATED:  # q R for the packed keys (they hold K R)
        qr = tl.load(QR + b * sqrb + m[:, None] * sqrm + h[:, None] * sqrh + d[None, :],
                     mask=rvalid[:, None] & dmask[None, :], other=0.0)
        qf_p = qr.to(tl.float32) * qscale
        qd_p = qf_p.to(DT)
    else:
        qf_p = qf
        qd_p = qd
    slot = tl.load(SLOT + b * s_slot_b + m, mask=rvalid, other=-1).to(tl.int32)
    qdoc = tl.load(QDOC + b * s_qdoc_b + m, mask=rvalid, other=-3).to(tl.int32)
    bound = tl.load(BOUND).to(tl.int32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    if NO_PACKED:  # the bf16 slots alone: split 0 the sinks and the ring's first run, split i its i-th
        rb = tl.maximum(bound, NS)
        start = tl.where(split == 0, 0, rb + split * keys_per_split)
        end = tl.minimum(rb + (split + 1) * keys_per_split, S)
    end = tl.minimum(end, tl.max(tl.where(rvalid, slot, -1), axis=0) + 1)
    sink_start = start  # attention sinks: the sink slots are read even below the window
    if HAS_WINDOW:
        if window_rows >= M:  # every row is windowed: skip the keys before the window
            start = tl.maximum(start, tl.min(tl.where(rvalid, slot, S), axis=0) - window + 1)
    if ATTN_SINKS == 0:
        sink_start = start
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    # values by channel group: channel g * VG + c at acc[g, :, c]
    g3 = tl.arange(0, BLOCK_NG)[:, None, None]
    c3 = tl.arange(0, BLOCK_VG)[None, None, :]
    ch3 = g3 * VG + c3
    cmask3 = (g3 < NG) & (c3 < VG)
    acc = tl.zeros([BLOCK_NG, BLOCK_R, BLOCK_VG], tl.float32)
    acc_p = tl.zeros([BLOCK_NG, BLOCK_R, BLOCK_VG], tl.float32)  # ROTATED: the packed values, in V R space
    KDOC_b = KDOC + b * s_kdoc_b

    # sinks [0, NS)
    n = tl.arange(0, BLOCK_N)
    n3 = n[None, :, None]
    SK_b, SV_b = SK + b * ssb + kvh * ssh, SV + b * ssb + kvh * ssh
    for j0 in range(sink_start, tl.minimum(end, NS), BLOCK_N):
        j = j0 + n
        jv = j < tl.minimum(end, NS)
        k = tl.load(SK_b + j[:, None] * sss + d[None, :], mask=jv[:, None] & dmask[None, :], other=0.0)
        v = tl.load(SV_b + (j0 + n3) * sss + ch3, mask=(j0 + n3 < tl.minimum(end, NS)) & cmask3, other=0.0)
        vis = _visible(j, jv, KDOC_b, slot, qdoc, m, window, window_rows, HAS_WINDOW, ATTN_SINKS)
        m_i, l_i, acc, alpha = _dense_tile(qd, k.to(DT), v.to(DT), vis, m_i, l_i, acc, BLOCK_NG, IEEE)

    # packed [NS, bound): tiles aligned to BLOCK_Q, so (KEY_FOLD) each lies in one key group
    lo = tl.maximum(start, NS)
    hi = tl.minimum(end, bound)
    if NO_PACKED:  # another kernel reads the packed slots (`lowbit_gluon.py`): an empty loop
        hi = lo // BLOCK_Q * BLOCK_Q
    nq = tl.arange(0, BLOCK_Q)
    nq3 = nq[None, :, None]
    ck = tl.arange(0, BLOCK_D // PK)
    KQ_b = KQ + b * skqb + kvh * skqh
    VQ_b = VQ + b * svqb + kvh * svqh
    KS_b, KZ_b = KS + b * sksb + kvh * sksh, KZ + b * sksb + kvh * sksh
    VS_b, VZ_b = VS + b * svsb + kvh * svsh, VZ + b * svsb + kvh * svsh
    gq = tl.arange(0, BLOCK_NG)[:, None]
    if PLANAR:  # bit planes: plane i of byte c holds channel c * P + i; no level is moved between lanes
        DK: tl.constexpr = D // PK  # key bytes a slot
        VPL: tl.constexpr = VG // PV  # value bytes a group
        ci = tl.arange(0, DK)
        cv3 = tl.arange(0, VPL)[None, None, :]
        if ROTATED:
            qbase = QR + b * sqrb + m[:, None] * sqrm + h[:, None] * sqrh
        else:
            qbase = Q + b * sqb + m[:, None] * sqm + h[:, None] * sqh
        qk0 = _q_plane(qbase, ci, rvalid[:, None], PK, 0, qscale)
        qk1 = _q_plane(qbase, ci, rvalid[:, None], PK, 1, qscale)
        if PK == 4:
            qk2 = _q_plane(qbase, ci, rvalid[:, None], PK, 2, qscale)
            qk3 = _q_plane(qbase, ci, rvalid[:, None], PK, 3, qscale)
        if F16:  # fp16 query planes, scaled by a power of two (exact) that keeps them under 2^14
            big = tl.max(tl.max(tl.maximum(tl.abs(qk0), tl.abs(qk1)), 1), 0)
            if PK == 4:
                big = tl.maximum(big, tl.max(tl.max(tl.maximum(tl.abs(qk2), tl.abs(qk3)), 1), 0))
            qf2 = tl.where(big > 16384.0, tl.exp2(14.0 - tl.ceil(tl.log2(big))), 1.0)
            unscale = 1.0 / qf2
            qh0 = (qk0 * qf2).to(tl.float16)
            qh1 = (qk1 * qf2).to(tl.float16)
            if PK == 4:
                qh2 = (qk2 * qf2).to(tl.float16)
                qh3 = (qk3 * qf2).to(tl.float16)
        if VDQ:  # value plane i, 2-D: byte c of the slot holds channel c * PV + i
            DV: tl.constexpr = D // PV  # value bytes a slot
            cb = tl.arange(0, DV)
            gv = tl.arange(0, BLOCK_NG)
            a0 = tl.zeros([BLOCK_R, DV], tl.float32)
            a1 = tl.zeros([BLOCK_R, DV], tl.float32)
            if PV == 4:
                a2 = tl.zeros([BLOCK_R, DV], tl.float32)
                a3 = tl.zeros([BLOCK_R, DV], tl.float32)
        else:
            a0 = tl.zeros([BLOCK_NG, BLOCK_R, VPL], tl.float32)  # value plane i: channels g * VG + c * PV + i
            a1 = tl.zeros([BLOCK_NG, BLOCK_R, VPL], tl.float32)
            if PV == 4:
                a2 = tl.zeros([BLOCK_NG, BLOCK_R, VPL], tl.float32)
                a3 = tl.zeros([BLOCK_NG, BLOCK_R, VPL], tl.float32)
        vmask3 = (g3 < NG) & (cv3 < VPL)
        prow = rvalid  # the rows that read packed slots: no windowed row does
        if HAS_WINDOW:
            prow = prow & (m >= window_rows)
        # the packed part keeps a softmax state of its own (merged with the bf16 part's at the end),
        # so a packed tile never rescales the bf16 accumulator, nor a ring tile the planes
        m_p = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_p = tl.zeros([BLOCK_R], tl.float32)
        first = lo // BLOCK_Q * BLOCK_Q
        if F16:  # scales loaded a tile ahead, in registers: their latency hides behind a tile's work
            ksn, kzn, vsn, vzn = _tile_scales(KS_b, KZ_b, VS_b, VZ_b, first, lo, hi, KG, ksg, svss, d, nq, gv)
        for j0 in range(first, hi, BLOCK_Q):
            j = j0 + nq
            jv = (j >= lo) & (j < hi)
            kb = tl.load(KQ_b + tl.cast(j0, tl.int64) * skqs + nq[:, None] * skqs + ci[None, :], mask=jv[:, None],
                         other=0)
            grp = tl.cast(j0 // KG, tl.int64) * ksg
            if F16:  # keys dequantized in fp16 (levels by `_levels`, the group's per-channel scale / zero)
                ksv, kzv, vst, vzt = ksn, kzn, vsn, vzn
                ksn, kzn, vsn, vzn = _tile_scales(KS_b, KZ_b, VS_b, VZ_b, j0 + BLOCK_Q, lo, hi, KG, ksg, svss, d, nq,
                                                  gv)
                if PK == 2:
                    ks0, ks1 = _split_planes(ksv, DK, 2)
                    kz0, kz1 = _split_planes(kzv, DK, 2)
                    l0, l1 = _levels(kb, KBITS, PTX)
                    s = _f16_keys(qh0, l0, ks0, kz0) + _f16_keys(qh1, l1, ks1, kz1)
                else:
                    ks0, ks1, ks2, ks3 = _split_planes(ksv, DK, 4)
                    kz0, kz1, kz2, kz3 = _split_planes(kzv, DK, 4)
                    l0, l1, l2, l3 = _levels(kb, KBITS, PTX)
                    s = (_f16_keys(qh0, l0, ks0, kz0) + _f16_keys(qh1, l1, ks1, kz1)
                         + _f16_keys(qh2, l2, ks2, kz2) + _f16_keys(qh3, l3, ks3, kz3))
                s = s * unscale
            else:
                s, bias = _plane_scores(qk0, kb, 0, KS_b + grp, KZ_b + grp, ci, PK, KBITS, DT, MAGIC, IEEE)
                s1, b1 = _plane_scores(qk1, kb, 1, KS_b + grp, KZ_b + grp, ci, PK, KBITS, DT, MAGIC, IEEE)
                s, bias = s + s1, bias + b1
                if PK == 4:
                    s2, b2 = _plane_scores(qk2, kb, 2, KS_b + grp, KZ_b + grp, ci, PK, KBITS, DT, MAGIC, IEEE)
                    s3, b3 = _plane_scores(qk3, kb, 3, KS_b + grp, KZ_b + grp, ci, PK, KBITS, DT, MAGIC, IEEE)
                    s, bias = s + s2 + s3, bias + b2 + b3
                s = s + bias[:, None]
            vis = _packed_visible(j, jv, KDOC_b, qdoc, prow)
            p, alpha, m_p, l_p = _softmax_step(s, vis, m_p, l_p)
            VM: tl.constexpr = (1 << VBITS) - 1
            if VDQ:  # values dequantized in registers (n * s + z), plain 2-D dots with p
                t = tl.cast(j0, tl.int64)
                vb = tl.load(VQ_b + t * svqs + nq[:, None] * svqs + cb[None, :], mask=jv[:, None], other=0)
                al2 = alpha[:, None]
                if F16:  # values dequantized in fp16: levels by `_levels`, the token's group scale / zero
                    vs = _along_channels(vst, BLOCK_Q, BLOCK_NG, VPL)
                    vz = _along_channels(vzt, BLOCK_Q, BLOCK_NG, VPL)
                    pd = p.to(tl.float16)
                    if PV == 2:
                        w0, w1 = _levels(vb, VBITS, PTX)
                        a0 = a0 * al2 + tl.dot(pd, w0 * vs + vz)
                        a1 = a1 * al2 + tl.dot(pd, w1 * vs + vz)
                    else:
                        w0, w1, w2, w3 = _levels(vb, VBITS, PTX)
                        a0 = a0 * al2 + tl.dot(pd, w0 * vs + vz)
                        a1 = a1 * al2 + tl.dot(pd, w1 * vs + vz)
                        a2 = a2 * al2 + tl.dot(pd, w2 * vs + vz)
                        a3 = a3 * al2 + tl.dot(pd, w3 * vs + vz)
                else:
                    vso = t * svss + nq[:, None] * svss + gv[None, :]  # [BLOCK_Q, NG]
                    vs = tl.load(VS_b + vso, mask=jv[:, None], other=0.0)
                    vz = tl.load(VZ_b + vso, mask=jv[:, None], other=0.0)
                    vs = _along_channels(vs.to(tl.float32), BLOCK_Q, BLOCK_NG, VPL)
                    vz = _along_channels(vz.to(tl.float32), BLOCK_Q, BLOCK_NG, VPL)
                    pd = p.to(DT)
                    a0 = a0 * al2 + _dot(pd, _dequant_plane(vb, 0, VBITS, vs, vz, DT), IEEE)
                    a1 = a1 * al2 + _dot(pd, _dequant_plane(vb, 1, VBITS, vs, vz, DT), IEEE)
                    if PV == 4:
                        a2 = a2 * al2 + _dot(pd, _dequant_plane(vb, 2, VBITS, vs, vz, DT), IEEE)
                        a3 = a3 * al2 + _dot(pd, _dequant_plane(vb, 3, VBITS, vs, vz, DT), IEEE)
            else:  # value scales folded into p: dots batched over the channel groups
                jv3 = (j0 + nq3 >= lo) & (j0 + nq3 < hi)
                vb = tl.load(VQ_b + tl.cast(j0, tl.int64) * svqs + nq3 * svqs + g3 * VPL + cv3, mask=jv3 & vmask3,
                             other=0)  # [BLOCK_NG, BLOCK_Q, VPL]
                ps, vbias = _value_scales(p, VS_b, VZ_b, j0, nq, gq, jv, svss, NG, DT, MAGIC)
                vbias = vbias[:, :, None]
                al = alpha[None, :, None]
                a0 = a0 * al + _dot(ps, _as_operand(vb & VM, DT), IEEE) + vbias
                a1 = a1 * al + _dot(ps, _as_operand((vb >> VBITS) & VM, DT), IEEE) + vbias
                if PV == 4:
                    a2 = a2 * al + _dot(ps, _as_operand((vb >> (2 * VBITS)) & VM, DT), IEEE) + vbias
                    a3 = a3 * al + _dot(ps, _as_operand((vb >> (3 * VBITS)) & VM, DT), IEEE) + vbias
    else:  # levels interleaved back into channel order
        for j0 in range(lo // BLOCK_Q * BLOCK_Q, hi, BLOCK_Q):
            j = j0 + nq
            jv = (j >= lo) & (j < hi)
            kq_t = KQ_b + tl.cast(j0, tl.int64) * skqs  # this tile's first byte: 64-bit once, 32-bit within
            kb = tl.load(kq_t + nq[:, None] * skqs + ck[None, :], mask=jv[:, None] & (ck < D // PK)[None, :], other=0)
            kn = _unpack(kb, KBITS, DT)  # [BLOCK_Q, BLOCK_D]: MAGIC + level
            if KEY_FOLD:
                grp = tl.cast(j0 // KG, tl.int64) * ksg
                ks = tl.load(KS_b + grp + d, mask=dmask, other=0.0).to(tl.float32)
                kz = tl.load(KZ_b + grp + d, mask=dmask, other=0.0).to(tl.float32)
                qs = (qf_p * ks[None, :]).to(DT)
                bias = tl.sum(qf_p * kz[None, :], 1) - MAGIC * tl.sum(qs.to(tl.float32), 1)
                s = _dot(qs, tl.trans(kn), IEEE) + bias[:, None]
            else:  # the tile spans key groups: per-slot scales
                grp = (j // KG)[:, None] * ksg + d[None, :]
                kmask = jv[:, None] & dmask[None, :]
                ks = tl.load(KS_b + grp, mask=kmask, other=0.0).to(tl.float32)
                kz = tl.load(KZ_b + grp, mask=kmask, other=0.0).to(tl.float32)
                k = (kn.to(tl.float32) - MAGIC) * ks + kz
                s = _dot(qd_p, tl.trans(k.to(DT)), IEEE)
            vis = _visible(j, jv, KDOC_b, slot, qdoc, m, window, window_rows, HAS_WINDOW)
            p, alpha, m_i, l_i = _softmax_step(s, vis, m_i, l_i)
            jv3 = (j0 + nq3 >= lo) & (j0 + nq3 < hi)
            vq_t = VQ_b + tl.cast(j0, tl.int64) * svqs
            if VALUE_BYTES:  # [BLOCK_NG, BLOCK_Q, BLOCK_VG / PV] bytes, each once
                cb3 = tl.arange(0, BLOCK_VG // PV)[None, None, :]
                vb = tl.load(vq_t + nq3 * svqs + g3 * (VG // PV) + cb3, mask=jv3 & (g3 < NG) & (cb3 < VG // PV),
                             other=0)
                vn = _unpack(vb, VBITS, DT)
            else:  # bytes straddle value groups: per channel
                vb = tl.load(vq_t + nq3 * svqs + ch3 // PV, mask=jv3 & cmask3, other=0)
                vn = _as_operand((vb >> ((ch3 % PV) * VBITS).to(tl.uint8)) & ((1 << VBITS) - 1), DT)
            ps, vbias = _value_scales(p, VS_b, VZ_b, j0, nq, gq, jv, svss, NG, DT, MAGIC)
            if ROTATED:
                acc = acc * alpha[None, :, None]
                acc_p = acc_p * alpha[None, :, None] + _dot(ps, vn, IEEE) + vbias[:, :, None]
            else:
                acc = acc * alpha[None, :, None] + _dot(ps, vn, IEEE) + vbias[:, :, None]

    # ring [max(bound, NS), end) at j % R
    RK_b, RV_b = RK + b * srb + kvh * srh, RV + b * srb + kvh * srh
    for j0 in range(tl.maximum(start, tl.maximum(bound, NS)), end, BLOCK_N):
        j = j0 + n
        jv = j < end
        k = tl.load(RK_b + (j % R)[:, None] * srs + d[None, :], mask=jv[:, None] & dmask[None, :], other=0.0)
        v = tl.load(RV_b + ((j0 + n3) % R) * srs + ch3, mask=(j0 + n3 < end) & cmask3, other=0.0)
        vis = _visible(j, jv, KDOC_b, slot, qdoc, m, window, window_rows, HAS_WINDOW)
        m_i, l_i, acc, alpha = _dense_tile(qd, k.to(DT), v.to(DT), vis, m_i, l_i, acc, BLOCK_NG, IEEE)
        if ROTATED and not PLANAR:
            acc_p = acc_p * alpha[None, :, None]

    if PLANAR:  # the two softmax states merged: each part rescaled to the common max
        m_all = tl.maximum(m_i, m_p)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        cd = tl.exp2(m_i - m_safe)
        cp = tl.exp2(m_p - m_safe)
        l_i = l_i * cd + l_p * cp
        m_i = m_all
        acc = acc * cd[None, :, None]
        if VDQ:  # the planes' layout: [rows, bytes] or [groups, rows, bytes]
            cpl = cp[:, None]
        else:
            cpl = cp[None, :, None]
        a0 = a0 * cpl
        a1 = a1 * cpl
        if PV == 4:
            a2 = a2 * cpl
            a3 = a3 * cpl
    seen = l_i > 0
    linv = 1.0 / tl.where(seen, l_i, 1.0)
    inv = linv[None, :, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    m3, h3 = m[None, :, None], h[None, :, None]
    omask = (m3 < M) & cmask3
    if PLANAR:  # two parts, merged then added as o[0] + o[1] (R) outside; the planes back in channel order
        tl.store(O + b * sob + split * sop + m3 * som + h3 * soh + ch3, acc * inv, mask=omask)
        if VDQ:
            o1 = O + b * sob + split * sop + m[:, None] * som + h[:, None] * soh + sox + cb[None, :] * PV
            pmask = rvalid[:, None]
            pinv = linv[:, None]
        else:
            o1 = O + b * sob + split * sop + m3 * som + h3 * soh + sox + g3 * VG + cv3 * PV
            pmask = (m3 < M) & vmask3
            pinv = inv
        tl.store(o1, a0 * pinv, mask=pmask)
        tl.store(o1 + 1, a1 * pinv, mask=pmask)
        if PV == 4:
            tl.store(o1 + 2, a2 * pinv, mask=pmask)
            tl.store(o1 + 3, a3 * pinv, mask=pmask)
    elif ROTATED:  # two parts, merged then added as o[0] + o[1] R outside: the packed values leave V R space there
        tl.store(O + b * sob + split * sop + m3 * som + h3 * soh + ch3, acc * inv, mask=omask)
        tl.store(O + b * sob + split * sop + m3 * som + h3 * soh + sox + ch3, acc_p * inv, mask=omask)
    else:
        tl.store(O + b * sob + split * sop + m3 * som + h3 * soh + ch3, acc * inv, mask=omask)
    tl.store(LSE + b * slb + split * slp + m * slm + h, lse, mask=rvalid)


@triton.jit
def lowbit_finish(O, LSE, OUT, P, M, H, row0, sob, sop, som, soh, sox, slb, slp, slm, s_out_b,
                  s_out_m, s_out_h, D: tl.constexpr, NB: tl.constexpr, BLOCK_P: tl.constexpr,
                  ROTATED: tl.constexpr, HB: tl.constexpr, RSCALE: tl.constexpr):
    """The Gluon path's merge, one program a (row, query, head): the NB bf16 splits (splits 0 .. NB - 1:
    their bf16 part; their packed part empty) and the packed splits NB .. P - 1 (rows from row0 on; the
    rows before are windowed and read the bf16 splits alone), log-sum-exp weighted; the packed parts'
    sum times R (a rotated cache; the fast transform, `ops.lowbit.rotate`) added to the bf16 parts'.
    One launch where the general merge takes a dozen."""
    pid = tl.program_id(0)
    h = pid % H
    m = (pid // H) % M
    b = (pid // (H * M)).to(tl.int64)
    n = tl.where(m >= row0, P, NB)
    d = tl.arange(0, D)
    lbase = LSE + b * slb + m * slm + h
    obase = O + b * sob + m * som + h * soh
    # the bf16 splits
    pb = tl.arange(0, NB)
    lb = tl.load(lbase + pb * slp)
    top = tl.max(lb, 0)
    wb = tl.exp(lb - tl.where(top == float("-inf"), 0.0, top))  # every split empty: weights 0
    total = tl.sum(wb, 0)
    bf16 = tl.sum(wb[:, None] * tl.load(obase + pb[:, None] * sop + d[None, :]), 0)
    packed = tl.zeros([D], tl.float32)
    for p0 in range(NB, n, BLOCK_P):  # the packed splits: one pass, rescaled as the maximum grows
        p = p0 + tl.arange(0, BLOCK_P)
        lse = tl.load(lbase + p * slp, mask=p < n, other=float("-inf"))
        o = tl.load(obase + p[:, None] * sop + sox + d[None, :], mask=(p < n)[:, None], other=0.0)
        new = tl.maximum(top, tl.max(lse, 0))
        ref = tl.where(new == float("-inf"), 0.0, new)
        alpha = tl.exp(top - ref)
        w = tl.exp(lse - ref)
        total = total * alpha + tl.sum(w, 0)
        bf16 = bf16 * alpha
        packed = packed * alpha + tl.sum(w[:, None] * o, 0)
        top = new
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    if ROTATED:  # (sum of the packed parts) R, by the fast transform
        packed = tl.reshape(_rotate(packed[None, :], 1, D, HB, RSCALE), [D])
    obuf = OUT + b * s_out_b + m * s_out_m + h * s_out_h
    tl.store(obuf + d, ((bf16 + packed) * inv).to(OUT.dtype.element_ty))
