"""The inline PTX of the low-bit kernel's level conversion (`ops/splitkv/lowbit_kernel.py`,
LEVELS4_PTX / LEVELS2_PTX, made by `_levels_ptx`) against the map it stands for, by emulating each of its instructions
on every byte value. The interpreter runs the kernel with the plain-op twin of that map, so
this is the CPU check of the PTX itself (the GPU run of the kernel cases checks it end to end)."""

import re

import numpy as np
import pytest

pytest.importorskip("triton")

from orthros.ops.splitkv import lowbit_kernel as K  # noqa: E402


def _u32(x: str, regs: dict) -> int:
    return regs[x] if x in regs else int(x, 0) & 0xFFFFFFFF


def _halves(x: int) -> np.ndarray:
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _word(h: np.ndarray) -> int:
    u = h.astype(np.float16).view(np.uint16)
    return int(u[0]) | (int(u[1]) << 16)


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(8):  # minterm i: bit 2 of i selects a, bit 1 b, bit 0 c (PTX's 0xF0 / 0xCC / 0xAA)
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out & 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        assert n < 8, "sign-replicating selectors are not emulated"
        out |= src[n] << (8 * i)
    return out


def emulate(asm: str, word, n_out: int) -> list[int]:
    """Run the PTX block on its input registers ($n_out, $n_out + 1, ...: one word, or a list) -> the
    output registers $0 .. $n_out-1."""
    regs = {f"${n_out + i}": x for i, x in enumerate(word if isinstance(word, list) else [word])}
    for line in asm.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        v = lambda x: _u32(x, regs)  # noqa: E731
        if op == "mov.b32":
            r = v(args[1])
        elif op == "prmt.b32":
            r = _prmt(v(args[1]), v(args[2]), v(args[3]))
        elif op == "lop3.b32":
            r = _lop3(v(args[1]), v(args[2]), v(args[3]), v(args[4]))
        elif op == "and.b32":
            r = v(args[1]) & v(args[2])
        elif op == "shr.b32":
            r = v(args[1]) >> v(args[2])
        elif op == "sub.f16x2":
            r = _word(_halves(v(args[1])) - _halves(v(args[2])))
        elif op == "fma.rn.f16x2":  # one rounding: exact products and sums of these operands
            a, b, c = (_halves(v(x)).astype(np.float64) for x in args[1:])
            r = _word((a * b + c).astype(np.float16))
        else:
            raise AssertionError(f"unknown instruction {op}")
        regs[args[0]] = r
    return [regs[f"${i}"] for i in range(n_out)]


def levels(asm: str, bits: int, data: np.ndarray) -> np.ndarray:
    """The asm's outputs for bytes data [N * 4] -> [planes, N * 4] fp16, element i from byte i (pack=4:
    four bytes a register, two fp16 lanes a register per output, in element order)."""
    planes = 8 // bits
    out = np.zeros((planes, len(data)), dtype=np.float16)
    for w in range(0, len(data), 4):
        word = int(data[w]) | int(data[w + 1]) << 8 | int(data[w + 2]) << 16 | int(data[w + 3]) << 24
        regs = emulate(asm, word, 2 * planes)
        for p in range(planes):
            out[p, w: w + 4] = np.concatenate([_halves(regs[2 * p]), _halves(regs[2 * p + 1])])
    return out


@pytest.mark.parametrize("bits", [4, 2])
def test_level_ptx_is_the_plain_map(bits):
    asm = str(getattr(K, f"LEVELS{bits}_PTX").value)
    data = np.arange(256, dtype=np.uint8)
    data = np.concatenate([data, np.random.default_rng(0).permutation(data)])  # every byte in every lane
    got = levels(asm, bits, data)
    mask = (1 << bits) - 1
    want = np.stack([(data >> (bits * p)) & mask for p in range(8 // bits)]).astype(np.float16)
    np.testing.assert_array_equal(got, want)


def test_emulation_catches_a_wrong_mask():
    """The check can fail: one plane's mask off by one bit gives wrong levels."""
    asm = str(K.LEVELS4_PTX.value).replace("0x00f000f0", "0x00e000f0")
    data = np.arange(256, dtype=np.uint8)
    want = np.stack([data & 15, data >> 4]).astype(np.float16)
    assert not np.array_equal(levels(asm, 4, data), want)
    assert re.search(r"prmt", asm)
