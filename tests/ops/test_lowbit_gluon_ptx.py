"""The inline PTX of the Gluon packed kernel (`ops/splitkv_lowbit_gluon.py`: PAIR4, PAIR2, and their
exact forms PAIR4X, PAIR2X) against
the map it stands for, by emulating its instructions (the emulator of test_lowbit_ptx.py) on
every byte value in every lane: plane p of a unit (channel 8u + p) comes out as the fp16
1024 + w_p * level (exact: w_p * level), lane 0 from the first unit, lane 1 from the second."""

import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon")

from orthros.ops import splitkv_lowbit_gluon as GK  # noqa: E402
from tests.ops.test_lowbit_ptx import _halves, emulate  # noqa: E402


def want(units: np.ndarray, bits: int, exact: bool = False) -> np.ndarray:
    """[N] units -> [8, N] fp16: 1024 + w_p * level of plane p (w_p = 16^(p % 2) or 4^(p % 4));
    exact: w_p * level (the values' form)."""
    p = np.arange(8)[:, None]
    level = (units[None, :].astype(np.int64) >> (bits * p)) & ((1 << bits) - 1)
    w = (1 << bits) ** (p % (8 // bits))
    return ((0 if exact else 1024) + w * level).astype(np.float16)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("bits", [4, 2])
def test_pair_ptx_is_the_plain_map(bits, exact):
    rng = np.random.default_rng(bits)
    if bits == 4:  # int32 units, two registers in: every byte value in every byte of both
        b = np.stack([rng.permutation(256) for _ in range(8)], 1).astype(np.uint64)
        u0 = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
        u1 = b[:, 4] | b[:, 5] << 8 | b[:, 6] << 16 | b[:, 7] << 24
        asm, regs = str((GK.PAIR4X if exact else GK.PAIR4).value), [[int(x), int(y)] for x, y in zip(u0, u1)]
    else:  # int16 units, both in one register (lane 0 low)
        u0 = (rng.permutation(256) | rng.permutation(256) << 8).astype(np.uint64)
        u1 = (rng.permutation(256) | rng.permutation(256) << 8).astype(np.uint64)
        asm, regs = str((GK.PAIR2X if exact else GK.PAIR2).value), [[int(x) | int(y) << 16] for x, y in zip(u0, u1)]
    got = np.array([[_halves(r) for r in emulate(asm, x, 8)] for x in regs])  # [N, 8 planes, 2 lanes]
    np.testing.assert_array_equal(got[:, :, 0].T, want(u0, bits, exact))
    np.testing.assert_array_equal(got[:, :, 1].T, want(u1, bits, exact))


def test_emulation_catches_a_wrong_selector():
    """The check can fail: a prmt selector taking byte 1 for byte 0 gives wrong levels."""
    asm = str(GK.PAIR4.value).replace("0x4400", "0x4401")
    x = [0x12345678, 0x9ABCDEF0]
    got = np.array([_halves(r) for r in emulate(asm, x, 8)])[:, 0]
    assert not np.array_equal(got, want(np.array([x[0]], dtype=np.uint64), 4)[:, 0])
