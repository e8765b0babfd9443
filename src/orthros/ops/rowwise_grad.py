"""Backward kernels for the row-wise ops of `rowwise.py`, as autograd functions for
training: the query/key preparation (SO, head norm, RoPE) and RMSNorm with or
without the residual add before it.

Each program takes a block of rows: it writes their input gradient and its
partial sums of the parameter gradients, which one `sum(0)` over programs
finishes. The forward is recomputed from the saved input (one more read of
it) instead of saving intermediates.
"""

from __future__ import annotations

import functools

import torch

from .rowwise import _pow2, _rope_tables, _rows, heads, rms_norm


def _blocking(R: int) -> tuple[int, int]:
    """(rows per program, programs): ~512 programs, at most 64 rows each."""
    per = max(1, min(64, -(-R // 512)))
    return per, -(-R // per)


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
        rows_per_prog, progs = _blocking(R)
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


@functools.cache
def _norm_bwd_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_bwd(X, DY, DH, W, DX, DW, R, N, eps, sx, sdy, sdh, sdx, rows_per_prog,
                     HAS_DH: tl.constexpr, BLOCK: tl.constexpr):
        """y = w * x * r, r = rsqrt(mean(x^2) + eps):  dx = r (w dy) - x r^3 mean(x w dy) (+ dh, the
        gradient reaching h = x directly when the norm's input is also an output)."""
        pid = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        cm = c < N
        w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
        for i in range(rows_per_prog):
            row = (pid * rows_per_prog + i).to(tl.int64)
            m = cm & (row < R)
            x = tl.load(X + row * sx + c, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * sdy + c, mask=m, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
            dw += x * r * dy
            e = w * dy
            dx = r * e - x * (r * r * r * tl.sum(x * e, axis=0) / N)
            if HAS_DH:
                dx += tl.load(DH + row * sdh + c, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + row * sdx + c, dx.to(DX.dtype.element_ty), mask=m)
        tl.store(DW + pid.to(tl.int64) * N + c, dw, mask=cm)

    return rms_norm_bwd


def _norm_backward(x, weight, eps, dy, dh=None):
    """(dx, dweight) of rms_norm at x, given dy (and dh, added to dx)."""
    N = x.shape[-1]
    xr, dyr = _rows(x), _rows(dy)
    dhr = None if dh is None else _rows(dh)
    R = xr.shape[0]
    per, progs = _blocking(R)
    dx = torch.empty(R, N, dtype=x.dtype, device=x.device)
    dw = torch.empty(progs, N, dtype=torch.float32, device=x.device)
    BLOCK = _pow2(N)
    _norm_bwd_kernel()[(progs,)](
        xr, dyr, dhr if dhr is not None else dyr, weight, dx, dw, R, N, eps,
        xr.stride(0), dyr.stride(0), (dhr if dhr is not None else dyr).stride(0), N, per,
        HAS_DH=dh is not None, BLOCK=BLOCK, num_warps=max(1, min(16, BLOCK // 256)))
    return dx.view(x.shape), dw.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = _norm_backward(x, weight, ctx.eps, dy)
        return dx, (dw if ctx.needs_input_grad[1] else None), None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        h, y = rms_norm(x, weight, eps, residual=residual)
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = _norm_backward(h, weight, ctx.eps, dy, dh)
        return dx, dx, (dw if ctx.needs_input_grad[2] else None), None


def rms_norm_autograd(x, weight, eps: float):
    """`rms_norm` with a Triton backward (gradients for x and the weight)."""
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm_autograd(x, residual, weight, eps: float):
    """(h, rms_norm(h)) for h = x + residual, with a Triton backward."""
    return _AddRMSNorm.apply(x, residual, weight, eps)
