"""Plain causal attention through `F.scaled_dot_product_attention`.

Used when the caller guarantees a plain causal batch (one document per row,
no padding) and the queries are the slots 0..M-1 with no window: the
`attention="full"` baseline's base stream and the Orthros output stream in
pre-training. Then keys M.. are invisible and the problem is a square
causal SDPA, for which cuDNN's kernel is the fastest on Hopper
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch.nn.functional as F

# How grouped K/V heads reach SDPA: "native" (enable_gqa=True) or "expand"
# (repeat K/V heads first, which lets cuDNN take the call). Set by measurement.
GQA_MODE = "native"


def _backends():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_causal(q, k, v, scale=None, gqa_mode: str | None = None, backends=None):
    """q: [B, M, H, D] at slots 0..M-1; k, v: [B, S >= M, Hkv, D] -> [B, M, H, D]."""
    from torch.nn.attention import sdpa_kernel

    B, M, H, D = q.shape
    Hkv = k.shape[2]
    k, v = k[:, :M], v[:, :M]
    gqa_mode = GQA_MODE if gqa_mode is None else gqa_mode
    if H != Hkv and gqa_mode == "expand":
        k = k.repeat_interleave(H // Hkv, dim=2)
        v = v.repeat_interleave(H // Hkv, dim=2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    try:
        ctx = sdpa_kernel(backends or _backends(), set_priority=True)
    except TypeError:  # older torch: no priorities
        ctx = sdpa_kernel(backends or _backends())
    with ctx:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=kt.shape[1] != H)
    return o.transpose(1, 2)
