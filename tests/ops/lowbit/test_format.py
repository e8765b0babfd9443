"""The low-bit K/V format (`ops/lowbit/format.py`): quantization, packing, the rotation."""

import pytest
import torch

from orthros.ops import lowbit


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_pack_roundtrip_and_error_bound(bits):
    torch.manual_seed(0)
    n = torch.randint(0, 2**bits, (3, 5, 2, 32), dtype=torch.uint8)
    assert torch.equal(lowbit.unpack(lowbit.pack(n, bits), bits), n)
    assert lowbit.pack(n, bits).shape[-1] == 32 * bits // 8
    x = 3 * torch.randn(2, 128, 2, 32) + 5  # off-centre: the zero point matters
    for deq, s in ((lowbit.dequantize_keys(*lowbit.quantize_keys(x, bits, 16), bits, 16), None),
                   (lowbit.dequantize_values(*lowbit.quantize_values(x, bits, 8), bits), None)):
        # every element within half a step (+ fp16 rounding of the scale) of its value
        lo_hi = x.amax() - x.amin()
        assert (deq - x).abs().max() <= 0.5 * lo_hi / (2**bits - 1) * 1.01
        assert not torch.equal(deq, x)
    # a group with one value (zero range) comes back exactly
    c = torch.full((1, 16, 1, 8), 0.7)
    assert torch.allclose(lowbit.dequantize_keys(*lowbit.quantize_keys(c, bits, 16), bits, 16), c.half().float())


@pytest.mark.parametrize("D", [16, 64, 24])
def test_rotation_is_an_exact_involution(D):
    """R (block-Hadamard, blocks of the largest power of two dividing D) is orthonormal and its
    own inverse; `rotate` is x @ R and gives a slot the same bits whatever batch it is in (so
    the stored cache does not depend on chunking)."""
    R = lowbit.rotation_matrix(D)
    b = D & -D
    assert torch.allclose(R @ R, torch.eye(D), atol=1e-6) and torch.equal(R, R.T)
    assert torch.count_nonzero(R) == D * b and torch.allclose(R.abs()[R != 0], torch.tensor(b**-0.5))
    x = torch.randn(3, 40, 2, D)
    assert torch.allclose(lowbit.rotate(x), x @ R, atol=1e-5)
    assert torch.equal(lowbit.rotate(x)[1:2, 7:20], lowbit.rotate(x[1:2, 7:20]))
    # an outlier channel is spread over its block: the rotated vector's range shrinks
    spike = torch.zeros(D).index_fill_(0, torch.tensor([3]), 10.0) + 0.1 * torch.randn(D)
    assert lowbit.rotate(spike).abs().max() < 0.5 * spike.abs().max()
