"""Plain causal attention through `F.scaled_dot_product_attention`.

Used when the caller guarantees a plain causal batch (one document per row,
no padding) and no window:
    sdpa_causal        — queries at slots 0..M-1 (the `attention="full"`
        baseline's base stream, the Orthros output stream in pre-training):
        keys M.. are invisible and the problem is a square causal SDPA, for
        which cuDNN's kernel is the fastest on Hopper (docs/kernels.md).
    sdpa_causal_offset — queries at slots s..s+M-1 (a later chunk of a
        chunked prefill): SDPA's `is_causal` aligns the diagonal top-left, so
        the chunk is two calls — every query over the past keys 0..s-1, and
        the square causal block s..s+M-1 — merged by their log-sum-exps.
        Inference only: the LSE output carries no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lse import lse_merge

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


def attend_lse(q, k, v, causal: bool, scale=None):
    """q [B, H, M, D], k/v [B, H, S, D] (equal head counts) -> (out [B, H, M, D], lse [B, H, M]).
    cuDNN's attention on CUDA; a float32 math version elsewhere (for tests)."""
    B, H, M, _ = q.shape
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        o, lse = out[0], out[1]
        if lse.numel() != B * H * M:
            raise RuntimeError(f"unexpected log-sum-exp shape {tuple(lse.shape)} from cuDNN attention")
        return o, lse.reshape(B, H, M).float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        S = k.shape[2]
        s = s.masked_fill(torch.ones(M, S, dtype=torch.bool, device=q.device).triu(S - M + 1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def sdpa_causal_offset(q, k, v, start: int, scale=None):
    """q: [B, M, H, D] at slots start..start+M-1; k, v: [B, S >= start + M, Hkv, D] -> [B, M, H, D]."""
    if start == 0:
        return sdpa_causal(q, k, v, scale=scale)
    B, M, H, D = q.shape
    k, v = k[:, : start + M], v[:, : start + M]
    if k.shape[2] != H:  # cuDNN's LSE path: one K/V head per query head
        k = k.repeat_interleave(H // k.shape[2], dim=2)
        v = v.repeat_interleave(H // v.shape[2], dim=2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    past = attend_lse(qt, kt[:, :, :start], vt[:, :, :start], causal=False, scale=scale)
    block = attend_lse(qt, kt[:, :, start:], vt[:, :, start:], causal=True, scale=scale)
    out, _ = lse_merge([past[0], block[0]], torch.stack([past[1], block[1]]))
    return out.to(q.dtype).transpose(1, 2)
