"""Triton kernels for a layer's row-wise work at inference: RMSNorm (optionally
fused with the residual add before it), query/key preparation (SO, head norm,
RoPE) and SwiGLU's gate.

Each reads its inputs once and writes its outputs once, one program per row
(a token's 4096 features fit one tile), computing in fp32 and rounding once
where the eager code rounds several times (the same tolerance as the compiled
versions in `layers/fused.py`); `rowwise_grad.py` adds backward kernels for training.
Offsets are 64-bit: a 1M-token activation has 2^32 elements. Triton is
imported on first use.
"""

from __future__ import annotations

import functools

import torch


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_fwd(X, R, W, Y, H, N, eps, sx, sr, sy, sh,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < N
        x = tl.load(X + row * sx + c, mask=m, other=0.0)
        if HAS_RES:  # h = x + r, rounded like the eager add, then normed
            x = (x.to(tl.float32) + tl.load(R + row * sr + c, mask=m, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
            tl.store(H + row * sh + c, x, mask=m)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * sy + c, (w * y).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def heads_fwd(X, COS, SIN, A, B, NW, Y, NH, eps, sx, sc, sy, M, sa,
                  D2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SO: tl.constexpr, HAS_NORM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        so = (row % M) * sa  # SO per feature (sa = 0) or per row of the M rows (sa = H * D)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        dm = d < D2
        m = (h[:, None] < NH) & dm[None, :]
        lo = h[:, None] * (2 * D2) + d[None, :]  # first half of each head; the second is lo + D2
        x1 = tl.load(X + row * sx + lo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(X + row * sx + lo + D2, mask=m, other=0.0).to(tl.float32)
        if HAS_SO:
            x1 = x1 * tl.load(A + so + lo, mask=m, other=0.0).to(tl.float32) + tl.load(B + so + lo, mask=m, other=0.0).to(tl.float32)
            x2 = (x2 * tl.load(A + so + lo + D2, mask=m, other=0.0).to(tl.float32)
                  + tl.load(B + so + lo + D2, mask=m, other=0.0).to(tl.float32))
        if HAS_NORM:
            x1 = x1.to(X.dtype.element_ty).to(tl.float32)
            x2 = x2.to(X.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * D2) + eps)
            w1 = tl.load(NW + d, mask=dm, other=0.0).to(tl.float32)
            w2 = tl.load(NW + d + D2, mask=dm, other=0.0).to(tl.float32)
            x1 = ((x1 * inv[:, None]).to(X.dtype.element_ty).to(tl.float32) * w1[None, :]).to(X.dtype.element_ty).to(tl.float32)
            x2 = ((x2 * inv[:, None]).to(X.dtype.element_ty).to(tl.float32) * w2[None, :]).to(X.dtype.element_ty).to(tl.float32)
        c1 = tl.load(COS + row * sc + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(COS + row * sc + d + D2, mask=dm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(SIN + row * sc + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(SIN + row * sc + d + D2, mask=dm, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + row * sy + lo, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=m)
        tl.store(Y + row * sy + lo + D2, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def silu_mul_fwd(G, U, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(G + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
        tl.store(Y + i, (s * u).to(Y.dtype.element_ty), mask=m)

    return rms_norm_fwd, heads_fwd, silu_mul_fwd


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features] without a copy where the rows are already evenly strided."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x (of x + residual, which is returned too: (h, norm(h)))."""
    N = x.shape[-1]
    xr = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = rr = None
    if residual is not None:
        rr = _rows(residual)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BLOCK = _pow2(N)
    _kernels()[0][(xr.shape[0],)](
        xr, rr if rr is not None else xr, weight, y, h if h is not None else y, N, eps,
        xr.stride(0), (rr if rr is not None else xr).stride(0), N, N,
        HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=max(1, min(16, BLOCK // 256)))
    return y if residual is None else (h, y)


def _rope_tables(cos, sin, B: int, M: int, head_dim: int):
    cos2 = cos.expand(B, M, 1, head_dim).reshape(B * M, head_dim)
    sin2 = sin.expand(B, M, 1, head_dim).reshape(B * M, head_dim)
    if cos2.stride() != sin2.stride() or cos2.stride(-1) != 1:
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    return cos2, sin2


def heads(x, cos, sin, n_heads: int, head_dim: int, alpha=None, beta=None, norm_weight=None, eps: float = 0.0):
    """[B, M, H*D] -> SO -> [B, M, H, D] -> head norm -> RoPE (cos / sin broadcastable to [B, M, 1, D]).
    SO's alpha, beta: [H*D], or [M, H*D] for one per row (a decode pair's two streams)."""
    B, M = x.shape[:2]
    xr = _rows(x)
    sa = 0
    if alpha is not None and alpha.dim() == 2:
        if alpha.shape != (M, n_heads * head_dim) or beta.shape != alpha.shape:
            raise ValueError(f"per-row SO must be [{M}, {n_heads * head_dim}], got {tuple(alpha.shape)}, "
                             f"{tuple(beta.shape)}")
        alpha, beta = alpha.contiguous(), beta.contiguous()
        sa = n_heads * head_dim
    cos2, sin2 = _rope_tables(cos, sin, B, M, head_dim)
    y = torch.empty(B, M, n_heads, head_dim, dtype=x.dtype, device=x.device)
    D2 = head_dim // 2
    BLOCK_H, BLOCK_D = _pow2(n_heads), _pow2(D2)
    _kernels()[1][(B * M,)](
        xr, cos2, sin2, alpha if alpha is not None else xr, beta if beta is not None else xr,
        norm_weight if norm_weight is not None else xr, y, n_heads, eps,
        xr.stride(0), cos2.stride(0), n_heads * head_dim, M, sa,
        D2=D2, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, HAS_SO=alpha is not None, HAS_NORM=norm_weight is not None,
        num_warps=max(1, min(16, BLOCK_H * BLOCK_D // 256)))
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n, BLOCK = g.numel(), 2048
    _kernels()[2][(-(-n // BLOCK),)](g, u, y, n, BLOCK=BLOCK, num_warps=8)
    return y
