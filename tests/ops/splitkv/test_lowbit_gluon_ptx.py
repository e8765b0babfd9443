"""The inline PTX of the Gluon packed kernel (`ops/splitkv/lowbit_gluon.py`: PAIR4, PAIR2) against
the map it stands for, by emulating its instructions (the emulator of test_lowbit_ptx.py) on
every byte value in every lane: plane p of a unit (channel 8u + p) comes out as the fp16 whose
bit pattern is w_p * level (the subnormal w_p * level * 2^-24), lane 0 from the first unit, lane 1
from the second."""

import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon")

from orthros.ops.splitkv import lowbit_gluon as GK  # noqa: E402
from tests.ops.splitkv.test_lowbit_ptx import _halves, emulate  # noqa: E402


def want(units: np.ndarray, bits: int) -> np.ndarray:
    """[N] units -> [8, N] fp16: w_p * level of plane p (w_p = 16^(p % 2) or 4^(p % 4)) as a bit pattern."""
    p = np.arange(8)[:, None]
    level = (units[None, :].astype(np.int64) >> (bits * p)) & ((1 << bits) - 1)
    w = (1 << bits) ** (p % (8 // bits))
    return (w * level).astype(np.uint16).view(np.float16)


@pytest.mark.parametrize("bits", [4, 2])
def test_pair_ptx_is_the_plain_map(bits):
    rng = np.random.default_rng(bits)
    if bits == 4:  # int32 units, two registers in: every byte value in every byte of both
        b = np.stack([rng.permutation(256) for _ in range(8)], 1).astype(np.uint64)
        u0 = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
        u1 = b[:, 4] | b[:, 5] << 8 | b[:, 6] << 16 | b[:, 7] << 24
        asm, regs = str(GK.PAIR4.value), [[int(x), int(y)] for x, y in zip(u0, u1)]
    else:  # int16 units, both in one register (lane 0 low)
        u0 = (rng.permutation(256) | rng.permutation(256) << 8).astype(np.uint64)
        u1 = (rng.permutation(256) | rng.permutation(256) << 8).astype(np.uint64)
        asm, regs = str(GK.PAIR2.value), [[int(x) | int(y) << 16] for x, y in zip(u0, u1)]
    got = np.array([[_halves(r) for r in emulate(asm, x, 8)] for x in regs])  # [N, 8 planes, 2 lanes]
    np.testing.assert_array_equal(got[:, :, 0].T.view(np.uint16), want(u0, bits).view(np.uint16))
    np.testing.assert_array_equal(got[:, :, 1].T.view(np.uint16), want(u1, bits).view(np.uint16))
    assert np.array_equal(want(np.array([0xFFFFFFFF], dtype=np.uint64), bits).astype(np.float64)[:, 0] * 2.0**24,
                          [(1 << bits) ** (p % (8 // bits)) * ((1 << bits) - 1) for p in range(8)])  # the values


def test_emulation_catches_a_wrong_selector():
    """The check can fail: a prmt selector taking byte 1 for byte 0 gives wrong levels."""
    asm = str(GK.PAIR4.value).replace("0x4400", "0x4401")
    x = [0x12345678, 0x9ABCDEF0]
    got = np.array([_halves(r) for r in emulate(asm, x, 8)])[:, 0]
    assert not np.array_equal(got.view(np.uint16), want(np.array([x[0]], dtype=np.uint64), 4)[:, 0].view(np.uint16))
