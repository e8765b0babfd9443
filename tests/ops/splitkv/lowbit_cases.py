"""Run under TRITON_INTERPRET=1, one named case a process (`python -m tests.ops.splitkv.lowbit_cases CASE`,
as test_lowbit.py does; on a GPU `main("all", "cuda")`): the low-bit split-KV kernel against
dequantize-then-attend (`ops.lowbit.dense_kv` + the fp32 naive op) on caches filled through
`LowBitStaticCache`: int4 / int2, GQA (2 and 3 query heads per KV head), odd lengths, sinks or
none, bounds below / at / past the sinks, padded rows, a decode pair (windowed base row +
output row), all rows windowed, one split and several; rotated caches (the default) and
unrotated ones, a head size that is not a power of two (block-diagonal rotation, padded tile);
packed tiles at key-group edges and the layouts of the kernel's per-slot / per-channel paths;
16-bit cases with narrow packed tiles (fp32 dots) and wide ones (head sizes 64 / 128 with groups
of 64: the 16-bit dots of real shapes), through the bit-plane loop with its values folded
into p or dequantized in registers (`dequant_values`), and the interleaving one."""

import sys

import torch

from orthros import OrthrosConfig
from orthros.models.lowbit_cache import LowBitStaticCache
from orthros.ops import attend
from orthros.ops.splitkv import splitkv_takes
from orthros.ops.naive import naive_attention
from orthros.ops.splitkv.study import lowbit_splitkv_attention

W = 8


def filled_cache(kv_dtype, H, Hkv, D, length, sinks, chunks, pad, seed, device="cpu", rotate=True, key_group=16,
                 value_group=16, k_mult=1.0):
    """A one-layer cache with `length` random slots written in `chunks` (then decode steps)."""
    torch.manual_seed(seed)
    cfg = OrthrosConfig.from_name("tiny", num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=Hkv,
                                  head_dim=D, window_size=W)
    B = 2
    cache = LowBitStaticCache(cfg, B, length + 4, device, torch.float32, kv_dtype, key_group=key_group,
                              value_group=min(D & -D, value_group), sinks=sinks, rotate=rotate)
    k = (k_mult * (2 * torch.randn(B, length, Hkv, D) + torch.linspace(-3, 3, D))).to(device)  # per-channel ranges differ
    v = torch.randn(B, length, Hkv, D).to(device)
    doc = torch.zeros(B, length, dtype=torch.long, device=device)
    doc[1, :pad] = -1  # row 1 left-padded
    a = 0
    for c in chunks:
        if a >= length:
            break
        c = min(c, length - a)
        cache.append_tokens(doc[:, a: a + c], torch.full((B,), a + c, device=device),
                            torch.zeros(B, dtype=torch.long, device=device))
        cache.update(0, k[:, a: a + c], v[:, a: a + c])
        a += c
    while a < length:  # the rest as decode steps
        cache.doc[:, a] = doc[:, a]
        cache.decoding = True
        cache.update(0, k[:, a: a + 1], v[:, a: a + 1])
        cache.decoding = False
        cache.advance()
        a += 1
    return cache


def check(kv_dtype, H, Hkv, D, length, sinks, chunks, pad=3, window=None, window_rows=None, M=1, splits=None,
          dtype=torch.float32, seed=0, device="cpu", rotate=True, key_group=16, value_group=16, block_n=64,
          planar=None, dequant_values=None, fp16_dequant=None, q_mult=1.0, k_mult=1.0, packed_kernel=None,
          pad_docs=False, attn_sinks=0):
    cache = filled_cache(kv_dtype, H, Hkv, D, length, sinks, chunks, pad, seed, device, rotate, key_group,
                         value_group, k_mult)
    B = cache.batch_size
    q = (q_mult * torch.randn(B, M, H, D)).to(device, dtype)
    slot = torch.full((B, M), length - 1, device=device)
    slot[:, : M - 1] -= torch.arange(M - 1, 0, -1, device=device)  # earlier rows at earlier slots
    qd = torch.zeros(B, M, dtype=torch.long, device=device)
    if pad_docs:  # row 1's query in a second document starting mid-cache: its packed slots before that are hidden
        cache.doc[1, length // 3:length] = 5
        qd[1] = 5
    kd = cache.doc[:, :length]
    bound = cache.bound_at(length)
    kr, vr = cache.dense(0, length, bound)
    ref = _reference(q.float(), kr, vr, slot, qd, kd, window, window_rows, sinks=attn_sinks)
    out = lowbit_splitkv_attention(q, *cache.layer(0), slot, qd, kd, torch.tensor([bound], device=device), length,
                                   cache.key_bits,
                                   cache.value_bits, cache.key_group, window=window, window_rows=window_rows,
                                   rotation=cache.rotation, num_splits=splits, block_n=block_n,
                                   planar=planar, dequant_values=dequant_values, fp16_dequant=fp16_dequant,
                                   packed_kernel=packed_kernel, sinks=attn_sinks)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    tol = 1e-5
    if dtype != torch.float32:  # 16-bit: the kernel's dots in that dtype; at most 2x the same math in plain
        # PyTorch at that dtype (which grows with the slots a row averages over), and never below 2e-2
        half = _reference(q, kr.to(dtype), vr.to(dtype), slot, qd, kd, window, window_rows, probs_in=dtype,
                          sinks=attn_sinks)
        tol = max(2e-2, 2 * ((half - ref).norm() / ref.norm()).item())
    assert err < tol, (kv_dtype, H, Hkv, D, length, sinks, chunks, window, window_rows, M, splits, dtype, rotate,
                       key_group, value_group, block_n, planar, dequant_values, fp16_dequant, q_mult, packed_kernel,
                       err)
    return bound


def _reference(q, k, v, slot, qd, kd, window, window_rows, probs_in=None, sinks=0):
    """fp32 attention over dense K/V (rows past window_rows: no window; windowed rows with `sinks`);
    probs_in: the probabilities rounded to that dtype before the value product (the 16-bit twin of a
    kernel's math)."""
    rows = [(0, q.shape[1], None if window_rows else window)]
    if window_rows is not None:
        rows = [(0, window_rows, window), (window_rows, q.shape[1], None)]
    out = []
    for a, b, win in rows:
        if probs_in is None:
            out.append(naive_attention(q[:, a:b].float(), k, v, slot[:, a:b], qd[:, a:b], kd, window=win,
                                       sinks=sinks))
            continue
        _, probs = naive_attention(q[:, a:b], k, v, slot[:, a:b], qd[:, a:b], kd, window=win, return_probs=True,
                                   sinks=sinks)
        vf = v.float().transpose(1, 2).repeat_interleave(q.shape[2] // v.shape[2], dim=1)
        out.append((probs.to(probs_in).float() @ vf).transpose(1, 2))
    return torch.cat(out, dim=1).float()


def mixed_key_bits(device="cpu", dtype=torch.float32):
    """A two-layer int2 cache with int4 keys in layer 1 (`key_bits`): each layer's decode read through
    `attend` (the kernel, with that layer's key bits) against dequantize-then-attend of that layer."""
    torch.manual_seed(3)
    cfg = OrthrosConfig.from_name("tiny", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, window_size=W)
    B, T = 2, 150
    cache = LowBitStaticCache(cfg, B, T + 4, device, torch.float32, "int2", key_group=16, value_group=16,
                              key_bits=[2, 4])
    k = (2 * torch.randn(2, B, T, 2, 16) + torch.linspace(-3, 3, 16)).to(device)
    v = torch.randn(2, B, T, 2, 16).to(device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    cache.append_tokens(torch.zeros(B, T - 1, dtype=torch.long, device=device), zeros + T - 1, zeros)
    for i in range(2):
        cache.update(i, k[i, :, : T - 1], v[i, :, : T - 1])
    cache.doc[:, T - 1] = 0
    cache.decoding = True  # the last token as a decode step: written, then read at its slot
    q = torch.randn(B, 1, 4, 16).to(device, dtype)
    slot, qd = torch.full((B, 1), T - 1, device=device), torch.zeros(B, 1, dtype=torch.long, device=device)
    assert splitkv_takes(q, 2, "triton")  # the kernel, not the reference read, answers `attend`
    for i in range(2):
        out = attend(q, cache.write(i, k[i, :, T - 1:], v[i, :, T - 1:]), slot, qd, cache.doc, backend="triton")
        kr, vr = cache.dense(i, T, cache.bound_at(T))
        ref = naive_attention(q.float(), kr, vr, slot, qd, cache.doc[:, :T])
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (i, dtype, err)
    assert cache.kq[1].shape[-1] == 2 * cache.kq[0].shape[-1]  # int4 keys in layer 1, int2 in layer 0


def dtype_cases(kv, device="cpu", which="all"):
    """One cache dtype: GQA, odd lengths, sinks, bounds, one split and several, the decode pair, all rows
    windowed, 16-bit queries; unrotated caches and a head size that is not a power of two.
    which: "fast" leaves the 3-split launches out."""
    half = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter has no bf16 dots
    bounds = set()
    for H, Hkv, D in ((4, 2, 16), (6, 2, 32)):
        for length, sinks, chunks in ((5, 4, [5]), (37, 4, [7, 30]), (61, 0, [64]), (201, 4, [13, 100]),
                                      (300, 2, [1, 299])):
            for splits in (1, None, 3):
                if which == "fast" and splits == 3:
                    continue
                bounds.add(check(kv, H, Hkv, D, length, sinks, chunks, splits=splits, device=device))
        check(kv, H, Hkv, D, 150, 4, [50], window=W, window_rows=1, M=2, device=device)  # a decode pair
        check(kv, H, Hkv, D, 150, 4, [50], window=W, M=1, device=device)  # windowed only: no packed slot read
        # attention sinks (rows from slot 0): windowed rows also read the bf16 sinks, the pair and alone, one
        # split and several
        for sinks, splits in ((2, None), (4, 3)):
            check(kv, H, Hkv, D, 150, 4, [50], pad=0, window=W, window_rows=1, M=2, device=device, attn_sinks=sinks,
                  splits=splits)
            check(kv, H, Hkv, D, 150, 4, [50], pad=0, window=W, M=1, device=device, attn_sinks=sinks, splits=splits)
        check(kv, H, Hkv, D, 150, 4, [150], M=3, dtype=half, device=device)
    for rotate in (False, True):  # unrotated; D = 24: blocks of 8, a 32-wide tile
        D = 24 if rotate else 16
        bounds.add(check(kv, 4, 2, D, 201, 4, [13, 100], device=device, rotate=rotate))
        check(kv, 4, 2, D, 150, 4, [50], window=W, window_rows=1, M=2, device=device, rotate=rotate)
        check(kv, 4, 2, D, 150, 4, [150], M=3, dtype=half, device=device, rotate=rotate)
    assert bounds == {0, 16, 48, 192, 288}, bounds  # no bound, one key group, several


def edge_cases(device="cpu", kvs=("int4", "k4v2")):
    """Tiles at key-group edges: several tiles a group, split starts inside a group (block 16 < group 32);
    groups of 48 (tiles of 16, the largest power of two dividing it); block 128 > group; groups of 8
    (a tile spans groups: the per-slot path); head size 24 with value groups of 6 (non-power-of-two
    groups; int2 bytes straddle groups: the per-channel path)."""
    half = torch.float16 if device == "cpu" else torch.bfloat16
    for kv in [x for x in kvs if x != "int2"]:
        check(kv, 4, 2, 16, 150, 4, [150], splits=3, key_group=32, block_n=16, device=device)
        check(kv, 4, 2, 16, 200, 4, [60], splits=2, key_group=48, device=device)
        check(kv, 4, 2, 16, 100, 3, [100], key_group=16, block_n=128, device=device)
        check(kv, 4, 2, 16, 100, 4, [30], splits=2, key_group=8, device=device)
        check(kv, 6, 2, 24, 100, 4, [100], splits=2, value_group=6, device=device, rotate=False)
        check(kv, 6, 2, 24, 100, 4, [40], value_group=6, key_group=8, window=W, window_rows=1, M=2, dtype=half,
              device=device, rotate=False)


def wide_and_mixed_cases(device="cpu", kvs=("int4", "int2", "k4v2")):
    """The 16-bit dots of real shapes, and int4 keys in some layers of an int2 cache."""
    half = torch.float16 if device == "cpu" else torch.bfloat16
    if "int2" in kvs:
        mixed_key_bits(device)
        mixed_key_bits(device, half)
    wide_cases(device, kvs, half)


# the interpreter's cases, one process each (tests/ops/splitkv/test_lowbit.py parametrizes over them)
CASES = {
    "int4": lambda dev: dtype_cases("int4", dev),
    "int2": lambda dev: dtype_cases("int2", dev),
    "k4v2": lambda dev: dtype_cases("k4v2", dev),
    "edges": lambda dev: edge_cases(dev),
    "wide-and-mixed": lambda dev: wide_and_mixed_cases(dev),
    "finish": lambda dev: (finish_case(dev), bf16_split_case(dev)),
}


def main(which: str, device: str = "cpu", kvs=("int4", "int2", "k4v2")):
    """Every case but the Gluon path's merge: which "fast" leaves the 3-split launches out; on a GPU the
    16-bit cases run in bf16; kvs: the cache dtypes checked (a GPU test runs one each, in parallel)."""
    for kv in kvs:
        dtype_cases(kv, device, which)
    wide_and_mixed_cases(device, kvs)
    edge_cases(device, kvs)
    print("ok")


def wide_cases(device="cpu", kvs=("int4", "int2", "k4v2"), half=torch.float16):
    """Wide packed tiles (the 16-bit dots): head size 64 (int2 keys: 16 bytes) and 128, groups of 64 and
    32, through the bit-plane loop (the default there: keys and values dequantized in fp16, `fp16_dequant`),
    its earlier forms (keys folded into q and values dequantized in fp32; values folded into p) and the
    interleaving one; on a GPU bf16 and fp16 queries, and bf16 queries past 2^14 (the fp16 loop's
    power-of-two query scale; the interpreter's bf16 dots are wrong, so not on CPU)."""
    halves = (half,) if device == "cpu" else (torch.bfloat16, torch.float16)
    for kv in kvs:
        for D in (64, 128) if device != "cpu" else (64,):
            for rotate, planar, vdq, f16 in ((True, None, False, None), (False, None, False, None),
                                             (True, False, None, None), (True, None, True, False),
                                             (True, None, None, None), (False, None, None, None)):
                check(kv, 4, 2, D, 300, 4, [300], M=1, dtype=half, device=device, rotate=rotate, key_group=64,
                      value_group=64, planar=planar, dequant_values=vdq, fp16_dequant=f16)
            for dt in halves:
                check(kv, 4, 2, D, 300, 4, [100], window=W, window_rows=1, M=2, dtype=dt, device=device,
                      key_group=64, value_group=32 if kv == "int4" else 64, splits=2,
                      dequant_values=True)  # int4: 2-4 value groups (int2 values need 64 for 16-byte planes)
                check(kv, 4, 2, D, 300, 4, [100], window=W, window_rows=1, M=2, dtype=dt, device=device,
                      key_group=64, value_group=64, splits=2)  # a decode pair, the default loop
                if dt == torch.bfloat16:  # |q| * softmax scale > 2^14: the fp16 loop's power-of-two query scale,
                    # keys scaled down so that the logits stay about as sharp as the other cases' and the key
                    # scales stay normal fp16 numbers. Sharper logits are ill-conditioned for any 16-bit dot:
                    # seen on the H200 (2026-12-02), int2 with q alone x 1e5: error 0.19; x 3e5 with keys x 2e-4
                    # (logits 60x the other cases'): 0.033; int4 within tolerance in both
                    check(kv, 4, 2, D, 300, 4, [300], M=1, dtype=dt, device=device, key_group=64, value_group=64,
                          q_mult=6e4, k_mult=5e-5)
        check(kv, 6, 2, 128, 200, 4, [70], M=1, dtype=half, device=device, key_group=32, value_group=32,
              block_n=16, splits=3)


def quick_cases(device="cuda", kvs=("int4", "int2", "k4v2")):
    """A short GPU subset (a minute or two of compiles): the default loop at the Llama-3.1-8B and
    SmolLM2 attention shapes with bf16 and fp16 queries, decode pairs over 3 splits, queries past 2^14,
    the loop before (fp16_dequant=False), an unrotated cache; then the mixed key bits."""
    for kv in kvs:
        for D, H, Hkv in ((128, 32, 8), (64, 9, 3)):
            for dt in (torch.bfloat16, torch.float16):
                check(kv, H, Hkv, D, 1000, 4, [1000], M=1, dtype=dt, device=device, key_group=64, value_group=64)
                check(kv, H, Hkv, D, 700, 4, [300], window=W, window_rows=1, M=2, dtype=dt, device=device,
                      key_group=64, value_group=64, splits=3)
            for extra in (dict(q_mult=6e4, k_mult=5e-5), dict(fp16_dequant=False), dict(rotate=False)):
                check(kv, H, Hkv, D, 1000, 4, [1000], M=1, dtype=torch.bfloat16, device=device, key_group=64,
                      value_group=64, **extra)
        print(kv, "ok", flush=True)
    mixed_key_bits(device)
    mixed_key_bits(device, torch.bfloat16)


def finish_case(device="cpu"):
    """The Gluon path's merge (`ops.splitkv.lowbit.finish`) against the same sums in PyTorch: the bf16 splits
    (one, or four: their bf16 part; their packed part zero) for every row, the packed splits after them
    (packed part) from row0 on; the bf16 parts of the packed splits and the packed splits of the rows
    before row0 hold garbage that must not be read; splits with nothing seen (lse -inf), a bf16 one
    among them; rotated and not."""
    from orthros.ops.lowbit import rotation_matrix
    from orthros.ops.splitkv.lowbit import finish

    torch.manual_seed(5)
    B, P, M, H, D, row0 = 2, 300, 3, 4, 64, 1  # several of the merge's chunks of splits
    for NB in (1, 4):
        o = torch.randn(B, P, M, H, 2, D, device=device)
        o[:, :NB, :, :, 1] = 0.0
        lse = 3 * torch.randn(B, P, M, H, device=device)
        lse[:, 5] = float("-inf")
        if NB > 1:
            lse[:, NB - 1, 0] = float("-inf")  # an empty bf16 split beside others
        lse[:, 250] += 30  # the maximum grows in a later chunk: the partial sums are rescaled
        o[:, NB:, :row0] = float("nan")  # never written by the packed kernel
        lse[:, NB:, :row0] = float("nan")
        o[:, NB:, :, :, 0] = float("nan")  # the packed splits' bf16 part: not written either
        for rot in (None, rotation_matrix(D, device)):
            out = finish(o, lse, row0, rot, torch.float32, NB)
            want = torch.empty(B, M, H, D, device=device)
            for m in range(M):
                n = P if m >= row0 else NB
                w = torch.softmax(lse[:, :n, m], dim=1)  # [B, n, H]
                bf16 = (w[:, :NB, :, None] * o[:, :NB, m, :, 0]).sum(1)
                packed = (w[:, NB:, :, None] * o[:, NB:n, m, :, 1]).sum(1)
                want[:, m] = bf16 + (packed if rot is None else packed @ rot)
            err = ((out - want).norm() / want.norm()).item()
            assert err < 1e-5, (NB, rot is not None, err)


def bf16_split_case(device="cpu"):
    """The Gluon path's bf16 splits (`ops.splitkv.lowbit.bf16_split`): q R made by the kernel is
    `ops.lowbit.rotate`'s, bit for bit (head sizes 64, 24: block-diagonal, padded tile), and the splits'
    outputs merged are attention over the sinks and the ring alone (the packed slots hidden from the
    reference); one split (a short ring) and two (a ring of 136 slots, 52 slots from the bound on)."""
    from orthros.ops.lowbit import rotate
    from orthros.ops.splitkv.lowbit import bf16_split, bf16_splits

    for D, dt, g, L in ((64, torch.bfloat16, 16, 300), (24, torch.float32, 16, 300), (64, torch.bfloat16, 64, 500)):
        cache = filled_cache("int4", 8, 2, D, L, 4, [L], pad=0, seed=2, device=device, key_group=g)
        B, NB = cache.batch_size, bf16_splits(cache.rk[0], g)
        assert NB == (2 if g == 64 else 1)
        q = torch.randn(B, 1, 8, D, device=device).to(dt)
        slot, qd = torch.full((B, 1), L - 1, device=device), torch.zeros(B, 1, dtype=torch.long, device=device)
        bound = cache.bound_at(L)
        o = torch.full((B, NB + 1, 1, 8, 2, D), float("nan"), device=device)
        lse = torch.full((B, NB + 1, 1, 8), float("nan"), device=device)
        qr = bf16_split(q, *cache.layer(0), slot, qd, cache.doc[:, :L], torch.tensor([bound], device=device), L,
                        cache.key_bits, cache.value_bits, cache.key_group, o, lse, rotation=cache.rotation)
        want = rotate(q)
        if device == "cpu" and dt != torch.float32:  # the interpreter casts fp32 to bf16 by truncation
            assert ((qr.float() - want).abs() <= want.abs() * 2**-7).all(), D
        else:
            assert torch.equal(qr, want.to(dt)), D
        kd, vd = cache.dense(0, L, bound)
        kdoc = cache.doc[:, :L].clone()
        kdoc[:, 4:bound] = -7  # the packed slots: another document
        ref = _reference(q.float(), kd, vd, slot, qd, kdoc, None, None)
        assert torch.isfinite(lse[:, :NB]).all() and torch.isnan(lse[:, NB]).all()  # NB splits, none empty
        w = torch.softmax(lse[:, :NB], dim=1)[..., None]
        out = (w * o[:, :NB, :, :, 0]).sum(1)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (D, g, err)


GLUON_SHAPES = ((128, 32, 8), (64, 9, 3), (128, 8, 2))
"""(head size, query heads, KV heads) of the Gluon cases"""


def gluon_cases(device="cuda", kvs=("int4", "int2", "k4v2"), shapes=GLUON_SHAPES):
    """The Gluon packed kernel (`ops/splitkv/lowbit_gluon.py`, asked for explicitly): head sizes 128 and
    64 with 4 and 3 query heads a KV head (one output row, a decode pair, two output rows), bf16 and fp16
    queries, lengths across tiles and key groups (past the bound, a bound of 0), one split, several
    (with empty ones) and the default count, a second document hiding part of the packed slots,
    unrotated caches, queries past 2^14, and more slots than the default split count has programs
    (with the first shape). Every case runs; the failures are listed, then raised."""
    failed = []

    def check(*args, **kw):
        try:
            globals()["check"](*args, **kw)
        except AssertionError as e:
            failed.append(e)
            print("FAILED", e, flush=True)

    for kv in kvs:
        for D, H, Hkv in shapes:
            for dt in (torch.bfloat16, torch.float16):
                for length, chunks, splits in ((1000, [1000], None), (300, [300], 1), (4100, [4100], 7),
                                               (150, [150], None), (700, [300], 3)):
                    check(kv, H, Hkv, D, length, 4, chunks, M=1, dtype=dt, device=device, key_group=64,
                          value_group=64, splits=splits, packed_kernel="gluon")
                check(kv, H, Hkv, D, 700, 4, [300], window=W, window_rows=1, M=2, dtype=dt, device=device,
                      key_group=64, value_group=64, packed_kernel="gluon")  # the decode pair
                if H // Hkv <= 4:
                    check(kv, H, Hkv, D, 900, 4, [900], M=2, dtype=dt, device=device, key_group=64,
                          value_group=64, packed_kernel="gluon")  # two output rows
            check(kv, H, Hkv, D, 2000, 4, [2000], M=1, dtype=torch.bfloat16, device=device, key_group=64,
                  value_group=64, pad_docs=True, packed_kernel="gluon")
            check(kv, H, Hkv, D, 2000, 0, [2000], M=1, dtype=torch.bfloat16, device=device, key_group=128,
                  value_group=64, rotate=False, packed_kernel="gluon")  # no sinks, groups of 128, unrotated
            check(kv, H, Hkv, D, 1000, 4, [1000], M=1, dtype=torch.bfloat16, device=device, key_group=64,
                  value_group=64, q_mult=6e4, k_mult=5e-5, packed_kernel="gluon")
        if GLUON_SHAPES[0] in shapes:
            check(kv, 32, 8, 128, 70000, 4, [70000], M=1, dtype=torch.bfloat16, device=device, key_group=64,
                  value_group=64, packed_kernel="gluon")  # more tiles than programs: several tiles a split
        print(kv, "gluon done", flush=True)
    assert not failed, f"{len(failed)} Gluon cases failed: {failed}"


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if which in CASES:
        CASES[which](dev)
        print("ok")
    elif which == "quick":
        quick_cases(dev)
        print("ok")
    elif which == "gluon":  # optional third argument: the cache dtypes, comma-separated
        gluon_cases(dev, *([tuple(sys.argv[3].split(","))] if len(sys.argv) > 3 else []))
        print("ok")
    else:
        main(which, dev)
