"""The Triton kernel of `ops/lowbit/write.py` (the low-bit cache's decode write, one launch a layer)."""

import triton
import triton.language as tl


@triton.jit
def _butterfly(x, R: tl.constexpr, N: tl.constexpr, h: tl.constexpr):
    """(x_i, x_{i+h}) -> (x_i + x_{i+h}, x_i - x_{i+h}) inside each block of 2h channels."""
    y = tl.permute(tl.reshape(x, [R, N // (2 * h), 2, h]), [0, 1, 3, 2])
    a, c = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + c, a - c), [0, 1, 3, 2]), [R, N])


@triton.jit
def _rotate(x, R: tl.constexpr, N: tl.constexpr, HB: tl.constexpr, SCALE: tl.constexpr):
    """`ops.lowbit.rotate` of the rows of x [R, N] (blocks of HB channels), the same bits."""
    tl.static_assert(HB <= 256, "rotation blocks of at most 256 channels")
    for i in tl.static_range(8):  # h = 1, 2, 4, ... < HB (unrolled: h is a constant of each stage)
        if HB > (1 << i):
            x = _butterfly(x, R, N, 1 << i)
    return x * SCALE


@triton.jit
def _round(x, PTX: tl.constexpr):
    """To the nearest integer, ties to even (torch.round)."""
    if PTX:
        return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return (x + 12582912.0) - 12582912.0  # exact for |x| < 2^22; larger ones are clamped anyway


@triton.jit
def _quantize(x, lo, hi, BITS: tl.constexpr, PTX: tl.constexpr):
    """`ops.lowbit.quantize` given the group's range: (levels int32 like x, scale, zero fp16)."""
    LEVELS: tl.constexpr = 2**BITS - 1
    zero = lo.to(tl.float16)
    scale = ((hi - lo) * (1.0 / LEVELS)).to(tl.float16)  # times the fp32 reciprocal, as `quantize` does
    s, z = scale.to(tl.float32), zero.to(tl.float32)
    s2 = tl.broadcast_to(s, x.shape)
    n = tl.math.div_rn(x - tl.broadcast_to(z, x.shape), tl.maximum(s2, 1e-30))
    n = tl.where(s2 > 0, _round(n, PTX), 0.0)
    n = tl.minimum(tl.maximum(n, 0.0), LEVELS)
    return n.to(tl.int32), scale, zero


@triton.jit
def _pack(n, R: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """levels [R, N] -> bytes [R, N * BITS / 8] (int32), channel c * P + i at bits i * BITS of byte c."""
    P: tl.constexpr = 8 // BITS
    shift = tl.arange(0, P) * BITS
    return tl.sum(tl.reshape(n, [R, N // P, P]) << shift[None, None, :], axis=2)


@triton.jit
def lowbit_decode_write_fwd(K, V, RK, RV, SK, SV, KQ, VQ, KS, KZ, VS, VZ, SLOT,
                            skb, skh, svb, svh, srb, srs, srh, ssb, sss, ssh,
                            skqb, skqs, skqh, svqb, svqs, svqh,
                            sksb, sksg, sksh,  # key scale / zero [B, C / KG, Hkv, D]
                            svsb, svsh, svss,  # value scale / zero head-major [B, Hkv, C, NG]
                            Hkv, NS, RING, recent,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, SCALE: tl.constexpr,
                            ROTATED: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
                            KBITS: tl.constexpr, VBITS: tl.constexpr, PTX: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    h = pid % Hkv
    slot = tl.load(SLOT).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    k = tl.load(K + b * skb + h * skh + d, mask=dm, other=0.0)
    v = tl.load(V + b * svb + h * svh + d, mask=dm, other=0.0)
    ring = b * srb + (slot % RING) * srs + h * srh + d
    tl.store(RK + ring, k, mask=dm)
    tl.store(RV + ring, v, mask=dm)
    if slot < NS:
        tl.store(SK + b * ssb + slot * sss + h * ssh + d, k, mask=dm)
        tl.store(SV + b * ssb + slot * sss + h * ssh + d, v, mask=dm)

    # the token's value: per token over groups of VG channels
    PV: tl.constexpr = 8 // VBITS
    x = v.to(tl.float32)[None, :]
    if ROTATED:
        x = _rotate(x, 1, BLOCK_D, HB, SCALE)
    xg = tl.reshape(x, [BLOCK_D // VG, VG])
    n, s, z = _quantize(xg, tl.min(xg, axis=1)[:, None], tl.max(xg, axis=1)[:, None], VBITS, PTX)
    byte = _pack(tl.reshape(n, [1, BLOCK_D]), 1, BLOCK_D, VBITS)
    c = tl.arange(0, BLOCK_D // PV)[None, :]
    tl.store(VQ + b * svqb + slot * svqs + h * svqh + c, byte.to(tl.uint8), mask=c < D // PV)
    g = tl.arange(0, BLOCK_D // VG)[:, None]
    vs = b * svsb + h * svsh + slot * svss + g
    tl.store(VS + vs, s, mask=g < D // VG)
    tl.store(VZ + vs, z, mask=g < D // VG)

    # the key group just below the bound, on the step the bound moves past it
    new = tl.maximum(slot + 1 - recent, 0) // KG * KG
    if new > tl.maximum(slot - recent, 0) // KG * KG:
        PK: tl.constexpr = 8 // KBITS
        j = new - KG + tl.arange(0, KG)
        kx = tl.load(RK + b * srb + (j % RING)[:, None] * srs + h * srh + d[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)
        if ROTATED:
            kx = _rotate(kx, KG, BLOCK_D, HB, SCALE)
        valid = (j >= NS)[:, None]
        lo = tl.min(tl.where(valid, kx, float("inf")), axis=0)
        hi = tl.max(tl.where(valid, kx, float("-inf")), axis=0)
        empty = lo > hi  # nothing valid (a group of sinks): any range will do
        lo = tl.where(empty, 0.0, lo)
        hi = tl.where(empty, 0.0, hi)
        nk, sk, zk = _quantize(kx, lo[None, :], hi[None, :], KBITS, PTX)
        kbyte = _pack(nk, KG, BLOCK_D, KBITS)
        ck = tl.arange(0, BLOCK_D // PK)[None, :]
        tl.store(KQ + b * skqb + j[:, None] * skqs + h * skqh + ck, kbyte.to(tl.uint8), mask=ck < D // PK)
        ks = b * sksb + (new // KG - 1) * sksg + h * sksh + d[None, :]
        tl.store(KS + ks, sk, mask=dm[None, :])
        tl.store(KZ + ks, zk, mask=dm[None, :])
