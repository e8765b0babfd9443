"""Low-bit (int4 / int2) K/V: group-wise asymmetric quantization, bit packing, and the
dequantize-then-attend reference of the low-bit cache (the spec in code).

A value x of a group with range [lo, hi] is stored as the level
n = round((x - lo) / s) in 0..2^b - 1, s = (hi - lo) / (2^b - 1), and read back
as n * s + lo. Scale s and zero lo are fp16. Levels are packed 8 / b to a byte
along the channels, the lowest bits first: byte c of a token holds channels
c * P .. c * P + P - 1 (P = 8 / b).

The layout (chosen by measurement, benchmarks/kv_quant_layouts.py and the copy
probe of docs/long_context.md):

    keys    per channel: one (scale, zero) per channel for each group of
            `key_group` consecutive slots (KIVI's keys; after RoPE, as attention reads them)
    values  per token: one (scale, zero) per token and KV head for each group of
            `value_group` consecutive channels
    rotate  (the cache's default) keys and values are multiplied by an orthonormal
            Hadamard matrix R over the head's channels before they are quantized,
            and the dequantized ones by R again (R = R^T = R^-1); `rotate` below

Rotating spreads what a few channels carry over all of them (QuaRot / OSCAR):
on the real model it roughly halves int2's copy-probe loss gap to bf16 and
takes int4's from +6.6% to +1.8% (docs/long_context.md). R is
block-diagonal with Sylvester blocks of the largest power of two dividing D;
`rotate` is a fast Walsh-Hadamard transform (adds, subtracts and one scale:
the same bits for a slot whatever the shape of the batch it is rotated in).

Shapes (B rows, S slots, Hkv KV heads, D channels, P = 8 / bits of K or V):

    packed K / V          uint8 [B, S, Hkv, D / P]
    K scale / zero        fp16  [B, S / key_group, Hkv, D]
    V scale / zero        fp16  [B, S, Hkv, D / value_group]
"""

from __future__ import annotations

import torch

BITS = {"int4": (4, 4), "int2": (2, 2), "k4v2": (4, 2)}  # kv_dtype -> (key bits, value bits)


def packed_bound(length, recent: int, key_group: int):
    """The first slot kept in bf16 when `length` slots are filled (an int, or a tensor: no sync):
    max(0, length - recent) rounded down to a whole key group; slots below it (past the sinks) are
    packed. The one definition every low-bit cache, reader and its bookkeeping uses."""
    if torch.is_tensor(length):
        return ((length - recent).clamp_min(0) // key_group) * key_group
    return max(0, length - recent) // key_group * key_group


def pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 levels [..., D] (each < 2^bits) -> packed uint8 [..., D * bits / 8]."""
    P = 8 // bits
    x = levels.unflatten(-1, (-1, P)).to(torch.int32)
    out = x[..., 0]
    for i in range(1, P):
        out = out | (x[..., i] << (i * bits))
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> levels uint8 [..., D]."""
    P = 8 // bits
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    x = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return x.flatten(-2).to(torch.uint8)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x @ R in fp32 (R: the orthonormal block-Hadamard matrix above; R @ R = I)."""
    D = x.shape[-1]
    b = D & -D  # the largest power of two dividing D: the block size
    y = x.float().reshape(*x.shape[:-1], D // b, b)
    h = 1
    while h < b:  # butterflies on channel pairs (i, i + h) inside blocks of 2h
        y = y.unflatten(-1, (b // (2 * h), 2, h))
        y = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], -2).flatten(-3)
        h *= 2
    return (y * b**-0.5).reshape(x.shape)


def rotation_matrix(D: int, device=None) -> torch.Tensor:
    """R [D, D] fp32 (symmetric; the kernel's copy of `rotate`)."""
    return rotate(torch.eye(D, device=device))


def quantize(x: torch.Tensor, bits: int, dims, valid: torch.Tensor | None = None):
    """Asymmetric min/max quantization of x over `dims` (the group).

    valid: an optional bool mask broadcastable to x; masked elements do not widen the
    group's range (sink slots inside a key group). -> (levels uint8 like x,
    scale fp16, zero fp16, both with `dims` kept as size 1)."""
    xf = x.float()
    if valid is None:
        lo, hi = xf.amin(dims, keepdim=True), xf.amax(dims, keepdim=True)
    else:
        lo = xf.masked_fill(~valid, float("inf")).amin(dims, keepdim=True)
        hi = xf.masked_fill(~valid, float("-inf")).amax(dims, keepdim=True)
        empty = lo > hi  # a group with nothing valid in it: any range will do
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    levels = 2**bits - 1
    zero = lo.half()
    # times the fp32 reciprocal, not divided: what a division by a scalar is on CUDA, so the stored bits
    # are the same on every device (and in `ops/lowbit/write.py`'s kernel)
    scale = ((hi - lo) * (1.0 / levels)).half()
    s, z = scale.float(), zero.float()
    # fp16 rounding of (scale, zero) is part of the format: levels are computed against the stored pair
    n = torch.where(s > 0, (xf - z) / s.clamp_min(1e-30), torch.zeros_like(xf))
    return n.round_().clamp_(0, levels).to(torch.uint8), scale, zero


def dequantize(levels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """levels * scale + zero in fp32 (scale / zero broadcast over their group)."""
    return levels.float() * scale.float() + zero.float()


def quantize_keys(k: torch.Tensor, bits: int, group: int, valid: torch.Tensor | None = None):
    """k [B, S, Hkv, D] (S a multiple of `group`, the slots of whole groups) ->
    (packed [B, S, Hkv, D/P], scale, zero [B, S / group, Hkv, D]); valid [B, S] or None."""
    B, S, Hkv, D = k.shape
    g = k.reshape(B, S // group, group, Hkv, D)
    m = None if valid is None else valid.reshape(B, S // group, group, 1, 1)
    n, s, z = quantize(g, bits, 2, m)
    return pack(n.reshape(B, S, Hkv, D), bits), s[:, :, 0], z[:, :, 0]


def quantize_values(v: torch.Tensor, bits: int, group: int):
    """v [B, S, Hkv, D] -> (packed [B, S, Hkv, D/P], scale, zero [B, S, Hkv, D / group])."""
    n, s, z = quantize(v.unflatten(-1, (-1, group)), bits, -1)
    return pack(n.flatten(-2), bits), s[..., 0], z[..., 0]


def dequantize_keys(packed, scale, zero, bits: int, group: int) -> torch.Tensor:
    """The inverse of `quantize_keys` (fp32 [B, S, Hkv, D])."""
    n = unpack(packed, bits)
    B, S, Hkv, D = n.shape
    return dequantize(n.reshape(B, S // group, group, Hkv, D), scale[:, :, None], zero[:, :, None]).reshape(n.shape)


def dequantize_values(packed, scale, zero, bits: int) -> torch.Tensor:
    """The inverse of `quantize_values` (fp32 [B, S, Hkv, D])."""
    n = unpack(packed, bits)
    return dequantize(n.unflatten(-1, (scale.shape[-1], -1)), scale[..., None], zero[..., None]).flatten(-2)


def dense_kv(sk, sv, kq, vq, k_scale, k_zero, v_scale, v_zero, rk, rv, bound, length: int, key_bits: int,
             value_bits: int, key_group: int, rotated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference read of a low-bit cache layer: K, V [B, length, Hkv, D] in fp32.

    Slot j comes from the sinks sk, sv [B, NS, Hkv, D] if j < NS, else from the packed
    storage (kq, vq [B, C, Hkv, D / P] with their scales; rotated: stored times R, read
    back times R) if j < bound, else from the ring rk, rv [B, R, Hkv, D] at j % R.
    bound: an int or a [1] tensor (no host sync)."""
    g, NS, R = key_group, sk.shape[1], rk.shape[1]
    n = -(-length // g) * g
    kd = dequantize_keys(kq[:, :n], k_scale[:, : n // g], k_zero[:, : n // g], key_bits, g)[:, :length]
    vd = dequantize_values(vq[:, :length], v_scale[:, :length], v_zero[:, :length], value_bits)
    if rotated:
        kd, vd = rotate(kd), rotate(vd)
    j = torch.arange(length, device=kq.device)
    bound = torch.as_tensor(bound, device=kq.device).reshape(-1)[:1]
    old = (j < bound)[None, :, None, None]
    k = torch.where(old, kd, rk[:, j % R].float())
    v = torch.where(old, vd, rv[:, j % R].float())
    if NS:
        sink = (j < NS)[None, :, None, None]
        i = j.clamp_max(NS - 1)
        k = torch.where(sink, sk[:, i].float(), k)
        v = torch.where(sink, sv[:, i].float(), v)
    return k, v
