"""Triton kernels for a layer's row-wise work at inference: RMSNorm (optionally
fused with the residual add before it), query/key preparation (SO, head norm,
RoPE) and SwiGLU's gate.

Each reads its inputs once and writes its outputs once, one program per row
(a token's 4096 features fit one tile), computing in fp32 and rounding once
where the eager code rounds several times (the same tolerance as the compiled
versions in `layers/fused.py`). The query/key preparation also has a backward kernel
(`heads_autograd`), for training.
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
    def heads_fwd(X, COS, SIN, A, B, NW, Y, NH, eps, sx, sc, sy,
                  D2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SO: tl.constexpr, HAS_NORM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        m = (h[:, None] < NH) & (d[None, :] < D2)
        lo = h[:, None] * (2 * D2) + d[None, :]  # first half of each head; the second is lo + D2
        x1 = tl.load(X + row * sx + lo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(X + row * sx + lo + D2, mask=m, other=0.0).to(tl.float32)
        if HAS_SO:
            x1 = x1 * tl.load(A + lo, mask=m, other=0.0).to(tl.float32) + tl.load(B + lo, mask=m, other=0.0).to(tl.float32)
            x2 = x2 * tl.load(A + lo + D2, mask=m, other=0.0).to(tl.float32) + tl.load(B + lo + D2, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            x1 = x1.to(X.dtype.element_ty).to(tl.float32)
            x2 = x2.to(X.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * D2) + eps)
            dm = d < D2
            w1 = tl.load(NW + d, mask=dm, other=0.0).to(tl.float32)
            w2 = tl.load(NW + d + D2, mask=dm, other=0.0).to(tl.float32)
            x1 = ((x1 * inv[:, None]).to(X.dtype.element_ty).to(tl.float32) * w1[None, :]).to(X.dtype.element_ty).to(tl.float32)
            x2 = ((x2 * inv[:, None]).to(X.dtype.element_ty).to(tl.float32) * w2[None, :]).to(X.dtype.element_ty).to(tl.float32)
        dm = d < D2
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
    """[B, M, H*D] -> SO -> [B, M, H, D] -> head norm -> RoPE (cos / sin broadcastable to [B, M, 1, D])."""
    B, M = x.shape[:2]
    xr = _rows(x)
    cos2, sin2 = _rope_tables(cos, sin, B, M, head_dim)
    y = torch.empty(B, M, n_heads, head_dim, dtype=x.dtype, device=x.device)
    D2 = head_dim // 2
    BLOCK_H, BLOCK_D = _pow2(n_heads), _pow2(D2)
    _kernels()[1][(B * M,)](
        xr, cos2, sin2, alpha if alpha is not None else xr, beta if beta is not None else xr,
        norm_weight if norm_weight is not None else xr, y, n_heads, eps,
        xr.stride(0), cos2.stride(0), n_heads * head_dim,
        D2=D2, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, HAS_SO=alpha is not None, HAS_NORM=norm_weight is not None,
        num_warps=max(1, min(16, BLOCK_H * BLOCK_D // 256)))
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n, BLOCK = g.numel(), 2048
    _kernels()[2][(-(-n // BLOCK),)](g, u, y, n, BLOCK=BLOCK, num_warps=8)
    return y


@functools.cache
def _heads_bwd_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def heads_bwd(X, DY, COS, SIN, A, B, NW, DX, DA, DB, DW, R, NH, eps, sx, sdy, sc, sdx, rows_per_prog,
                  D2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SO: tl.constexpr, HAS_NORM: tl.constexpr):
        """dx of `heads_fwd` for `rows_per_prog` rows, and this program's partial sums of the
        parameter gradients (dalpha, dbeta [H*D], dnorm_weight [D]), summed over programs after."""
        pid = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        dm = d < D2
        m = (h[:, None] < NH) & dm[None, :]
        lo = h[:, None] * (2 * D2) + d[None, :]
        if HAS_SO:
            a1 = tl.load(A + lo, mask=m, other=0.0).to(tl.float32)
            a2 = tl.load(A + lo + D2, mask=m, other=0.0).to(tl.float32)
            b1 = tl.load(B + lo, mask=m, other=0.0).to(tl.float32)
            b2 = tl.load(B + lo + D2, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            w1 = tl.load(NW + d, mask=dm, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(NW + d + D2, mask=dm, other=0.0).to(tl.float32)[None, :]
        da1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        da2 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        db1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        db2 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        dw1 = tl.zeros([BLOCK_D], tl.float32)
        dw2 = tl.zeros([BLOCK_D], tl.float32)
        for i in range(rows_per_prog):
            row = (pid * rows_per_prog + i).to(tl.int64)
            rm = m & (row < R)
            x1 = tl.load(X + row * sx + lo, mask=rm, other=0.0).to(tl.float32)
            x2 = tl.load(X + row * sx + lo + D2, mask=rm, other=0.0).to(tl.float32)
            u1, u2 = x1, x2
            if HAS_SO:
                u1 = x1 * a1 + b1
                u2 = x2 * a2 + b2
            g1 = tl.load(DY + row * sdy + lo, mask=rm, other=0.0).to(tl.float32)
            g2 = tl.load(DY + row * sdy + lo + D2, mask=rm, other=0.0).to(tl.float32)
            cm = dm & (row < R)
            c1 = tl.load(COS + row * sc + d, mask=cm, other=0.0).to(tl.float32)[None, :]
            c2 = tl.load(COS + row * sc + d + D2, mask=cm, other=0.0).to(tl.float32)[None, :]
            s1 = tl.load(SIN + row * sc + d, mask=cm, other=0.0).to(tl.float32)[None, :]
            s2 = tl.load(SIN + row * sc + d + D2, mask=cm, other=0.0).to(tl.float32)[None, :]
            # RoPE: y1 = n1 c1 - n2 s1, y2 = n2 c2 + n1 s2  =>  its transpose
            dn1 = g1 * c1 + g2 * s2
            dn2 = g2 * c2 - g1 * s1
            if HAS_NORM:  # n = u r w per head, r = rsqrt(mean(u^2) + eps)
                r = 1.0 / tl.sqrt((tl.sum(u1 * u1, axis=1) + tl.sum(u2 * u2, axis=1)) / (2 * D2) + eps)
                dw1 += tl.sum(u1 * r[:, None] * dn1, axis=0)
                dw2 += tl.sum(u2 * r[:, None] * dn2, axis=0)
                e1 = dn1 * w1
                e2 = dn2 * w2
                dot = (tl.sum(u1 * e1, axis=1) + tl.sum(u2 * e2, axis=1)) / (2 * D2)
                du1 = r[:, None] * e1 - u1 * (r * r * r * dot)[:, None]
                du2 = r[:, None] * e2 - u2 * (r * r * r * dot)[:, None]
            else:
                du1, du2 = dn1, dn2
            if HAS_SO:
                da1 += x1 * du1
                da2 += x2 * du2
                db1 += du1
                db2 += du2
                du1 = du1 * a1
                du2 = du2 * a2
            tl.store(DX + row * sdx + lo, du1.to(DX.dtype.element_ty), mask=rm)
            tl.store(DX + row * sdx + lo + D2, du2.to(DX.dtype.element_ty), mask=rm)
        P = pid.to(tl.int64) * (2 * D2) * NH
        if HAS_SO:
            tl.store(DA + P + lo, da1, mask=m)
            tl.store(DA + P + lo + D2, da2, mask=m)
            tl.store(DB + P + lo, db1, mask=m)
            tl.store(DB + P + lo + D2, db2, mask=m)
        if HAS_NORM:
            Q = pid.to(tl.int64) * (2 * D2)
            tl.store(DW + Q + d, dw1, mask=dm)
            tl.store(DW + Q + d + D2, dw2, mask=dm)

    return heads_bwd


class _Heads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, n_heads, head_dim, alpha, beta, norm_weight, eps):
        ctx.save_for_backward(x, cos, sin, alpha, beta, norm_weight)
        ctx.cfg = (n_heads, head_dim, eps)
        return heads(x, cos, sin, n_heads, head_dim, alpha, beta, norm_weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin, alpha, beta, norm_weight = ctx.saved_tensors
        n_heads, head_dim, eps = ctx.cfg
        B, M = x.shape[:2]
        R, C, D2 = B * M, n_heads * head_dim, head_dim // 2
        xr, dyr = _rows(x), dy.reshape(R, C)
        if dyr.stride(-1) != 1:
            dyr = dyr.contiguous()
        cos2, sin2 = _rope_tables(cos, sin, B, M, head_dim)
        dx = torch.empty(R, C, dtype=x.dtype, device=x.device)
        rows_per_prog = max(1, min(64, -(-R // 512)))
        progs = -(-R // rows_per_prog)
        f32 = dict(dtype=torch.float32, device=x.device)
        has_so, has_norm = alpha is not None, norm_weight is not None
        da = torch.empty(progs, C, **f32) if has_so else dx
        db = torch.empty(progs, C, **f32) if has_so else dx
        dw = torch.empty(progs, head_dim, **f32) if has_norm else dx
        BLOCK_H, BLOCK_D = _pow2(n_heads), _pow2(D2)
        _heads_bwd_kernel()[(progs,)](
            xr, dyr, cos2, sin2, alpha if has_so else xr, beta if has_so else xr, norm_weight if has_norm else xr,
            dx, da, db, dw, R, n_heads, eps, xr.stride(0), dyr.stride(0), cos2.stride(0), C, rows_per_prog,
            D2=D2, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, HAS_SO=has_so, HAS_NORM=has_norm,
            num_warps=max(1, min(16, BLOCK_H * BLOCK_D // 256)))
        grads = [dx.view(x.shape), None, None, None, None, None, None, None, None]
        if has_so and ctx.needs_input_grad[5]:
            grads[5] = da.sum(0).to(alpha.dtype)
        if has_so and ctx.needs_input_grad[6]:
            grads[6] = db.sum(0).to(beta.dtype)
        if has_norm and ctx.needs_input_grad[7]:
            grads[7] = dw.sum(0).to(norm_weight.dtype)
        return tuple(grads)


def heads_autograd(x, cos, sin, n_heads: int, head_dim: int, alpha=None, beta=None, norm_weight=None,
                   eps: float = 0.0):
    """`heads` with a Triton backward: gradients for x, alpha, beta and the norm weight
    (cos / sin are position tables and get none)."""
    return _Heads.apply(x, cos, sin, n_heads, head_dim, alpha, beta, norm_weight, eps)
