"""The Triton code of the split-KV readers of 16-bit and fp8 K/V (`dense.py`, `paged.py`) and the
log-sum-exp merge every reader ends with (`common.merge_splits_kernel`). One module, imported on first
use, because the kernels share Triton helpers, which must be module globals: the query tile, the fp16
query prologue, one tile's online-softmax step and the partial result are written once here.

The low-bit reader (`lowbit_kernel.py`) keeps its own loop: it accumulates in base 2 (exp2, the
scale times log2 e) over three ranges of differently stored slots; it ends in the same merge."""

import triton
import triton.language as tl


@triton.jit
def _fp16_queries(q):
    """16-bit queries over fp8 K/V -> (q in fp16, the factor to divide the softmax scale by). Hopper
    converts e4m3 to fp16 two values an instruction, to bf16 only through fp16; queries above 2^14
    are scaled by a power of two first (exact)."""
    qf = q.to(tl.float32)
    big = tl.max(tl.max(tl.abs(qf), 1), 0)
    qs = tl.where(big > 16384.0, tl.exp2(14.0 - tl.ceil(tl.log2(big))), 1.0)
    return (qf * qs).to(tl.float16), qs


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """One tile of scores s [R, N] (-inf where not visible) -> (p, the old state's rescale alpha, the new
    max, the new sum); rows with nothing seen yet keep max -inf and weight 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _finish(acc, m_i, l_i):
    """A split's partial result: (o [R, D], lse [R]); a row that saw no key: o 0, lse -inf."""
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def _query_rows(Q, sqb, sqm, sqh, M, Hkv, G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A program's (batch, KV head) and its query tile: the G query heads of that KV head for each
    of the M rows, [BLOCK_R, BLOCK_D] -> (b, kvh, m, h, rvalid, d, dmask, q)."""
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    kvh = pid % Hkv
    r = tl.arange(0, BLOCK_R)
    m = r // G
    h = kvh * G + r % G
    rvalid = m < M
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * sqb + m[:, None] * sqm + h[:, None] * sqh + d[None, :],
                mask=rvalid[:, None] & dmask[None, :], other=0.0)
    return b, kvh, m, h, rvalid, d, dmask, q


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, kv_mask, vis, scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of keys folded into the running softmax: scores where `vis`, -inf elsewhere
    -> (acc, m_i, l_i)."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.where(vis, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    return _accumulate(acc, alpha, p, v, IEEE), m_new, l_i


@triton.jit
def _key_tiles(q, K, V, KDOC, b, kvh, m, d, dmask, slot, qdoc, first, lo, hi, n, skb, sks, skh, svb, svs, svh,
               s_kdoc_b, scale, window, window_rows, m_i, l_i, acc, BLOCK_N: tl.constexpr,
               HAS_WINDOW: tl.constexpr, SINKS: tl.constexpr, IEEE: tl.constexpr):
    """Keys [lo, hi) in tiles of BLOCK_N folded into the running softmax, each under the mask."""
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + n
        jvalid = j < hi
        kdoc = tl.load(KDOC + b * s_kdoc_b + j, mask=jvalid, other=-4).to(tl.int64)
        vis = (j[None, :] <= slot[:, None]) & (kdoc[None, :] == qdoc[:, None]) & jvalid[None, :]
        if HAS_WINDOW:
            # rows past window_rows: no window
            near = (slot[:, None] - j[None, :] < window) | (m[:, None] >= window_rows)
            if SINKS > 0:  # the first SINKS keys of the query's document
                near = near | (j[None, :] - first[:, None] < SINKS)
            vis = vis & near
        acc, m_i, l_i = _attend_tile(q, K + b * skb + j[:, None] * sks + kvh * skh + d[None, :],
                                     V + b * svb + j[:, None] * svs + kvh * svh + d[None, :],
                                     jvalid[:, None] & dmask[None, :], vis, scale, m_i, l_i, acc, IEEE)
    return acc, m_i, l_i


@triton.jit
def splitkv_fwd(Q, K, V, SLOT, QDOC, KDOC, QFIRST, O, LSE,
                sqb, sqm, sqh, skb, sks, skh, svb, svs, svh,
                s_slot_b, s_qdoc_b, s_kdoc_b, s_qfirst_b,
                sob, sop, som, soh, slb, slp, slm,
                M, S, Hkv, scale, window, window_rows, keys_per_split,
                G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr,
                SINKS: tl.constexpr = 0):
    """SINKS > 0: windowed rows also see the first SINKS keys of their document, which starts at
    slot QFIRST [B, M] (a row's keys before its window are read in a loop of their own)."""
    split = tl.program_id(1)
    b, kvh, m, h, rvalid, d, dmask, q = _query_rows(Q, sqb, sqm, sqh, M, Hkv, G, D, BLOCK_R, BLOCK_D)
    if F16:  # fp8 K/V: dots in fp16 (`use_fp16_dots`)
        q, qs = _fp16_queries(q)
        scale = scale / qs
    slot = tl.load(SLOT + b * s_slot_b + m, mask=rvalid, other=-1).to(tl.int64)
    qdoc = tl.load(QDOC + b * s_qdoc_b + m, mask=rvalid, other=-3).to(tl.int64)
    first = slot
    if SINKS > 0:
        first = tl.load(QFIRST + b * s_qfirst_b + m, mask=rvalid, other=0).to(tl.int64)
    # This split's keys, clipped to what the queries can see.
    split_start = split.to(tl.int64) * keys_per_split
    start = split_start
    end = tl.minimum(start + keys_per_split, S)
    end = tl.minimum(end, tl.max(tl.where(rvalid, slot, -1), axis=0) + 1)
    if HAS_WINDOW:
        if window_rows >= M:  # every row is windowed: skip the keys before the window
            start = tl.maximum(start, tl.min(tl.where(rvalid, slot, S), axis=0) - window + 1)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    if HAS_WINDOW:
        if SINKS > 0:  # sink keys this split holds below the window's keys
            lo = tl.maximum(split_start, tl.min(tl.where(rvalid, first, S), axis=0))
            hi = tl.minimum(tl.minimum(end, start), tl.max(tl.where(rvalid, first, -1), axis=0) + SINKS)
            acc, m_i, l_i = _key_tiles(q, K, V, KDOC, b, kvh, m, d, dmask, slot, qdoc, first, lo, hi, n, skb, sks,
                                       skh, svb, svs, svh, s_kdoc_b, scale, window, window_rows, m_i, l_i, acc,
                                       BLOCK_N, HAS_WINDOW, SINKS, IEEE)
    acc, m_i, l_i = _key_tiles(q, K, V, KDOC, b, kvh, m, d, dmask, slot, qdoc, first, start, end, n, skb, sks, skh,
                               svb, svs, svh, s_kdoc_b, scale, window, window_rows, m_i, l_i, acc, BLOCK_N,
                               HAS_WINDOW, SINKS, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    tl.store(O + b * sob + split * sop + m[:, None] * som + h[:, None] * soh + d[None, :], o,
             mask=rvalid[:, None] & dmask[None, :])
    tl.store(LSE + b * slb + split * slp + m * slm + h, lse, mask=rvalid)


@triton.jit
def _head_group(Hkv, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    """A paged read's program (row, KV head) = program_id(0): its row r (int64), KV head, which of the
    BLOCK_R group rows are query heads, those heads h, the head-dim offsets d and their mask."""
    pid = tl.program_id(0)
    kvh = pid % Hkv
    g = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    return (pid // Hkv).to(tl.int64), kvh, g < G, kvh * G + g, d, d < D


@triton.jit
def _paged_tiles(q, K, V, TABLE, r, s_table, kvh, d, dmask, lo, hi, n, sks, skh, svs, svh, scale, m_i, l_i, acc,
                 BS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Row r's positions [lo, hi) in tiles of BLOCK_N, each read through its block table, folded into
    the running softmax."""
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + n
        jvalid = j < hi
        blk = tl.load(TABLE + r * s_table + j // BS, mask=jvalid, other=0).to(tl.int64)
        slot = blk * BS + j % BS
        acc, m_i, l_i = _attend_tile(q, K + slot[:, None] * sks + kvh * skh + d[None, :],
                                     V + slot[:, None] * svs + kvh * svh + d[None, :],
                                     jvalid[:, None] & dmask[None, :], jvalid[None, :], scale, m_i, l_i, acc, IEEE)
    return acc, m_i, l_i


# Values that change with a request's length are not specialized on (divisibility by 16, == 1):
# each new class would compile the kernel again, in the middle of serving a long prompt.
@triton.jit(do_not_specialize=["s_table", "slr"])
def paged_fwd(Q, K, V, TABLE, POS, O, LSE,
              sqr, sqh, sks, skh, svs, svh, s_table, sor, sop, soh, slr, slp,
              Hkv, scale, window, keys_per_split,
              BS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
              F16: tl.constexpr, SINKS: tl.constexpr = 0):
    """SINKS > 0 (with a window): a row also sees its sequence's first SINKS positions."""
    split = tl.program_id(1)
    r, kvh, gvalid, h, d, dmask = _head_group(Hkv, G, BLOCK_R, BLOCK_D, D)
    q = tl.load(Q + r * sqr + h[:, None] * sqh + d[None, :], mask=gvalid[:, None] & dmask[None, :], other=0.0)
    if F16:  # fp8 K/V: dots in fp16 (`use_fp16_dots`)
        q, qs = _fp16_queries(q)
        scale = scale / qs
    pos = tl.load(POS + r).to(tl.int64)
    split_start = split.to(tl.int64) * keys_per_split
    start = split_start
    end = tl.minimum(start + keys_per_split, pos + 1)
    if HAS_WINDOW:
        start = tl.maximum(start, pos - window + 1)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    if HAS_WINDOW:
        if SINKS > 0:  # the sink positions this split holds below the window
            acc, m_i, l_i = _paged_tiles(q, K, V, TABLE, r, s_table, kvh, d, dmask, split_start,
                                         tl.minimum(tl.minimum(end, start), SINKS), n, sks, skh, svs, svh, scale,
                                         m_i, l_i, acc, BS, BLOCK_N, IEEE)
    acc, m_i, l_i = _paged_tiles(q, K, V, TABLE, r, s_table, kvh, d, dmask, start, end, n, sks, skh, svs, svh, scale,
                                 m_i, l_i, acc, BS, BLOCK_N, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    tl.store(O + r * sor + split * sop + h[:, None] * soh + d[None, :], o, mask=gvalid[:, None] & dmask[None, :])
    tl.store(LSE + r * slr + split * slp + h, lse, mask=gvalid)


@triton.jit(do_not_specialize=["P", "slb"])
def splitkv_merge(O, LSE, OUT, LSE_OUT, P, M, H,
                  sob, sop, som, soh, slb, slp, slm, s_out_b, s_out_m, s_out_h, s_lo_b, s_lo_m,
                  D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # one (row, query, head)
    h = pid % H
    m = (pid // H) % M
    b = (pid // (H * M)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    top = tl.full([], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        lse = tl.load(LSE + b * slb + p * slp + m * slm + h, mask=p < P, other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, 0))
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: the weights below are 0
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pmask = p < P
        w = tl.exp(tl.load(LSE + b * slb + p * slp + m * slm + h, mask=pmask, other=float("-inf")) - top)
        o = tl.load(O + b * sob + p[:, None] * sop + m * som + h * soh + d[None, :],
                    mask=pmask[:, None] & dmask[None, :], other=0.0)
        total += tl.sum(w, 0)
        acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * s_out_b + m * s_out_m + h * s_out_h + d, out.to(OUT.dtype.element_ty), mask=dmask)
    tl.store(LSE_OUT + b * s_lo_b + m * s_lo_m + h, tl.log(total) + top)
