"""A low-bit cache's decode write in one Triton launch a layer (`LowBitStaticCache`, decoding).

One program a (row, KV head) does what the PyTorch write does (`format.py`):

    the token's K and V to the bf16 ring at slot % ring (and to the sinks if slot < sinks);
    its value quantized (Hadamard-rotated, per token over groups of VG channels) into the packed
        slot with its fp16 scale and zero;
    on the step where the bound moves, the key group just below it quantized from the ring
        (rotated, per channel over the group's slots, sink slots out of the range).

The PyTorch write re-quantizes that key group on every step (no branch without a host sync); it is
the same group with the same bits for `key_group` steps, so writing it only when it completes
stores the same cache. The arithmetic is the PyTorch ops' own, in the same order, so the kernel
stores the same bits (checked against them: tests/ops/lowbit/write_cases.py): the rotation
is the same fast Walsh-Hadamard transform (adds and subtracts in butterfly order, then one scale),
the scale is the range times the fp32 reciprocal of the level count (`quantize` computes it so, on
every device), the level a division (IEEE, `div_rn`: Triton's plain fp32 division is approximate),
rounded to nearest even (cvt.rni on a GPU; under the interpreter, adding and subtracting 1.5 * 2^23).

Why: written with PyTorch ops the step's writes compiled to a dozen kernels a layer (the
rotation's butterflies, the group's min / max, the packing, the index copies): ~0.55 ms of a
1M-token step's 19.7 (Llama-3.1-8B shape, H200), and most of the low-bit step's compile time.
"""

from __future__ import annotations

import torch

from ..splitkv.common import interpreting as _interpreting
from ..splitkv.common import triton_available


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def write_kernel_applies(hv: torch.Tensor, value_group: int, key_group: int) -> bool:
    """Whether the Triton write runs this step: CUDA, power-of-two value and key groups (the tiles'
    shapes), rotation blocks of at most 256 channels. (Under the Triton interpreter the cases of
    tests/ops/lowbit/write_cases.py ask for it on the CPU.)"""
    D = hv.shape[-1]
    shapes_ok = _pow2(value_group) and _pow2(key_group) and key_group <= 256 and D & -D <= 256
    return hv.is_cuda and triton_available() and shapes_ok


def decode_write(hk, hv, rk, rv, sk, sv, kq, vq, k_scale, k_zero, v_scale_hm, v_zero_hm, slot, recent: int,
                 key_group: int, key_bits: int, value_bits: int, rotated: bool) -> None:
    """One token per row, hk / hv [B, 1, Hkv, D] (the ring's dtype), written at `slot` ([1] int64) into
    one layer of a low-bit cache: ring rk / rv [B, R, Hkv, D], sinks sk / sv [B, NS, Hkv, D], packed
    kq / vq [B, C, Hkv, D * bits / 8], key scale / zero [B, C / key_group, Hkv, D], value scale /
    zero head-major [B, Hkv, C, D / VG]. Nothing is synced with the host (capturable)."""
    B, _, Hkv, D = hv.shape
    NS = sk.shape[1]
    NG = v_scale_hm.shape[-1]
    VG = D // NG
    if sk.shape[1] == 0:  # no sinks: any pointers (never written)
        sk, sv = rk, rv
    block_d = 1 << max(0, (D - 1).bit_length())
    hb = D & -D  # the rotation's block: the largest power of two dividing D
    _kernel()[(B * Hkv,)](
        hk, hv, rk, rv, sk, sv, kq, vq, k_scale, k_zero, v_scale_hm, v_zero_hm, slot,
        hk.stride(0), hk.stride(2), hv.stride(0), hv.stride(2), rk.stride(0), rk.stride(1), rk.stride(2),
        sk.stride(0), sk.stride(1), sk.stride(2),
        kq.stride(0), kq.stride(1), kq.stride(2), vq.stride(0), vq.stride(1), vq.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_scale_hm.stride(0), v_scale_hm.stride(1), v_scale_hm.stride(2),
        Hkv, NS, rk.shape[1], recent,
        D=D, BLOCK_D=block_d, HB=hb, SCALE=float(hb) ** -0.5, ROTATED=rotated, KG=key_group, VG=VG,
        KBITS=key_bits, VBITS=value_bits, PTX=not _interpreting(), num_warps=4)


def _kernel():
    from .write_kernel import lowbit_decode_write_fwd  # imports triton

    return lowbit_decode_write_fwd
