"""The packed part of a low-bit split-KV read, in Gluon (`triton.experimental.gluon`): the
slots [sinks, bound) of a `LowBitStaticCache` layer, for the output rows of a decode step, with
every register layout chosen. What the Triton kernel (`lowbit_kernel.py`) spends its
instructions on there is layout traffic: levels moved between threads and through shared
memory to reach the tensor cores' operand layouts. Here each thread loads exactly the packed
words its operand registers hold, turns them into fp16 levels in place (inline PTX: prmt and
and, 0.5-0.75 instructions a level) and feeds them to `mma_v2` as they are.

One warp a program, one (row, KV head, split) each; a split is a run of 64-slot tiles (a tile
lies inside one key group). For a tile, with the G query heads of the KV head (and the M rows)
as the N = 8 columns of every product ("swapped": keys and channels are the M side, so the few
query rows cost 8 columns, not 16):

    levels    a field's bits as they lie in the word, read as an fp16: the subnormal w n 2^-24,
              exact (w = 16^h for int4's high nibbles, 4^i for int2's fields); 2^24 and 1 / w are
              applied once in fp32 (SUBNORMAL_SCALE, below).
    keys      S [keys, rows] = sum over bit planes of L_p [keys, units] @ q'_p [units, rows]
              + bias: the key group's per-channel scale s is folded into the query, q' = q s / w
              (fp16), so a level is never dequantized; bias = q.z (the zeros broadcast over rows,
              by the tensor cores), a per-row constant of the tile, added to the max and inside
              the exponent, never to a score.
    softmax   online, per program (no cross-warp state), in log2 units, rescaled lazily (only when
              the max grows by more than 2^8).
    values    O^T [channels, rows] += L^T [channels, keys] @ p'' [keys, rows] per value group:
              p'' = p * s_v * c (the token's scale folded into p; c a power of two near 1 / the
              largest scale, carried in the accumulators' rescale like the softmax max, so that
              small scales do not push p'' into fp16's subnormals), the zeros as sum(p z_v)
              (fp32, per thread, reduced once at the end).

Packed words: a "unit" is the 8 channels c = 8u .. 8u + 7 of a slot (an int32 word of int4 levels,
an int16 of int2 levels; `ops/lowbit/format.py` packs the lowest bits first, so plane p of a unit is
channel 8u + p). Keys: a thread holds 4 consecutive units of a slot (one 16-byte load for int4,
8 bytes for int2), two units a register pair; values: a thread holds one unit of 4 slots of a
value group, two slots a register pair.

Outputs: the program's part of o [B, P, M, H, 2, D] (fp32; part 1 only, the packed slots' in V R
space; part 0 belongs to the bf16 split) and lse [B, P, M, H] (natural log) at split
`split0 + program_id(1)`, for the rows from row0 on (windowed rows are neither read nor written),
merged with the other splits by `ops.splitkv.lowbit.finish`.

Requirements (the launcher checks them): CUDA sm_80+, head size 64 or 128, value groups of 64,
key groups a multiple of 64, 16-bit queries, at most 8 output rows a KV head.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Gluon's names moved between Triton releases: cp.async into shared memory is `async_load` from Triton
# 3.9 on (the older name raises there), the CTA barrier `barrier` (`thread_barrier` before)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK = gl.constexpr(64)  # slots a tile
ROWS = gl.constexpr(8)  # query rows a program (the N of every product)


def _pair4_ptx() -> str:
    """Two int32 units ($8, $9: the same channels of two slots, or two units of one slot) -> the 8
    planes' levels, plane p in $p: lane 0 from $8, lane 1 from $9, the fp16 bit pattern n (even p)
    or 16 n (odd p): the subnormal n w 2^-24, exact. prmt brings byte b of each word to the low
    byte of a lane, an and keeps one nibble."""
    lines = [".reg .b32 t;"]
    for b in range(4):
        lines.append(f"prmt.b32 t, $8, $9, 0x{0x4400 + 0x1111 * b:04x};")
        lines.append(f"and.b32 ${2 * b}, t, 0x000f000f;")
        lines.append(f"and.b32 ${2 * b + 1}, t, 0x00f000f0;")
    return "{\n" + "\n".join(lines) + "\n}"


def _pair2_ptx() -> str:
    """Two int16 units in one register ($8: lane 0, lane 1) -> the 8 planes' levels, plane p in $p:
    the fp16 bit pattern 4^(p % 4) n (n w 2^-24). Fields 0-3 of each lane by masks, then the
    register shifted by 8 (the high lane's low byte lands in the low lane's high byte, which no
    mask reads)."""
    lines = [".reg .b32 t;"]
    for i in range(4):
        lines.append(f"and.b32 ${i}, $8, 0x{(3 << 2 * i) * 0x10001:08x};")
    lines.append("shr.b32 t, $8, 8;")
    for i in range(4):
        lines.append(f"and.b32 ${4 + i}, t, 0x{(3 << 2 * i) * 0x10001:08x};")
    return "{\n" + "\n".join(lines) + "\n}"


# Levels as fp16 subnormals: a field's bits as they lie are the fp16 w n 2^-24, exactly (w n < 1024),
# one and a level pair, and no offset. Earlier forms or'd in the exponent of 1024 (1024 + w n) and
# took 1024 times the operand's sum off afterwards: in a product accumulating over a long row the
# tensor cores' fp32 accumulation (truncating below the largest partial sum) lost the levels' low
# bits against that offset (relative errors 0.02 - 0.06 at 70,000 slots on an H200, 2026-12-03);
# taking it off in fp16 first cost an instruction a level pair. The tensor cores take fp16
# subnormal operands as they are (they do not flush them); SUBNORMAL_SCALE undoes 2^-24 in fp32.
PAIR4 = gl.constexpr(_pair4_ptx())
PAIR2 = gl.constexpr(_pair2_ptx())
SUBNORMAL_SCALE = gl.constexpr(2.0 ** 24)
C4 = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r")
C2 = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r")
F8 = gl.constexpr((gl.float16,) * 8)


@gluon.jit
def _planes(x, BITS: gl.constexpr):
    """Units x (int32 for 4 bits, int16 for 2) -> their 8 planes' levels (fp16 subnormals w n 2^-24)."""
    if BITS == 4:
        return gl.inline_asm_elementwise(PAIR4, C4, [x], dtype=F8, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(PAIR2, C2, [x], dtype=F8, is_pure=True, pack=2)


@gluon.jit
def _opaque(x):
    """x, hidden from the compiler's loop analysis: addresses computed from it are recomputed from the
    tile's base each iteration instead of being carried across iterations as one 64-bit pointer per
    loaded vector (which spent two moves a pointer a tile on an sm_90 build)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _stack8(x0, x1, x2, x3, x4, x5, x6, x7):
    """8 tensors [A, B] -> [A, B, 8] (the 8 planes as a last, in-register axis)."""
    x = gl.join(gl.join(gl.join(x0, x4), gl.join(x2, x6)), gl.join(gl.join(x1, x5), gl.join(x3, x7)))
    return gl.reshape(x, [x.shape[0], x.shape[1], 8])  # index 4e + 2f + g of [.., e, f, g] is plane p


@gluon.jit
def _unit_weight(p, BITS: gl.constexpr):
    """1 / w of plane p (the weight its level carries: 16^(p % 2) for 4 bits, 4^(p % 4) for 2)."""
    if BITS == 4:
        return gl.where(p % 2 == 1, 0.0625, 1.0)
    else:
        e = p % 4
        return gl.where(e == 0, 1.0, gl.where(e == 1, 0.25, gl.where(e == 2, 0.0625, 0.015625)))


def layouts(NU: int, KW: int, key_bits: int, value_bits: int) -> dict:
    """The register layouts the loads take (constexprs of `lowbit_packed_fwd`).

    KSL, the key scales as a linear layout over [NU units, 8 planes, ROWS]: a thread holds KW
    consecutive units with all 8 planes of each (one 16-byte load a unit) for the row of its lane
    group, as the key product's B operand wants them. CPK / CPV / CPS / CP1, the copies a tile ahead
    (PIPE): every thread copies 16 contiguous bytes of key / value units (a unit is `bits` bytes: 8
    channels) or key scales, or 4-byte per-slot words (documents, value scale pairs)."""
    from triton.experimental.gluon.language import BlockedLayout, DistributedLinearLayout

    unit_regs = [[1 << i, 0, 0] for i in range(KW.bit_length() - 1)]
    kscale = DistributedLinearLayout(reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0]] + unit_regs,
                                     lane_bases=[[KW, 0, 0], [2 * KW, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                     warp_bases=[], block_bases=[], shape=[NU, 8, 8])

    def rows(bits):
        vec = 16 // bits  # units a 16-byte chunk
        tpr = max(1, NU // vec)
        return BlockedLayout([1, min(vec, NU)], [32 // tpr, tpr], [1, 1], [1, 0])

    return dict(KSL=kscale, CPK=rows(key_bits), CPV=rows(value_bits), CPS=BlockedLayout([8], [32], [1], [0]),
                CP1=BlockedLayout([2], [32], [1], [0]))


@gluon.jit
def _halves(x):
    """int32 -> its low and high fp16 halves (two value groups' scales, loaded as one word)."""
    return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


@gluon.jit
def lowbit_packed_fwd(QR, KQ, VQ, KS, KZ, VS, VZ, QDOC, KDOC, BOUND, O, LSE,
                      sqb, sqm, sqh, skqb, kstride, skqh, svqb, vstride, svqh,
                      sksb, ksg, sksh, svsb, svss, svsh, s_qdoc_b, s_kdoc_b,
                      sob, sop, som, soh, sox, slb, slp, slm,
                      M, Hkv, NS, KG, qscale, row0, split0, tiles_per_split,
                      G: gl.constexpr, NU: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr,
                      KW: gl.constexpr, KSL: gl.constexpr, PIPE: gl.constexpr, CPK: gl.constexpr,
                      CPV: gl.constexpr, CPS: gl.constexpr, CP1: gl.constexpr):
    NG: gl.constexpr = NU // 8  # value groups (64 channels, 8 units)
    KTY: gl.constexpr = gl.int32 if KBITS == 4 else gl.int16
    VTY: gl.constexpr = gl.int32 if VBITS == 4 else gl.int16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ka: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    kb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    za: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    zb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    va: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    vb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # key units [16 slots, NU] (KW consecutive units a thread); value units [8 units, 16 slots] (2 slots a register)
    kld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, KW], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                         order=[1, 0])
    vld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                         order=[1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(0, mma)  # [ROWS]: a column of the accumulators
    keys_l: gl.constexpr = gl.SliceLayout(1, mma)  # [16]: a sub-tile's slots (rows of the scores)

    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid // Hkv).to(gl.int64)
    kvh = pid % Hkv
    nrows = G * (M - row0)

    # ---- the query rows (r -> m = row0 + r // G, head kvh * G + r % G), in two forms:
    # qw [NU, 8, ROWS] (channel 8u + p, times 1 / w_p; q' = qw * the key group's scales, then B operand
    # of the key product with K = p * NU + u), qz [D, ROWS] (channel order; B of the zeros' product)
    u3 = gl.arange(0, NU, layout=gl.SliceLayout(1, gl.SliceLayout(2, KSL)))
    p3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, KSL)))
    r3 = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, KSL)))
    ch3 = 8 * u3[:, None, None] + p3[None, :, None]
    row_off3 = (row0 + r3 // G) * sqm + (kvh * G + r3 % G) * sqh
    qf3 = gl.load(QR + b * sqb + row_off3[None, None, :] + ch3, mask=(r3 < nrows)[None, None, :],
                  other=0.0).to(gl.float32) * qscale
    big = gl.max(gl.max(gl.max(gl.abs(qf3), axis=2), axis=1), axis=0)
    pre = gl.where(big > 16384.0, gl.exp2(14.0 - gl.ceil(gl.log2(big))), 1.0)  # a power of two: exact
    unscale = SUBNORMAL_SCALE / pre  # raw scores (units of 2^-24 times the pre-scale) -> log2 units
    qw = (qf3 * (pre * _unit_weight(p3, KBITS))[None, :, None]).to(gl.float16)
    zk = gl.arange(0, 8 * NU, layout=gl.SliceLayout(1, zb))
    zr = gl.arange(0, ROWS, layout=gl.SliceLayout(0, zb))
    qz = gl.load(QR + b * sqb + ((row0 + zr // G) * sqm + (kvh * G + zr % G) * sqh)[None, :] + zk[:, None],
                 mask=(zr < nrows)[None, :], other=0.0).to(gl.float32) * (qscale * pre)
    qz = qz.to(gl.float16)
    zc = gl.arange(0, 8 * NU, layout=gl.SliceLayout(0, za))
    zfill = gl.zeros([16, 8 * NU], gl.float16, layout=za)

    r = gl.arange(0, ROWS, layout=rows_l)
    rvalid = r < nrows
    qdoc = gl.load(QDOC + b * s_qdoc_b + row0 + r // G, mask=rvalid, other=-3).to(gl.int32)

    # ---- loop-invariant offsets (32-bit) within a tile; each tile's bases are 64-bit scalars
    ks_i = gl.arange(0, 16, layout=gl.SliceLayout(1, kld))
    ku_i = gl.arange(0, NU, layout=gl.SliceLayout(0, kld))
    koff = ks_i[:, None] * kstride + ku_i[None, :]  # [16, NU]: slot s of a sub-tile, unit u
    vu_i = gl.arange(0, 8, layout=gl.SliceLayout(1, vld))
    vs_i = gl.arange(0, 16, layout=gl.SliceLayout(0, vld))
    voff = vs_i[None, :] * vstride + vu_i[:, None]  # [8, 16]: unit i of group 0, slot s
    sk_i = gl.arange(0, 16, layout=keys_l)
    KQ_b = (KQ + b * skqb + kvh * skqh).to(gl.pointer_type(KTY))
    VQ_b = (VQ + b * svqb + kvh * svqh).to(gl.pointer_type(VTY))
    KS_b = KS + b * sksb + kvh * sksh
    KZ_b = KZ + b * sksb + kvh * sksh
    VS_b = VS + b * svsb + kvh * svsh
    VZ_b = VZ + b * svsb + kvh * svsh
    if NG == 2:  # a slot's two groups' scales (zeros) as one word
        VS_b = VS_b.to(gl.pointer_type(gl.int32), bitcast=True)
        VZ_b = VZ_b.to(gl.pointer_type(gl.int32), bitcast=True)
        vsl = sk_i * (svss // 2)
    else:
        vsl = sk_i * svss
    KDOC_b = (KDOC + b * s_kdoc_b).to(gl.pointer_type(gl.int32))  # the low words of int64 documents

    # ---- this split's tiles of [NS, bound)
    bound = gl.load(BOUND).to(gl.int32)
    t_lo = gl.maximum(split * tiles_per_split, NS // BLOCK)
    t_hi = gl.minimum((split + 1) * tiles_per_split, (bound + BLOCK - 1) // BLOCK)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_l)  # the running max (raw score units)
    c_i = gl.sum(gl.zeros([ROWS], gl.float32, layout=rows_l), axis=0)  # the accumulators' unit (0: none yet)
    l_acc = gl.zeros([16, ROWS], gl.float32, layout=mma)  # per-thread partial sums (reduced at the end)
    z_acc0 = gl.zeros([16, ROWS], gl.float32, layout=mma)
    z_acc1 = gl.zeros([16, ROWS], gl.float32, layout=mma)
    o_acc0 = gl.zeros([64, ROWS], gl.float32, layout=mma)  # group 0: row 8 p + i -> channel 8 i + p
    o_acc1 = gl.zeros([64, ROWS], gl.float32, layout=mma)  # group 1 (head size 128)

    if PIPE:  # the tile's bytes copied to shared memory a tile ahead (cp.async, two stages)
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])  # [stage, 64 slots, NU]: a stage's
        SH2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # [stage, n]
        sk = gl.allocate_shared_memory(KTY, [2, BLOCK, NU], SH)
        sv = gl.allocate_shared_memory(VTY, [2, BLOCK, NU], SH)
        sks = gl.allocate_shared_memory(gl.float16, [2, 8 * NU], SH2)
        skz = gl.allocate_shared_memory(gl.float16, [2, 8 * NU], SH2)
        sd = gl.allocate_shared_memory(gl.int32, [2, BLOCK], SH2)
        svs = gl.allocate_shared_memory(VS_b.dtype.element_ty, [2, BLOCK], SH2)
        svz = gl.allocate_shared_memory(VS_b.dtype.element_ty, [2, BLOCK], SH2)
        cr = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, CPK))
        cu = gl.arange(0, NU, layout=gl.SliceLayout(0, CPK))
        kcp = cr[:, None] * kstride + cu[None, :]
        cr = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, CPV))
        cu = gl.arange(0, NU, layout=gl.SliceLayout(0, CPV))
        vcp = cr[:, None] * vstride + cu[None, :]
        scp = gl.arange(0, 8 * NU, layout=CPS)
        c1 = gl.arange(0, BLOCK, layout=CP1)
        _issue(t_lo, t_lo < t_hi, 0, sk, sv, sks, skz, sd, svs, svz, KQ_b, VQ_b, KS_b, KZ_b, KDOC_b, VS_b, VZ_b,
               kcp, vcp, scp, c1, kstride, vstride, ksg, svss, KG, NG)
    for t in range(t_lo, t_hi):
        j0 = _opaque(t * BLOCK)
        if PIPE:
            st = (t - t_lo) % 2
            _barrier()  # every thread is done reading the other stage (the tile before)
            _issue(t + 1, t + 1 < t_hi, 1 - st, sk, sv, sks, skz, sd, svs, svz, KQ_b, VQ_b, KS_b, KZ_b, KDOC_b,
                   VS_b, VZ_b, kcp, vcp, scp, c1, kstride, vstride, ksg, svss, KG, NG)
            async_copy.wait_group(1)  # this tile's copies are in (this thread's) ...
            _barrier()  # ... and every thread's
            ks3 = sks.index(st).reshape([NU, 8]).load(gl.SliceLayout(2, KSL))[:, :, None]
            kz = skz.index(st).load(gl.SliceLayout(0, za))
            kw0, kw1, kw2, kw3 = _sub_tiles(sk.index(st), 0, kld)
            kd0, kd1, kd2, kd3 = _sub_tiles(sd.index(st), 0, keys_l)
            vs0, vs1, vs2, vs3 = _sub_tiles(svs.index(st), 0, keys_l)
            vz0, vz1, vz2, vz3 = _sub_tiles(svz.index(st), 0, keys_l)
            svt = sv.index(st).permute([1, 0])  # [NU units, 64 slots]
            va0, va1, va2, va3 = _sub_tiles(svt.slice(0, 8, dim=0), 1, vld)
            if NG == 2:
                vb0, vb1, vb2, vb3 = _sub_tiles(svt.slice(8, 8, dim=0), 1, vld)
            else:
                vb0, vb1, vb2, vb3 = va0, va1, va2, va3
        else:  # every load of the tile first (one exposure of the memory latency a tile)
            grp = (j0 // KG).to(gl.int64) * ksg
            ks3 = gl.load(KS_b + grp + ch3)  # [NU, 8, ROWS]: one 16-byte load a unit (rows alike)
            kz = gl.load(KZ_b + grp + zc)
            kw0, kw1, kw2, kw3 = _direct4(KQ_b + j0.to(gl.int64) * kstride, 16 * kstride, koff)
            kd0, kd1, kd2, kd3 = _direct4(KDOC_b + 2 * j0, 32, 2 * sk_i)
            vs0, vs1, vs2, vs3 = _direct4(VS_b + j0.to(gl.int64) * (svss // NG), 16 * (svss // NG), vsl)
            vz0, vz1, vz2, vz3 = _direct4(VZ_b + j0.to(gl.int64) * (svss // NG), 16 * (svss // NG), vsl)
            VQ_t = VQ_b + j0.to(gl.int64) * vstride
            va0, va1, va2, va3 = _direct4(VQ_t, 16 * vstride, voff)
            if NG == 2:
                vb0, vb1, vb2, vb3 = _direct4(VQ_t + 8, 16 * vstride, voff)
            else:
                vb0, vb1, vb2, vb3 = va0, va1, va2, va3
        # q' of this key group (fp16: q * s / w) and the bias q.z, by the tensor cores
        qs = gl.convert_layout(gl.reshape(gl.permute(qw * ks3, [1, 0, 2]), [8 * NU, ROWS]), kb)
        # (off the scores' dependency chain: the bias is a per-row constant of the tile, added to the
        # max and inside the exponent, never to a score)
        zbr = gl.broadcast(kz[None, :], zfill)[0]
        zero = gl.zeros([16, ROWS], gl.float32, layout=mma)
        bias = mma_v2(zbr, qz, zero) * (1.0 / SUBNORMAL_SCALE)  # [16, ROWS] raw units, its rows alike
        # raw scores without the bias; a packed slot is visible to a row of the same document (slots
        # below NS are sinks)
        s0 = _masked(_scores(kw0, qs, zero, KBITS, NU, ka), kd0, j0 + sk_i >= NS, qdoc)
        s1 = _masked(_scores(kw1, qs, zero, KBITS, NU, ka), kd1, j0 + 16 + sk_i >= NS, qdoc)
        s2 = _masked(_scores(kw2, qs, zero, KBITS, NU, ka), kd2, j0 + 32 + sk_i >= NS, qdoc)
        s3 = _masked(_scores(kw3, qs, zero, KBITS, NU, ka), kd3, j0 + 48 + sk_i >= NS, qdoc)
        smax = gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)) + bias, axis=0)
        # value scales [16] of the 4 sub-tiles and groups; the tile's largest
        s00, s01 = _value_pair(vs0, NG)
        s10, s11 = _value_pair(vs1, NG)
        s20, s21 = _value_pair(vs2, NG)
        s30, s31 = _value_pair(vs3, NG)
        vmax = gl.max(gl.maximum(gl.maximum(gl.maximum(s00, s01), gl.maximum(s10, s11)),
                                 gl.maximum(gl.maximum(s20, s21), gl.maximum(s30, s31))), axis=0)
        # lazy rescale, without a branch: the units change only when the max grows by more than 2^8 or
        # the value scales leave [2^-6, 2] of the unit (c: exact powers of two); else the factor is 1
        grow = gl.max(gl.where(smax > m_i, smax - m_i, 0.0), axis=0) * unscale
        vc = vmax * c_i
        need = (grow > 8.0) | (vc > 2.0) | (vc < 0.015625)
        m_new = gl.where(need, gl.maximum(m_i, smax), m_i)
        c_new = gl.where(need, gl.exp2(-gl.ceil(gl.log2(gl.maximum(vmax, 1e-30)))), c_i)
        m_ok = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2((gl.where(m_i == float("-inf"), m_ok, m_i) - m_ok) * unscale)
        resc = alpha * gl.where(c_i > 0, c_new / gl.maximum(c_i, 1e-30), 1.0)
        m_i = m_new
        c_i = c_new
        o_acc0 = o_acc0 * resc[None, :]
        o_acc1 = o_acc1 * resc[None, :]
        l_acc = l_acc * alpha[None, :]
        z_acc0 = z_acc0 * alpha[None, :]
        z_acc1 = z_acc1 * alpha[None, :]
        bm = bias * unscale - (m_ok * unscale)[None, :]  # [16, ROWS]: p = exp2(s * unscale + bm)
        l_acc, z_acc0, z_acc1, o_acc0, o_acc1 = _values(s0, s00, s01, vz0, va0, vb0, bm, unscale, c_i,
                                                        l_acc, z_acc0, z_acc1, o_acc0, o_acc1, VBITS, NG, va, vb)
        l_acc, z_acc0, z_acc1, o_acc0, o_acc1 = _values(s1, s10, s11, vz1, va1, vb1, bm, unscale, c_i,
                                                        l_acc, z_acc0, z_acc1, o_acc0, o_acc1, VBITS, NG, va, vb)
        l_acc, z_acc0, z_acc1, o_acc0, o_acc1 = _values(s2, s20, s21, vz2, va2, vb2, bm, unscale, c_i,
                                                        l_acc, z_acc0, z_acc1, o_acc0, o_acc1, VBITS, NG, va, vb)
        l_acc, z_acc0, z_acc1, o_acc0, o_acc1 = _values(s3, s30, s31, vz3, va3, vb3, bm, unscale, c_i,
                                                        l_acc, z_acc0, z_acc1, o_acc0, o_acc1, VBITS, NG, va, vb)

    if PIPE:
        async_copy.wait_group(0)  # the last (empty) group
    # ---- the program's partial result: o = (acc / w / c + sum(p z)) / l
    l_i = gl.sum(l_acc, axis=0)
    seen = l_i > 0
    linv = 1.0 / gl.where(seen, l_i, 1.0)
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i) * unscale
    lse = gl.where(seen, (m_fin + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    cinv = 1.0 / gl.maximum(c_i, 1e-30)
    out_m = row0 + r // G
    out_h = kvh * G + r % G
    obase = O + b * sob + (split0 + split) * sop + out_m * som + out_h * soh  # [ROWS] in rows_l
    ci = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    ch = 8 * (ci % 8) + ci // 8  # accumulator row 8 p + i -> channel 8 i + p of the group
    wv = _unit_weight(ci // 8, VBITS) * cinv * SUBNORMAL_SCALE
    _store_group(obase, o_acc0, z_acc0, wv, ch, linv, rvalid, sox)
    if NG == 2:
        _store_group(obase + 64, o_acc1, z_acc1, wv, ch, linv, rvalid, sox)
    gl.store(LSE + b * slb + (split0 + split) * slp + out_m * slm + out_h, lse, mask=rvalid)


@gluon.jit
def _direct4(base, step, off):
    """The 4 sub-tiles of a tile from global memory: base + i * step + off, i < 4."""
    return (gl.load(base + off), gl.load(base + step + off), gl.load(base + 2 * step + off),
            gl.load(base + 3 * step + off))


@gluon.jit
def _sub_tiles(buf, dim: gl.constexpr, layout: gl.constexpr):
    """A shared tile's 4 sub-tiles of 16 slots (slots along `dim`), loaded in `layout`."""
    return (buf.slice(0, 16, dim=dim).load(layout), buf.slice(16, 16, dim=dim).load(layout),
            buf.slice(32, 16, dim=dim).load(layout), buf.slice(48, 16, dim=dim).load(layout))


@gluon.jit
def _issue(t, valid, st, sk, sv, sks, skz, sd, svs, svz, KQ_b, VQ_b, KS_b, KZ_b, KDOC_b, VS_b, VZ_b,
           kcp, vcp, scp, c1, kstride, vstride, ksg, svss, KG, NG: gl.constexpr):
    """Copy tile t's bytes (zeros past the split: valid False) into stage st, as one group."""
    jt = _opaque(t * BLOCK)
    grp = (jt // KG).to(gl.int64) * ksg  # (a 32-bit division: a 64-bit one is a call)
    j0 = jt.to(gl.int64)
    _async_load(sk.index(st), KQ_b + j0 * kstride + kcp, mask=valid)
    _async_load(sv.index(st), VQ_b + j0 * vstride + vcp, mask=valid)
    _async_load(sks.index(st), KS_b + grp + scp, mask=valid)
    _async_load(skz.index(st), KZ_b + grp + scp, mask=valid)
    _async_load(sd.index(st), KDOC_b + 2 * (j0 + c1), mask=valid)
    vstep = svss // NG
    _async_load(svs.index(st), VS_b + (j0 + c1) * vstep, mask=valid)
    _async_load(svz.index(st), VZ_b + (j0 + c1) * vstep, mask=valid)
    async_copy.commit_group()


@gluon.jit
def _store_group(obase, acc, z, wv, ch, linv, rvalid, sox):
    zr = gl.sum(z, axis=0)
    o = (acc * wv[:, None] + zr[None, :]) * linv[None, :]
    gl.store(obase[None, :] + sox + ch[:, None], o, mask=rvalid[None, :])


@gluon.jit
def _scores(w, qs, bias, KBITS: gl.constexpr, NU: gl.constexpr, ka: gl.constexpr):
    """Raw scores [16 slots, ROWS] (log2 units times the query pre-scale) of key units w [16, NU]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _planes(w, KBITS)
    x = gl.reshape(gl.permute(_stack8(x0, x1, x2, x3, x4, x5, x6, x7), [0, 2, 1]), [16, 8 * NU])
    return mma_v2(gl.convert_layout(x, ka), qs, bias)


@gluon.jit
def _masked(s, kdoc, jv, qdoc):
    return gl.where((kdoc[:, None] == qdoc[None, :]) & jv[:, None], s, float("-inf"))


@gluon.jit
def _value_pair(x, NG: gl.constexpr):
    """A sub-tile's value scales (zeros) as loaded -> groups 0 and 1, fp32 [16] each."""
    if NG == 2:
        a, b = _halves(x)
        return a.to(gl.float32), b.to(gl.float32)
    else:
        a = x.to(gl.float32)
        return a, a


@gluon.jit
def _values(s, vs0, vs1, vz, wa, wb, bm, unscale, c_i, l_acc, z_acc0, z_acc1, o_acc0, o_acc1,
            VBITS: gl.constexpr, NG: gl.constexpr, va: gl.constexpr, vb: gl.constexpr):
    """16 slots' values: p, its sums, and the products into the group accumulators (wa, wb: the
    groups' value units [8, 16 slots])."""
    p = gl.exp2(s * unscale + bm)  # [16 slots, ROWS]
    l_acc = l_acc + p
    z0, z1 = _value_pair(vz, NG)
    z_acc0 = z_acc0 + p * z0[:, None]
    pa = gl.convert_layout((p * (vs0 * c_i)[:, None]).to(gl.float16), vb)
    o_acc0 = _group_product(wa, pa, o_acc0, VBITS, va)
    if NG == 2:
        z_acc1 = z_acc1 + p * z1[:, None]
        pb = gl.convert_layout((p * (vs1 * c_i)[:, None]).to(gl.float16), vb)
        o_acc1 = _group_product(wb, pb, o_acc1, VBITS, va)
    return l_acc, z_acc0, z_acc1, o_acc0, o_acc1


@gluon.jit
def _group_product(w, pg, acc, VBITS: gl.constexpr, va: gl.constexpr):
    """acc [64 (8 p + i), ROWS] += w_p * levels of units w [8 (i), 16 slots], plane p, @ pg [16 slots, ROWS]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _planes(w, VBITS)
    x = gl.reshape(gl.permute(_stack8(x0, x1, x2, x3, x4, x5, x6, x7), [2, 0, 1]), [64, 16])
    return mma_v2(gl.convert_layout(x, va), pg, acc)
