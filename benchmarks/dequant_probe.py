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

    python benchmarks/dequant_probe.py [--block 64] [--warps 4] [--k-width 16]

Nothing here runs a kernel. lop3-asm is the low-bit kernel's own conversion (`_levels`), whose PTX
tests/ops/test_lowbit_ptx.py checks by emulation and the GPU cases of the kernel end to end.

What it says (docs/long_context.md): the per-level cost of the conversion is what bounds the
low-bit kernel, and only packed (two-level) fp16 operations bring it near one instruction a level;
Triton's elementwise ops do not pack them by themselves.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections import Counter

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from orthros.ops.cross_compile import signature
from orthros.ops.splitkv_lowbit_kernel import LEVELS4_PTX, _levels

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


def gluon_probe():
    """The probe as a Gluon kernel (built on first use: Gluon is experimental in Triton 3.6)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    PTX = gl.constexpr(LEVELS4_PTX.value)

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
            k0, k1 = gl.inline_asm_elementwise(asm=PTX, constraints="=r,=r,=r,=r,r", args=[kb],
                                               dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
            acc = mma_v2(q0, gl.convert_layout(k0, b_l), acc)
            acc = mma_v2(q1, gl.convert_layout(k1, b_l), acc)
        orow = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        ocol = gl.arange(0, BQ, layout=gl.SliceLayout(0, mma))
        gl.store(O + orow[:, None] * BQ + ocol[None, :], acc)

    return probe_gluon


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


def gluon_values_probe():
    """The value half as a Gluon kernel, warp-private keys (see the module docstring)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    PTX = gl.constexpr(LEVELS4_PTX.value)

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
            w0, w1 = gl.inline_asm_elementwise(asm=PTX, constraints="=r,=r,=r,=r,r", args=[vb],
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

    return probe_values_gluon


def sass_loop(kernel, args: list, meta: dict, warps: int, gluon: bool = False) -> tuple[int, Counter]:
    """(instructions in the sm_90 build's main loop, by opcode)."""
    sig, const, attrs = signature(kernel, args, meta)
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    c = triton.compile(Source(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with open("/tmp/orthros-dequant-probe.cubin", "wb") as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
    back = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
            and int(m.group(1), 16) < a]
    lo, hi = max(back, key=lambda x: x[1] - x[0])  # the longest backward branch: the key loop
    body = [t for a, t in ins if lo <= a <= hi]
    return len(body), Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def loop_counts(mode: int, block: int, warps: int, k_width: int = 16) -> tuple[int, Counter]:
    """The key half's loop for one conversion mode."""
    args = [torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(4096, 64, dtype=torch.uint8),
            torch.zeros(16, block), 64]
    if MODES[mode] == "gluon-lop3":
        return sass_loop(gluon_probe(), args, dict(BQ=block, KW=k_width, WARPS=warps), warps, gluon=True)
    return sass_loop(probe, args, dict(MODE=mode, BQ=block), warps)


def value_counts(mode: str, warps: int) -> tuple[int, Counter]:
    """The value half's loop (64 keys a tile)."""
    args = [torch.zeros(16, 64), torch.zeros(4096, 64, dtype=torch.uint8), torch.zeros(warps, 16, 128), 64]
    if mode == "gluon-values":
        return sass_loop(gluon_values_probe(), args, dict(WARPS=warps), warps, gluon=True)
    return sass_loop(probe_values, args, {}, warps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", type=int, default=64, help="keys a tile")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--k-width", type=int, default=16, choices=(4, 8, 16),
                   help="gluon-lop3: contiguous key bytes a thread loads (the operands' k_width)")
    args = p.parse_args()
    levels = args.block * 128 / (32 * args.warps)  # int4 levels a thread a tile
    print(f"| conversion | loop instructions a thread | a level | top opcodes |\n| --- | ---: | ---: | --- |")
    for i, name in enumerate(MODES):
        n, cnt = loop_counts(i, args.block, args.warps, args.k_width)
        print(f"| {name} | {n} | {n / levels:.2f} | " + ", ".join(f"{k} {v}" for k, v in cnt.most_common(6)) + " |")
    levels = 64 * 128 / (32 * 4)  # the value half: 64 keys x 128 channels, 4 warps
    print(f"\n| value half (64 keys, 4 warps) | loop instructions a thread | a level | top opcodes |\n"
          "| --- | ---: | ---: | --- |")
    for name in ("triton-values", "gluon-values"):
        n, cnt = value_counts(name, 4)
        print(f"| {name} | {n} | {n / levels:.2f} | " + ", ".join(f"{k} {v}" for k, v in cnt.most_common(8)) + " |")


if __name__ == "__main__":
    main()
