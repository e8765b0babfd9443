"""Every fast path against the fp32 naive op: forward and dq, dk, dv.

Tolerance as in flash-attention: the op's error against the fp32 reference
is at most 2x that of the same computation in plain PyTorch at the op's
dtype (fla's relative RMS error; NaN never passes). Sizes are odd on
purpose (T = 1, 63, 111, 1025; head_dim 64 and 48/80), with GQA, packed
documents, padding, SFT-like query subsets and a KV-cache offset.

On CPU the blocked PyTorch path is checked everywhere, FlexAttention's
mask logic runs uncompiled, its tile classification is checked against a
dense mask, and the Triton split-KV kernel runs under TRITON_INTERPRET=1 in
a subprocess. With CUDA the same cases run the compiled kernels.
"""

from __future__ import annotations

import functools

import pytest
import torch

from orthros.ops import attention, naive_attention
from orthros.ops.blocks import block_states, key_bounds
from orthros.ops.masks import visible

from ..conftest import rel_err, run_triton_interpreted
from .cases import check, make_case

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
LOWP = torch.bfloat16


def op(backend, dense_start=None):
    return functools.partial(attention, backend=backend, dense_start=dense_start)


# ---------------------------------------------------------------- CPU path
@pytest.mark.parametrize("T", [1, 63, 111, 1025])
@pytest.mark.parametrize("phase,docs,past", [("base", "packed", 0), ("base", "padded", 37), ("base", "dense", 20),
                                             ("out", "packed", 0), ("out", "dense", 0), ("few", "padded", 300)])
def test_chunked(T, phase, docs, past):
    if T == 1025 and phase == "out":
        T = 300  # the reference's T x T backward is slow on 2 cores; chunks are still many
    case = make_case(phase, T=T, D=64 if T % 2 else 48, past=past, docs=docs, window=16, seed=T)
    check(op("chunked", case["dense_start"]), case)


@pytest.mark.parametrize("window", [1, 7, 200])
def test_chunked_bf16_sft_subset(window):
    case = make_case("out", T=111, D=80, docs="padded", dtype=LOWP, subset=True, seed=window)
    check(op("chunked"), case)
    case = make_case("base", T=111, D=80, docs="padded", dtype=LOWP, window=window, past=5)
    check(op("chunked"), case)


@pytest.mark.parametrize("docs", ["packed", "dense"])
def test_chunked_base_stream_is_linear(monkeypatch, docs):
    """The CPU base stream never builds a T x T score matrix: every SDPA call reads at most
    C + W - 1 keys per chunk of C queries, and the chunks go in a few calls, not T / C."""
    import orthros.ops.sdpa_cpu as sc

    seen = []
    real = sc._sdpa
    spy = lambda q, k, *a, **kw: seen.append((q.shape[0] * q.shape[2], q.shape[2], k.shape[2])) or real(q, k, *a, **kw)
    monkeypatch.setattr(sc, "_sdpa", spy)
    W, T = 32, 4096
    case = make_case("base", B=1, T=T, H=2, Hkv=1, D=16, window=W, docs=docs)
    out = attention(case["q"], case["k"], case["v"], case["q_slot"], case["q_doc"], case["k_doc"], window=W,
                    backend="auto", dense_start=case["dense_start"])
    assert [c for c in seen if c[2] > c[1] + W - 1] == [] and sum(c[0] for c in seen) >= T and len(seen) <= 3
    s = T - 200  # the last 200 queries against the reference on their keys
    ref = naive_attention(case["q"][:, s:], case["k"][:, s - W:], case["v"][:, s - W:], case["q_slot"][:, s:] - (s - W),
                          case["q_doc"][:, s:], case["k_doc"][:, s - W:], window=W)
    assert rel_err(out[:, s:], ref) < 1e-5


def test_unknown_backend_is_a_clear_error():
    case = make_case("base", T=8)
    with pytest.raises(ValueError, match="backend"):
        attention(case["q"], case["k"], case["v"], case["q_slot"], case["q_doc"], case["k_doc"], backend="cudnn")


# ------------------------------------------------- FlexAttention mask logic
@pytest.mark.parametrize("seed", range(12))
def test_block_states_are_exact_supersets(seed):
    """Tiles marked empty hold no visible key; tiles marked full hold only visible keys."""
    g = torch.Generator().manual_seed(seed)
    phase = ["base", "out", "few"][seed % 3]
    T = int(torch.randint(1, 300, (1,), generator=g))
    case = make_case(phase, T=T, past=int(torch.randint(0, 50, (1,), generator=g)), docs=["packed", "padded", "dense"][seed % 3],
                     window=int(torch.randint(1, 80, (1,), generator=g)), seed=seed, subset=seed % 2 == 0)
    B, M = case["q_doc"].shape
    S = case["k_doc"].shape[1]
    lo, hi = key_bounds(case["q_slot"], case["q_doc"], case["k_doc"], case["window"])
    mask = visible(case["q_slot"].expand(B, M)[:, :, None], torch.arange(S)[None, None], case["q_doc"][:, :, None],
                   case["k_doc"][:, None], case["window"])
    j = torch.arange(S)[None, None]
    assert not (mask & ((j < lo[..., None]) | (j > hi[..., None]))).any(), "a visible key lies outside [lo, hi]"
    bq, bk = 16, 32
    st = block_states(lo, hi, S, bq, bk, case["q_doc"], case["k_doc"])
    pad = torch.zeros(B, st.shape[1] * bq, st.shape[2] * bk, dtype=torch.bool)
    pad[:, :M, :S] = mask
    tiles = pad.view(B, st.shape[1], bq, st.shape[2], bk)
    anyv = tiles.any(4).any(2)
    allv = tiles.all(4).all(2)
    assert not (anyv & (st == 0)).any(), "a visible key in a tile marked empty"
    assert not ((st == 2) & ~allv).any(), "a tile marked full has an invisible key"


@pytest.mark.parametrize("phase,docs,T,past", [("base", "packed", 63, 0), ("base", "dense", 111, 40),
                                               ("out", "padded", 111, 0), ("out", "dense", 63, 0)])
def test_flex_mask_mod(phase, docs, T, past):
    """FlexAttention's mask_mod and chunking (uncompiled on CPU; compiled kernels on CUDA)."""
    case = make_case(phase, T=T, past=past, docs=docs, window=9, device=DEV, dtype=LOWP if CUDA else torch.float32,
                     subset=docs == "padded")
    check(op("flex", case["dense_start"]), case, backward=CUDA)  # no FlexAttention backward on CPU


def test_flex_int32_chunking_matches_one_call(monkeypatch):
    """Cutting queries for the 32-bit limit (forced low here) changes nothing."""
    import orthros.ops.flex as fx

    calls = []
    real = fx._one_call
    monkeypatch.setattr(fx, "_one_call", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    for docs in ("packed", "dense"):
        case = make_case("base", T=200, past=30, docs=docs, window=20, device=DEV)
        args = [case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc")]
        one = fx.flex_attention_op(*args, window=20, dense_start=case["dense_start"])
        calls.clear()
        cut = fx.flex_attention_op(*args, window=20, dense_start=case["dense_start"], limit=70_000)  # q: 102400 elements
        assert calls == [128, 72]
        torch.testing.assert_close(cut, one, rtol=1e-5, atol=1e-5)


# --------------------------------------------------- Triton split-KV kernel
SPLITKV_CASES = [  # (phase, docs, T, past, D, dtype)
    ("few", "padded", 1, 190, 64, torch.float32),
    ("few", "packed", 2, 255, 48, torch.float32),
    ("few", "dense", 1, 300, 64, torch.float32),
    ("base", "packed", 1, 200, 80, torch.float32),  # a decoding step of the base stream (window)
    ("few", "packed", 63, 0, 64, torch.float16),  # bf16 too on CUDA (the interpreter mishandles bf16)
]


def run_splitkv_cases(device):
    from orthros.ops.splitkv import splitkv_attention

    cases = SPLITKV_CASES + ([SPLITKV_CASES[-1][:-1] + (torch.bfloat16,)] if device == "cuda" else [])
    for i, (phase, docs, T, past, D, dtype) in enumerate(cases):
        case = make_case(phase, T=T, past=past, docs=docs, D=D, dtype=dtype, device=device, window=24, seed=i)
        check(op("triton", case["dense_start"]), case, backward=False)
        # several splits and a forced LSE merge
        check(lambda *a, **kw: splitkv_attention(*a, **kw, num_splits=5, block_n=16), case, backward=False)
        args = [case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc")]
        _, lse = splitkv_attention(*args, window=case["window"], num_splits=5, block_n=16, return_lse=True)
        _, ref = naive_attention(*(a.float() if a.is_floating_point() else a for a in args), window=case["window"],
                                 return_lse=True)
        seen = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(lse), seen) and rel_err(lse[seen], ref[seen]) < 1e-5
    check_window_rows(device)


def check_window_rows(device, W=24):
    """Base and output rows of a decode step in one call: only the first rows are windowed."""
    for docs, M, r in (("packed", 2, 1), ("padded", 4, 2), ("dense", 3, 3)):
        case = make_case("base", T=M, past=190, docs=docs, device=device, window=W, seed=M)
        q, k, v, slot, qdoc, kdoc = (case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc"))
        slot = slot.expand(q.shape[0], -1)
        ref = torch.cat([naive_attention(q[:, :r], k, v, slot[:, :r], qdoc[:, :r], kdoc, window=W),
                         naive_attention(q[:, r:], k, v, slot[:, r:], qdoc[:, r:], kdoc, window=None)], 1)
        for backend in ("triton", "chunked"):
            out = attention(q, k, v, slot, qdoc, kdoc, window=W, backend=backend, window_rows=r)
            assert rel_err(out, ref) < 1e-5, (docs, backend)


def test_window_rows_chunked():
    check_window_rows("cpu")


def test_splitkv_triton_interpreter():
    """The Triton kernel under TRITON_INTERPRET=1 on CPU, in a subprocess (the flag must precede `import triton`)."""
    r = run_triton_interpreted("-m", "tests.ops.test_fast_ops")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the interpreter test covers the kernel on CPU)")
def test_splitkv_cuda():
    run_splitkv_cases("cuda")


# ------------------------------------------------------------ CUDA kernels
GPU_CASES = [  # (phase, docs, T, past, D, window, subset)
    ("base", "packed", 1, 0, 64, 16, False),
    ("base", "padded", 63, 17, 80, 16, False),
    ("base", "dense", 1025, 0, 64, 128, False),
    ("base", "dense", 111, 1000, 96, 64, False),
    ("out", "packed", 1025, 0, 64, None, False),
    ("out", "dense", 1025, 0, 128, None, False),
    ("out", "padded", 111, 0, 48, None, True),
    ("few", "packed", 63, 0, 64, 16, False),
]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the CPU path runs the same cases in test_chunked)")
@pytest.mark.parametrize("phase,docs,T,past,D,window,subset", GPU_CASES)
def test_cuda_auto(phase, docs, T, past, D, window, subset):
    dtype = torch.float16 if T == 111 else torch.bfloat16
    case = make_case(phase, T=T, past=past, docs=docs, D=D, window=window, subset=subset, dtype=dtype, device="cuda", H=8, Hkv=2)
    check(op("auto", case["dense_start"]), case)  # autograd on: FlexAttention / SDPA
    check(op("auto", case["dense_start"]), case, backward=False)  # inference: split-KV where few queries


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_beyond_int32_base_stream():
    """A base-stream call whose query tensor has > 2^31 elements, against reference slices."""
    B, T, H, Hkv, D, W = 1, (1 << 31) // (32 * 128) + 4096, 32, 8, 128, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert q.numel() > 2**31
    slot = torch.arange(T, device="cuda")[None]
    doc = torch.zeros(B, T, dtype=torch.long, device="cuda")
    with torch.no_grad():
        out = attention(q, k, v, slot, doc, doc, window=W, dense_start=0)
    for s in (0, T // 2, T - 700):
        e = s + 700
        a = max(0, s - W + 1)
        ref = attention(q[:, s:e], k[:, a:e], v[:, a:e], slot[:, s:e] - a, doc[:, s:e], doc[:, a:e], window=W, backend="naive")
        err = (out[:, s:e].float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, (s, err)


if __name__ == "__main__":  # the interpreter subprocess
    run_splitkv_cases("cpu")
    print("ok")


@pytest.mark.skipif(not CUDA, reason="needs CUDA (test_flex_mask_mod runs the mask logic on CPU)")
@pytest.mark.parametrize("docs", ["dense", "packed"])
@pytest.mark.parametrize("T,past", [(1, 0), (2, 0), (17, 3), (129, 0), (130, 126)])
def test_cuda_flex_partial_tiles(docs, T, past):
    """Compiled FlexAttention, forward and backward, where queries or keys fill less than a tile."""
    case = make_case("base", T=T, past=past, docs=docs, D=64, window=16, dtype=torch.bfloat16, device="cuda",
                     H=8, Hkv=2, seed=T)
    check(op("flex", case["dense_start"]), case)


def test_triton_check_is_quiet_inside_compiled_code():
    """Regression: `triton_available` was functools.cache'd, and every compiled decode step that
    asked it (the low-bit cache's kernel check) printed dynamo's lru_cache warning and trace."""
    import warnings

    from orthros.ops import triton_available

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x + 1 if triton_available() else x - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(torch.zeros(2))
    assert not [w for w in caught if "lru_cache" in str(w.message)]
