"""The Triton code of `ops.moe.fused_moe` (imported on first use). Expert weights are reached
through int64 address tables; `W0` is any tensor of the weights' dtype, whose pointer type the
addresses are cast to. A segment's rows go BLOCK_M at a time (one pass with top-k routing, whose
k experts of a row differ, when BLOCK_M >= the rows); weights row-major ([I, C] gate / up,
[C, I] down)."""

import triton
import triton.language as tl

from .splitkv.kernels import _dot


@triton.jit
def _segment(SEG_START, SEG_COUNT, E_SORTED, TABLE, W0):
    """Segment program_id(0): (its pair count, its first pair, its expert's weight pointer)."""
    s = tl.program_id(0)
    n = tl.load(SEG_COUNT + s)
    start = tl.load(SEG_START + s)
    e = tl.load(E_SORTED + start, mask=n > 0, other=0)  # a past-the-end segment reads nothing
    return n, start, tl.load(TABLE + e).to(W0.dtype)


@triton.jit
def moe_up(X, sxr, GATE, UP, W0, E_SORTED, ROWS, SEG_START, SEG_COUNT, H, C, I,
           BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr):
    """h[pair, i] = silu(x[row] . gate_e[i]) * (x[row] . up_e[i]) for the pairs of segment
    program_id(0), columns of tile program_id(1); each weight tile loaded once."""
    n, start, g_ptr = _segment(SEG_START, SEG_COUNT, E_SORTED, GATE, W0)
    if n > 0:
        u_ptr = tl.load(UP + tl.load(E_SORTED + start)).to(W0.dtype)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        im = i < I
        for m0 in range(0, n, BLOCK_M):  # one pass unless a segment outgrows the tile (a row repeating an expert)
            m = m0 + tl.arange(0, BLOCK_M)
            mm = m < n
            rows = tl.load(ROWS + start + m, mask=mm, other=0)
            acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                cm = c < C
                xt = tl.load(X + rows[:, None].to(tl.int64) * sxr + c[None, :], mask=mm[:, None] & cm[None, :],
                             other=0.0)
                wmask = im[:, None] & cm[None, :]
                wg = tl.load(g_ptr + i[:, None].to(tl.int64) * C + c[None, :], mask=wmask, other=0.0)
                wu = tl.load(u_ptr + i[:, None].to(tl.int64) * C + c[None, :], mask=wmask, other=0.0)
                xt = xt.to(wg.dtype)
                acc_g += _dot(xt, tl.trans(wg), IEEE)
                acc_u += _dot(xt, tl.trans(wu), IEEE)
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            pair = (start + m).to(tl.int64)
            tl.store(H + pair[:, None] * I + i[None, :], h.to(H.dtype.element_ty), mask=mm[:, None] & im[None, :])


@triton.jit
def moe_down(H, DOWN, W0, E_SORTED, W_SORTED, SEG_START, SEG_COUNT, Y, C, I,
             BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr, IEEE: tl.constexpr):
    """y[pair, c] = weight[pair] * (h[pair] . down_e[c]) for the pairs of segment program_id(0),
    columns of tile program_id(1)."""
    n, start, d_ptr = _segment(SEG_START, SEG_COUNT, E_SORTED, DOWN, W0)
    if n > 0:
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        for m0 in range(0, n, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            mm = m < n
            pair = (start + m).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
            for i0 in range(0, I, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                im = i < I
                ht = tl.load(H + pair[:, None] * I + i[None, :], mask=mm[:, None] & im[None, :], other=0.0)
                wd = tl.load(d_ptr + c[:, None].to(tl.int64) * I + i[None, :], mask=cm[:, None] & im[None, :],
                             other=0.0)
                acc += _dot(ht.to(wd.dtype), tl.trans(wd), IEEE)
            w = tl.load(W_SORTED + start + m, mask=mm, other=0.0)
            tl.store(Y + pair[:, None] * C + c[None, :], acc * w[:, None], mask=mm[:, None] & cm[None, :])
