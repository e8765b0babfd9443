"""How many instructions a thread spends per int4 level on the way into a tensor-core dot, for
ways of turning packed nibbles into dot operands, read from sm_90 builds made on this machine
(no GPU: `ops/cross_compile.py` + the Triton wheel's cuobjdump). Static counts, not timings.

The probe kernel is the key half of a low-bit decode tile: a [64 keys, 64 bytes] uint8 tile of
int4 levels (two a byte, bit planes) read in a loop and dotted with 16 query rows in fp16:

    fp32-trick   n | bits(2^23) as fp32, minus 2^23, to fp16 (the dequantizing loop's way)
    fp16-magic   n | 0x6400 as fp16 (1024 + n), minus 1024 in fp16
    fp16-offset  1024 + n as is (the offset folded out of the dot)
    lop3-asm     four levels of two bytes a lop3 in fp16 pairs (inline PTX, Marlin's trick):
                 2 prmt + 4 lop3 + 2 sub.f16x2 + 2 fma.f16x2 for 8 levels
    gluon-lop3   the same PTX in a Gluon kernel (`triton.experimental.gluon`) whose layouts are
                 chosen, not inferred: each thread loads --k-width contiguous key bytes (one
                 vector load) in exactly the registers the tensor-core B operand wants (mma_v2
                 with that k_width: A and B share the K permutation, so q's planes take it at no
                 cost), dequantizes them there, and keeps the query planes in registers; no
                 shared memory, no barrier in the loop

The value half (a second table): p [16 rows, 64 keys] (exp2 of a loaded block, as the softmax
makes it) times the int4 levels of 64 keys x 64 value bytes (two planes, 128 channels):

    triton-values  as the low-bit kernel stores values (a key's bytes together) and Triton lays out
    gluon-values   each warp owns 16 of the 64 keys ([4 warps, 16 rows, 16 keys] batched mma_v2, the
                   softmax's p reused as the A operand in its registers), and the bytes of 16 keys
                   are stored byte-major and key-permuted (storage 4t + 2h + e holds key 2t + e + 8h),
                   so one 32-bit load gives a thread the four keys its B fragment holds for a byte;
                   the permutation is a reshape / permute of the loaded tensor, free in registers

The whole packed tile (a third table): the low-bit kernel's own loop (int4, 64-key tiles, as it
builds) against `probe_tile`, the same work in Gluon: keys with the group's per-channel scale /
zero (stored plane-major here), the document mask, a per-warp online softmax (no cross-warp
reduction), values with the per-token scale folded into p and the zero as a per-row bias. It omits
the next tile's prefetch and the split bounds.

    python benchmarks/dequant_probe.py [--block 64] [--warps 4] [--k-width 16]

Nothing here runs a kernel, and a Gluon kernel has no interpreter path: the Gluon probes are
checked by their builds only (tests/bench/test_scripts.py: no barrier, no shared memory).
lop3-asm is the low-bit kernel's own conversion (`_levels`), whose PTX tests/ops/test_lowbit_ptx.py
checks by emulation and the GPU cases of the kernel end to end.

What it says (docs/long_context.md): the per-level cost of the conversion is what bounds the
low-bit kernel, and only packed (two-level) fp16 operations bring it near one instruction a level;
Triton's elementwise ops do not pack them by themselves.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from orthros.ops.cross_compile import build, main_loop_sass, ptxas_report
from orthros.ops.splitkv.lowbit_kernel import LEVELS4_PTX, _levels

MODES = ("fp32-trick", "fp16-magic", "fp16-offset", "lop3-asm", "gluon-lop3")


@triton.jit
def _nibbles_lop3(kb):
    """uint8 [..] -> (low, high nibbles) as fp16 levels, four bytes an asm call: the kernel's own PTX."""
    return _levels(kb, 4, True)


@triton.jit
def probe(Q, KB, O, sk, MODE: tl.constexpr, BQ: tl.constexpr):
    r = tl.arange(0, 16)
    c = tl.arange(0, 64)
    n = tl.arange(0, BQ)
    q0 = tl.load(Q + r[:, None] * 128 + 2 * c[None, :]).to(tl.float16)
    q1 = tl.load(Q + r[:, None] * 128 + 2 * c[None, :] + 1).to(tl.float16)
    acc = tl.zeros([16, BQ], tl.float32)
    for j0 in range(0, 4096, BQ):
        kb = tl.load(KB + (j0 + n)[:, None] * sk + c[None, :])
        if MODE == 0:
            k0 = (((kb & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.float16)
            k1 = (((kb >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.float16)
        elif MODE == 1:
            k0 = ((kb & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
            k1 = ((kb >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        elif MODE == 2:
            k0 = ((kb & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
            k1 = ((kb >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        else:
            k0, k1 = _nibbles_lop3(kb)
        acc += tl.dot(q0, tl.trans(k0)) + tl.dot(q1, tl.trans(k1))
    tl.store(O + r[:, None] * BQ + n[None, :], acc)


# ---- Gluon (triton.experimental.gluon): the same work with the layouts chosen, not inferred
GPTX = gl.constexpr(LEVELS4_PTX.value)


@gluon.jit
def probe_gluon(Q, KB, O, sk, BQ: gl.constexpr, KW: gl.constexpr, WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    # the key bytes as loaded: KW contiguous bytes (one key, channels c..c+KW) a thread
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[KW, 1], threads_per_warp=[64 // KW, 32 * KW // 64],
                                        warps_per_cta=[1, WARPS], order=[0, 1])
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, a_l))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, a_l))
    q0 = gl.load(Q + r[:, None] * 128 + 2 * c[None, :]).to(gl.float16)
    q1 = gl.load(Q + r[:, None] * 128 + 2 * c[None, :] + 1).to(gl.float16)
    kc = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    kn = gl.arange(0, BQ, layout=gl.SliceLayout(0, ld))
    acc = gl.zeros([16, BQ], gl.float32, layout=mma)
    for j0 in range(0, 4096, BQ):
        kb = gl.load(KB + (j0 + kn)[None, :] * sk + kc[:, None])  # [64 bytes, BQ keys]
        k0, k1 = gl.inline_asm_elementwise(asm=GPTX, constraints="=r,=r,=r,=r,r", args=[kb],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        acc = mma_v2(q0, gl.convert_layout(k0, b_l), acc)
        acc = mma_v2(q1, gl.convert_layout(k1, b_l), acc)
    orow = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, BQ, layout=gl.SliceLayout(0, mma))
    gl.store(O + orow[:, None] * BQ + ocol[None, :], acc)


@triton.jit
def probe_values(P, VB, O, sv):
    r = tl.arange(0, 16)
    n = tl.arange(0, 64)
    c = tl.arange(0, 64)
    s = tl.load(P + r[:, None] * 64 + n[None, :])
    a0 = tl.zeros([16, 64], tl.float32)
    a1 = tl.zeros([16, 64], tl.float32)
    for j0 in range(0, 4096, 64):
        p = tl.exp2(s - j0).to(tl.float16)
        w0, w1 = _nibbles_lop3(tl.load(VB + (j0 + n)[:, None] * sv + c[None, :]))
        a0 += tl.dot(p, w0)
        a1 += tl.dot(p, w1)
    tl.store(O + r[:, None] * 128 + 2 * c[None, :], a0)
    tl.store(O + r[:, None] * 128 + 2 * c[None, :] + 1, a1)


@gluon.jit
def probe_values_gluon(P, VB, O, sv, WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # [warp, 16 keys in storage order, 64 bytes]: four keys of one byte a thread, one 32-bit word
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 1], threads_per_warp=[1, 4, 8],
                                        warps_per_cta=[WARPS, 1, 1], order=[1, 2, 0])
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    s = gl.load(P + r[None, :, None] * 64 + w[:, None, None] * 16 + n[None, None, :])
    lw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld)))
    lk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld)))
    lc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld)))
    a0 = gl.zeros([WARPS, 16, 64], gl.float32, layout=mma)
    a1 = gl.zeros([WARPS, 16, 64], gl.float32, layout=mma)
    for j0 in range(0, 4096, 16 * WARPS):
        p = gl.convert_layout(gl.exp2(s - j0).to(gl.float16), a_l)
        vb = gl.load(VB + (j0 + 16 * lw)[:, None, None] * sv + lc[None, None, :] * 16 + lk[None, :, None])
        w0, w1 = gl.inline_asm_elementwise(asm=GPTX, constraints="=r,=r,=r,=r,r", args=[vb],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        # storage 4t + 2h + e -> key 2t + e + 8h: the B fragment's keys
        w0 = gl.reshape(gl.permute(gl.reshape(w0, [WARPS, 4, 2, 2, 64]), [0, 2, 1, 3, 4]), [WARPS, 16, 64])
        w1 = gl.reshape(gl.permute(gl.reshape(w1, [WARPS, 4, 2, 2, 64]), [0, 2, 1, 3, 4]), [WARPS, 16, 64])
        a0 = mma_v2(p, gl.convert_layout(w0, b_l), a0)
        a1 = mma_v2(p, gl.convert_layout(w1, b_l), a1)
    oc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    base = O + w[:, None, None] * 2048 + r[None, :, None] * 128 + 2 * oc[None, None, :]
    gl.store(base, a0)  # per warp: a partial sum (its keys), merged after the loop in a kernel
    gl.store(base + 1, a1)


@gluon.jit
def _lv(x):
    """Packed bytes -> the two planes' fp16 levels, four bytes an asm call (the kernel's PTX)."""
    return gl.inline_asm_elementwise(asm=GPTX, constraints="=r,=r,=r,=r,r", args=[x],
                                     dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


@gluon.jit
def _perm16(x, W: gl.constexpr, C: gl.constexpr):
    """storage 4t + 2h + e -> key 2t + e + 8h along axis 1 of [W, 16, C]"""
    return gl.reshape(gl.permute(gl.reshape(x, [W, 4, 2, 2, C]), [0, 2, 1, 3, 4]), [W, 16, C])


@gluon.jit
def probe_tile(Q, KB, KS, KZ, VB, VS, VZ, KDOC, QDOC, O, n_tiles, W: gl.constexpr, PREFETCH: gl.constexpr):
    """A whole int4 packed tile (see the module docstring), W warps of 16 keys each; PREFETCH: the
    next tile's key and value bytes loaded before this tile's work (carried by the loop)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    ka: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=16)
    kbl: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=16)
    va: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    vbl: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16, 1], threads_per_warp=[1, 4, 8], warps_per_cta=[W, 1, 1],
                                         order=[1, 2, 0])
    vld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 1], threads_per_warp=[1, 4, 8], warps_per_cta=[W, 1, 1],
                                         order=[1, 2, 0])
    row_l: gl.constexpr = gl.SliceLayout(2, mma)      # [W, rows]
    key_l: gl.constexpr = gl.SliceLayout(1, mma)      # [W, keys]
    # query planes (plane i: channels 2c + i), once, in the A operand's registers
    qa_w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, ka)))
    qa_r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ka)))
    qa_c = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, ka)))
    qp = Q + qa_w[:, None, None] * 0 + qa_r[None, :, None] * 128 + 2 * qa_c[None, None, :]  # every warp: all rows
    q0 = gl.load(qp)
    q1 = gl.load(qp + 1)
    # key bytes [W, 64 bytes, 16 keys]: 16 contiguous bytes of one key a thread
    kw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, kld)))
    kc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, kld)))
    kn = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, kld)))
    # key scales of the group, plane-major [2, 64], in the loaded bytes' order
    ksc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, kld)))
    # value bytes [W, 16 keys (storage order), 32 bytes] a channel group
    vw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, vld)))
    vk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, vld)))
    vc = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, vld)))
    # per-key vectors in the scores' layout
    sw = gl.arange(0, W, layout=gl.SliceLayout(1, key_l))
    sn = gl.arange(0, 16, layout=gl.SliceLayout(0, key_l))
    rr = gl.arange(0, 16, layout=gl.SliceLayout(0, row_l))
    qdoc = gl.load(QDOC + rr)
    m_i = gl.full([W, 16], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([W, 16], gl.float32, layout=row_l)
    z0 = gl.zeros([W, 16], gl.float32, layout=row_l)
    z1 = gl.zeros([W, 16], gl.float32, layout=row_l)
    a00 = gl.zeros([W, 16, 32], gl.float32, layout=mma)  # plane, group
    a01 = gl.zeros([W, 16, 32], gl.float32, layout=mma)
    a10 = gl.zeros([W, 16, 32], gl.float32, layout=mma)
    a11 = gl.zeros([W, 16, 32], gl.float32, layout=mma)
    kbn = gl.load(KB + (16 * kw[:, None, None] + kn[None, None, :]) * 64 + kc[None, :, None])
    vpn = VB + (16 * vw[:, None, None]) * 64 + vc[None, None, :] * 16 + vk[None, :, None]
    vb0n = gl.load(vpn)
    vb1n = gl.load(vpn + 512)
    for t in range(n_tiles):
        j0 = t * 16 * W
        # keys
        if PREFETCH:
            kb, vb0, vb1 = kbn, vb0n, vb1n
            j1 = j0 + 16 * W
            kbn = gl.load(KB + (j1 + 16 * kw[:, None, None] + kn[None, None, :]) * 64 + kc[None, :, None])
            vpn = VB + (j1 + 16 * vw[:, None, None]) * 64 + vc[None, None, :] * 16 + vk[None, :, None]
            vb0n = gl.load(vpn)
            vb1n = gl.load(vpn + 512)
        else:
            kb = gl.load(KB + (j0 + 16 * kw[:, None, None] + kn[None, None, :]) * 64 + kc[None, :, None])
            vp = VB + (j0 + 16 * vw[:, None, None]) * 64 + vc[None, None, :] * 16 + vk[None, :, None]
            vb0 = gl.load(vp)  # group 0: bytes 0..31
            vb1 = gl.load(vp + 512)  # group 1: bytes 32..63
        ks0 = gl.load(KS + t * 128 + ksc)
        ks1 = gl.load(KS + t * 128 + 64 + ksc)
        kz0 = gl.load(KZ + t * 128 + ksc)
        kz1 = gl.load(KZ + t * 128 + 64 + ksc)
        l0, l1 = _lv(kb)
        k0 = l0 * ks0[None, :, None] + kz0[None, :, None]
        k1 = l1 * ks1[None, :, None] + kz1[None, :, None]
        s = gl.zeros([W, 16, 16], gl.float32, layout=mma)
        s = mma_v2(q0, gl.convert_layout(k0, kbl), s)
        s = mma_v2(q1, gl.convert_layout(k1, kbl), s)
        # visibility (document of each key) and the per-warp online softmax
        kdoc = gl.load(KDOC + j0 + 16 * sw[:, None] + sn[None, :])
        vis = kdoc[:, None, :] == qdoc[None, :, None]
        s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, :, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=2)
        m_i = m_new
        # values: per-token scales folded into p, zeros as a per-row bias
        vso = (j0 + 16 * sw[:, None] + sn[None, :]) * 2
        vs0 = gl.load(VS + vso)
        vs1 = gl.load(VS + vso + 1)
        vz0 = gl.load(VZ + vso)
        vz1 = gl.load(VZ + vso + 1)
        z0 = z0 * alpha + gl.sum(p * vz0[:, None, :], axis=2)
        z1 = z1 * alpha + gl.sum(p * vz1[:, None, :], axis=2)
        p0 = gl.convert_layout((p * vs0[:, None, :]).to(gl.float16), va)
        p1 = gl.convert_layout((p * vs1[:, None, :]).to(gl.float16), va)
        w00, w10 = _lv(vb0)
        w01, w11 = _lv(vb1)
        al = alpha[:, :, None]
        a00 = mma_v2(p0, gl.convert_layout(_perm16(w00, W, 32), vbl), a00 * al)
        a10 = mma_v2(p0, gl.convert_layout(_perm16(w10, W, 32), vbl), a10 * al)
        a01 = mma_v2(p1, gl.convert_layout(_perm16(w01, W, 32), vbl), a01 * al)
        a11 = mma_v2(p1, gl.convert_layout(_perm16(w11, W, 32), vbl), a11 * al)
    ow = gl.arange(0, W, layout=gl.SliceLayout(1, row_l))
    oc = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    base = O + ow[:, None, None] * 4096 + rr[None, :, None] * 256 + oc[None, None, :]
    gl.store(base, a00 + z0[:, :, None])
    gl.store(base + 32, a10)
    gl.store(base + 64, a01 + z1[:, :, None])
    gl.store(base + 96, a11)
    gl.store(O + 65536 + ow[:, None] * 16 + rr[None, :], m_i)
    gl.store(O + 65536 + 1024 + ow[:, None] * 16 + rr[None, :], l_i)


def loop_counts(mode: int, block: int, warps: int, k_width: int = 16) -> tuple[int, dict]:
    """The key half's loop for one conversion mode."""
    args = [torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(4096, 64, dtype=torch.uint8),
            torch.zeros(16, block), 64]
    if MODES[mode] == "gluon-lop3":
        return main_loop_sass(build(probe_gluon, args, dict(BQ=block, KW=k_width, WARPS=warps, num_warps=warps)))
    return main_loop_sass(build(probe, args, dict(MODE=mode, BQ=block, num_warps=warps, num_stages=3)))


def value_counts(mode: str, warps: int) -> tuple[int, dict]:
    """The value half's loop (64 keys a tile)."""
    args = [torch.zeros(16, 64), torch.zeros(4096, 64, dtype=torch.uint8), torch.zeros(warps, 16, 128), 64]
    if mode == "gluon-values":
        return main_loop_sass(build(probe_values_gluon, args, dict(WARPS=warps, num_warps=warps)))
    return main_loop_sass(build(probe_values, args, dict(num_warps=warps, num_stages=3)))


def tile_counts(warps: int = 4) -> dict[str, tuple[tuple[int, dict], dict]]:
    """The whole packed tile: the low-bit kernel's own loop (Triton, int4, 64-key tiles) and the
    Gluon probe of the same work -> {name: ((loop instructions, opcodes), ptxas report)}."""
    from orthros.bench.lowbit_launches import lowbit_launch, loop_options
    from orthros.ops.splitkv.lowbit import MAXNREG, _kernel

    plan = lowbit_launch("int4", block_n=64, num_warps=warps, num_stages=3, **loop_options("planar-f16"))
    u8, f16, i32 = torch.uint8, torch.float16, torch.int32
    args = [torch.zeros(16, 128, dtype=f16), torch.zeros(4096, 64, dtype=u8), torch.zeros(8192, dtype=f16),
            torch.zeros(8192, dtype=f16), torch.zeros(4096, 64, dtype=u8), torch.zeros(8192, dtype=f16),
            torch.zeros(8192, dtype=f16), torch.zeros(4096, dtype=i32), torch.zeros(16, dtype=i32),
            torch.zeros(70000), 64]
    builds = {"low-bit kernel (Triton)": build(_kernel(), plan.args, dict(plan.meta, maxnreg=MAXNREG)),  # as on a GPU
              "gluon-tile": build(probe_tile, args, dict(W=warps, PREFETCH=False, num_warps=warps)),
              "gluon-tile, next tile's bytes prefetched": build(probe_tile, args, dict(W=warps, PREFETCH=True,
                                                                                       num_warps=warps))}
    return {name: (main_loop_sass(c), ptxas_report(c.asm["ptx"])) for name, c in builds.items()}


def top(ops: dict, n: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:n])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", type=int, default=64, help="keys a tile")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--k-width", type=int, default=16, choices=(4, 8, 16),
                   help="gluon-lop3: contiguous key bytes a thread loads (the operands' k_width)")
    args = p.parse_args()
    levels = args.block * 128 / (32 * args.warps)  # int4 levels a thread a tile
    print("| conversion | loop instructions a thread | a level | top opcodes |\n| --- | ---: | ---: | --- |")
    for i, name in enumerate(MODES):
        n, cnt = loop_counts(i, args.block, args.warps, args.k_width)
        print(f"| {name} | {n} | {n / levels:.2f} | {top(cnt, 6)} |")
    levels = 64 * 128 / (32 * 4)  # the value half: 64 keys x 128 channels, 4 warps
    print("\n| value half (64 keys, 4 warps) | loop instructions a thread | a level | top opcodes |\n"
          "| --- | ---: | ---: | --- |")
    for name in ("triton-values", "gluon-values"):
        n, cnt = value_counts(name, 4)
        print(f"| {name} | {n} | {n / levels:.2f} | {top(cnt, 8)} |")
    print("\n| whole packed tile (int4, 64 keys, 4 warps) | loop instructions a thread | registers (spilled bytes) "
          "| top opcodes |\n| --- | ---: | ---: | --- |")
    for name, ((n, cnt), regs) in tile_counts(4).items():
        print(f"| {name} | {n} | {regs['registers']} ({regs['spill_bytes']}) | {top(cnt, 12)} |")


if __name__ == "__main__":
    main()
