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


def loop_counts(mode: int, block: int, warps: int, k_width: int = 16) -> tuple[int, Counter]:
    """(instructions in the build's main loop, by opcode) for one probe mode."""
    args = [torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(4096, 64, dtype=torch.uint8),
            torch.zeros(16, block), 64]
    if MODES[mode] == "gluon-lop3":
        from triton.experimental.gluon._runtime import GluonASTSource

        kernel, meta = gluon_probe(), dict(BQ=block, KW=k_width, WARPS=warps)
        sig, const, attrs = signature(kernel, args, meta)
        src = GluonASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    else:
        sig, const, attrs = signature(probe, args, dict(MODE=mode, BQ=block))
        src = ASTSource(fn=probe, signature=sig, constexprs=const, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
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
    return len(body), Counter(re.sub(r"^@!?P\d+\s+", "", t).split()[0].split(".")[0] for t in body)


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


if __name__ == "__main__":
    main()
