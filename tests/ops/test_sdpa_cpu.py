"""The SDPA-based CPU path (`ops/sdpa_cpu.py`) against the fp32 naive op: forward, dq, dk, dv.

The dense path (`dense_start`) splits a windowed stream into a causal head
and a band of unfolded chunks; these cases put the split, the chunk edges
and the cache offset everywhere it can fall (windows 1 / 16 / >= T, offsets
inside and past the first window, rows of any length). The band with
documents (any base stream) and the masked chunks (output queries) are
checked on packed documents, padding and rows that see nothing. fp64 goes
through gradcheck; every path must run on SDPA's flash kernel (no math
fallback that would materialise scores).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import orthros.ops.sdpa_cpu as sc
from orthros.ops import attention
from orthros.ops.masks import NO_QUERY_DOC

from .cases import check, make_case


def op(dense_start=None):
    return functools.partial(attention, backend="chunked", dense_start=dense_start)


@pytest.mark.parametrize("T", [1, 63, 111, 1025])
@pytest.mark.parametrize("window,past,D", [(1, 0, 64), (16, 0, 80), (16, 5, 64), (16, 300, 80), (2000, 0, 64),
                                           (128, 100, 64)])
def test_dense_base_stream(T, window, past, D):
    """Causal head (slots < W), band of unfolded chunks, the window covering everything."""
    if T == 1025 and (window, past) not in ((16, 5), (128, 100)):
        T = 300  # the same code paths; the reference's T x T backward is slow on 2 cores
    case = make_case("base", T=T, D=D, past=past, docs="dense", window=window, seed=T + past)
    check(op(past), case)


@pytest.mark.parametrize("T,past", [(1, 0), (63, 0), (1025, 0), (2, 40), (111, 37), (1, 500)])
def test_dense_full_causal(T, past):
    """No window: square causal from slot 0, a single unmasked query, a masked later chunk."""
    case = make_case("base", T=T, past=past, docs="dense", window=None, D=48 if T % 2 else 64, seed=T)
    check(op(past), case)


def test_dense_offset_causal_in_chunks(monkeypatch):
    """A later prefill chunk without window: query blocks under a bounded mask change nothing."""
    monkeypatch.setattr(sc, "MASK_BUDGET", 2000)
    case = make_case("base", T=70, past=45, docs="dense", window=None, seed=3)
    check(op(45), case)


@pytest.mark.parametrize("phase,T,past,seed", [("out", 111, 0, 0), ("few", 1, 300, 0), ("few", 2, 300, 0),
                                               ("few", 1, 300, 1), ("few", 2, 7, 1)])
def test_dense_output_stream(phase, T, past, seed):
    """Pre-training (all positions), one or two queries over a cache, with and without window."""
    case = make_case(phase, T=T, past=past, docs="dense", window=24, D=80, seed=seed)
    check(op(case["dense_start"]), case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_low_precision_and_batch(dtype):
    for window, past in ((16, 0), (16, 50), (None, 9)):
        case = make_case("base", B=3, T=111, past=past, docs="dense", window=window, dtype=dtype, seed=past)
        check(op(past), case)


@pytest.mark.parametrize("docs,window", [("packed", 1), ("padded", 16), ("packed", None), ("padded", 500)])
def test_masked_path(docs, window):
    for phase in ("base", "out"):
        case = make_case(phase, T=111, past=0 if phase == "out" else 21, docs=docs, window=window, seed=7)
        check(op(), case)
    check(op(), make_case("out", T=111, docs=docs, subset=True, seed=8))  # SFT: padded query rows


@pytest.mark.parametrize("phase,docs", [("base", "packed"), ("base", "dense"), ("out", "padded")])
def test_rows_that_see_nothing(phase, docs):
    """Invalid queries (and queries of a document without keys) give 0 and zero gradients:
    in the band (base stream) and in the masked chunks (output stream)."""
    window = 16 if phase == "base" else None
    case = make_case(phase, B=2, T=63, docs=docs, window=window, seed=1)
    q_doc = case["q_doc"].clone()
    q_doc[0, :5] = NO_QUERY_DOC
    q_doc[1, -3:] = int(case["k_doc"].max()) + 1  # a document with no key
    case["q_doc"], case["dense_start"] = q_doc, None  # the dense promise forbids empty rows
    check(op(), case)
    q = case["q"].clone().requires_grad_(True)
    out = attention(q, case["k"], case["v"], case["q_slot"], q_doc, case["k_doc"], window=window, backend="chunked")
    out.square().sum().backward()
    assert torch.all(out[0, :5] == 0) and torch.all(out[1, -3:] == 0)
    assert torch.all(q.grad[0, :5] == 0) and torch.isfinite(q.grad).all()


def _gradcheck(fn, case):
    q, k, v = (case[n].detach().double().requires_grad_(True) for n in ("q", "k", "v"))
    rest = (case["q_slot"], case["q_doc"], case["k_doc"])
    f = lambda q, k, v: fn(q, k, v, *rest, window=case["window"])
    assert f(q, k, v).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("window,past", [(3, 0), (3, 2), (3, 9), (None, 0), (None, 4)])
def test_gradcheck_float64_dense(monkeypatch, window, past):
    """fp64 stays fp64 end to end; chunks of 4 queries so that the band has several."""
    monkeypatch.setattr(sc, "band_chunk", lambda w: 4)
    case = make_case("base", B=2, T=11, H=2, Hkv=1, D=4, past=past, docs="dense", window=window, seed=past)
    _gradcheck(op(past), case)


@pytest.mark.parametrize("phase,subset", [("base", False), ("out", True)])
def test_gradcheck_float64_masked(phase, subset):
    """The band with documents (base stream) and the masked chunks (SFT-like output queries)."""
    case = make_case(phase, B=2, T=9, H=2, Hkv=1, D=4, past=3 if phase == "base" else 0, docs="padded", window=3,
                     subset=subset, seed=2)
    _gradcheck(op(), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_runs_on_the_flash_kernel(dtype):
    """Every SDPA call of the CPU path (forward and backward) is one the flash kernel takes:
    with only that backend allowed, an unsupported call would raise instead of falling back."""
    cases = [make_case("base", T=111, past=p, docs="dense", window=w, dtype=dtype, seed=1)
             for p, w in ((0, 16), (40, 16), (0, None), (30, None))]
    cases += [make_case("few", T=1, past=200, docs="dense", dtype=dtype, seed=0),
              make_case("base", T=63, past=10, docs="padded", window=8, dtype=dtype),
              make_case("out", T=63, docs="packed", subset=True, dtype=dtype)]
    for case in cases:
        q, k, v = (case[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = attention(q, k, v, case["q_slot"], case["q_doc"], case["k_doc"], window=case["window"],
                            backend="chunked", dense_start=case["dense_start"])
            out.sum().backward()
        assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("docs,T", [("dense", 7 + 96), ("packed", 96)])
def test_any_input_strides(docs, T):
    """Inputs in head-major memory ([B, H, T, D] storage seen as [B, T, H, D]) give the same result
    (T: the band's queries fill whole chunks, so no padding copy makes them contiguous)."""
    case = make_case("base", T=T, past=9, docs=docs, window=16, seed=4)
    args = (case["q_slot"], case["q_doc"], case["k_doc"])
    ref = attention(case["q"], case["k"], case["v"], *args, window=16, backend="chunked", dense_start=case["dense_start"])
    q, k, v = (case[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("q", "k", "v"))
    assert not q.is_contiguous()
    out = attention(q, k, v, *args, window=16, backend="chunked", dense_start=case["dense_start"])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
