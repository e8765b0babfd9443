"""Fused elementwise work of a layer: RMSNorm, query/key preparation, SwiGLU's gate.

Eager PyTorch runs each of these as 3-8 kernels over the activations (fp32
upcasts, the rotate-half concatenation of RoPE, SO's multiply-add); on long
prefills and in training those passes cost about a fifth of the layer. On
CUDA, for inputs of at least `FUSE_MIN` elements, each runs as one
`torch.compile`d function with dynamic shapes: one generated kernel forward
and one backward, whatever the sequence length. Small inputs (decoding) stay
eager, where a compiled call's guards cost more than they save; a compiled
decode step traces the plain functions anyway.

`ORTHROS_FUSED=0` turns fusion off, `=1` turns it on for every input and
device (the tests compare both on CPU).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .rope import apply_rope

FUSE_MIN = 1 << 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in fp32, round, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def heads(x, cos, sin, n_heads: int, head_dim: int, alpha=None, beta=None, norm_weight=None, eps: float = 0.0):
    """[B, M, H*D] projection -> SO (x * alpha + beta) -> [B, M, H, D] -> head norm -> RoPE."""
    if alpha is not None:
        x = x * alpha + beta
    x = x.unflatten(-1, (n_heads, head_dim))
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return apply_rope(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # one graph per dtype / grad mode / rank
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _mode() -> str | None:
    return os.environ.get("ORTHROS_FUSED")


def fused(fn):
    """`fn`, run compiled where fusion pays off (see the module docstring)."""

    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        mode = _mode()
        if mode == "0" or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        if mode == "1" or (x.is_cuda and x.numel() >= FUSE_MIN):
            return _compiled(fn)(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return call


fused_rms_norm = fused(rms_norm)
fused_heads = fused(heads)
fused_silu_mul = fused(silu_mul)
