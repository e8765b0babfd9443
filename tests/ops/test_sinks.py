"""Attention sinks: a windowed query also sees its document's first S keys.

The reference op is checked against a mask written out by loops; every other path (chunked on CPU,
FlexAttention uncompiled on CPU and compiled on CUDA, the dispatcher's few-query and pair paths)
against the reference op. Model-level invariants (phases agree, padding and packing, W >= T) are in
tests/models/test_sinks.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from orthros.ops import attention, naive_attention
from orthros.ops.masks import doc_rank

from .cases import make_case, rel_err

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def loop_mask(q_slot, q_doc, k_doc, window, sinks):
    """[B, M, S] bool from the definition, key by key (each key's document start found by walking back)."""
    B, M = q_doc.shape
    S = k_doc.shape[1]
    slot = q_slot.expand(B, M)
    out = torch.zeros(B, M, S, dtype=torch.bool)
    for b in range(B):
        first = 0
        for j in range(S):
            if j and k_doc[b, j] != k_doc[b, j - 1]:
                first = j
            seen = (j <= slot[b]) & (q_doc[b] == k_doc[b, j])
            if window is not None:
                seen &= (slot[b] - j < window) | (j - first < sinks)
            out[b, :, j] = seen
    return out


def test_doc_rank_counts_from_each_run():
    k_doc = torch.tensor([[-1, -1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 2, 2]])
    assert doc_rank(k_doc).tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 0, 1]]


@pytest.mark.parametrize("docs", ["dense", "packed", "padded"])
@pytest.mark.parametrize("sinks", [1, 4])
def test_reference_op_sees_window_and_first_keys(docs, sinks):
    case = make_case("base", T=40, past=9, docs=docs, window=5, seed=sinks)
    q, k, v, slot, qdoc, kdoc = (case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc"))
    _, p = naive_attention(q, k, v, slot, qdoc, kdoc, window=5, sinks=sinks, return_probs=True)
    seen = p.abs().sum(1) > 0  # [B, M, S]: which keys got any probability
    assert torch.equal(seen, loop_mask(slot, qdoc, kdoc, 5, sinks))
    # no window: sinks change nothing; sinks 0: the plain window
    full = naive_attention(q, k, v, slot, qdoc, kdoc)
    assert torch.equal(naive_attention(q, k, v, slot, qdoc, kdoc, sinks=sinks), full)
    assert not torch.allclose(naive_attention(q, k, v, slot, qdoc, kdoc, window=5, sinks=sinks),
                              naive_attention(q, k, v, slot, qdoc, kdoc, window=5))


def _check(fn, case, sinks, grad: bool):
    q, k, v = (case[n].detach().clone().requires_grad_(grad) for n in ("q", "k", "v"))
    args = (case["q_slot"], case["q_doc"], case["k_doc"])
    ref_in = [t.detach().float().clone().requires_grad_(grad) for t in (q, k, v)]
    ref = naive_attention(*ref_in, *args, window=case["window"], sinks=sinks)
    with torch.set_grad_enabled(grad):
        out = fn(q, k, v, *args, window=case["window"], sinks=sinks)
    tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-5
    assert rel_err(out.float(), ref) < tol
    if grad:
        do = torch.randn_like(ref)
        got = torch.autograd.grad(out.float(), (q, k, v), do)
        want = torch.autograd.grad(ref, ref_in, do)
        for g, w in zip(got, want):
            assert rel_err(g.float(), w) < (5e-2 if q.dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("docs,past", [("dense", 0), ("dense", 50), ("packed", 0), ("padded", 20)])
def test_chunked_and_flex_take_sinks(docs, past):
    case = make_case("base", T=150, past=past, docs=docs, window=9, seed=3)
    for backend in ("chunked", "auto"):
        _check(functools.partial(attention, backend=backend, dense_start=case["dense_start"]), case, 3, grad=True)
    # FlexAttention's mask_mod and block states, uncompiled here (no backward on CPU)
    _check(functools.partial(attention, backend="flex", dense_start=case["dense_start"]), case, 3, grad=False)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (test_chunked_and_flex_take_sinks runs the mask logic on CPU)")
@pytest.mark.parametrize("docs,past,T", [("dense", 0, 300), ("dense", 130, 257), ("packed", 0, 300),
                                         ("padded", 64, 200)])
def test_cuda_flex_takes_sinks(docs, past, T):
    case = make_case("base", T=T, past=past, docs=docs, window=17, seed=4, device=DEV, dtype=torch.bfloat16)
    _check(functools.partial(attention, dense_start=case["dense_start"]), case, 4, grad=True)
    _check(functools.partial(attention, dense_start=case["dense_start"]), case, 4, grad=False)


def test_few_queries_and_pairs_take_sinks():
    """A decode step: one base row (windowed, sinks) and one output row in one call."""
    case = make_case("base", T=2, past=190, docs="padded", window=24, seed=2, device=DEV)
    q, k, v, slot, qdoc, kdoc = (case[n] for n in ("q", "k", "v", "q_slot", "q_doc", "k_doc"))
    slot = slot.expand(q.shape[0], -1)
    ref = torch.cat([naive_attention(q[:, :1], k, v, slot[:, :1], qdoc[:, :1], kdoc, window=24, sinks=4),
                     naive_attention(q[:, 1:], k, v, slot[:, 1:], qdoc[:, 1:], kdoc)], 1)
    for backend in ("auto", "triton", "chunked"):
        with torch.no_grad():
            out = attention(q, k, v, slot, qdoc, kdoc, window=24, backend=backend, window_rows=1, sinks=4)
        assert rel_err(out, ref) < 1e-5, backend


@pytest.mark.parametrize("docs", ["dense", "packed", "padded"])
def test_flex_tile_states_cover_the_sinks(docs):
    """FlexAttention's tile states stay exact supersets with sinks (a visible key never sits in a tile
    marked empty, a tile marked full holds only visible keys), tiles of 128."""
    from orthros.ops.flex import BK, BQ, tile_states

    case = make_case("base", T=700, past=0, docs=docs, window=50, seed=5)
    slot, qdoc, kdoc = case["q_slot"].expand(2, -1), case["q_doc"], case["k_doc"]
    st, _, _ = tile_states(slot, qdoc, kdoc, 50, sinks=4)
    mask = loop_mask(slot[:, :700], qdoc, kdoc, 50, 4) if docs != "dense" else None
    if mask is None:  # one document from slot 0: the definition in closed form
        t, j = torch.arange(700)[:, None], torch.arange(700)[None]
        mask = ((j <= t) & ((t - j < 50) | (j < 4)))[None].expand(2, -1, -1)
    pad = torch.zeros(2, st.shape[1] * BQ, st.shape[2] * BK, dtype=torch.bool)
    pad[:, :700, :700] = mask
    tiles = pad.view(2, st.shape[1], BQ, st.shape[2], BK)
    assert not (tiles.any(4).any(2) & (st == 0)).any(), "a visible key in a tile marked empty"
    assert not ((st == 2) & ~tiles.all(4).all(2)).any(), "a tile marked full has an invisible key"
    if docs == "dense":
        assert (st[:, :, 0] >= 1).all()  # every query tile reads the sinks' tile


def test_splitkv_kernel_takes_sinks_triton_interpreter():
    """The split-KV kernel's sink loop and mask (tests/ops/splitkv/sink_cases.py) under TRITON_INTERPRET=1."""
    from ..conftest import run_triton_interpreted

    r = run_triton_interpreted("-m", "tests.ops.splitkv.sink_cases", timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.long
@pytest.mark.skipif(not CUDA, reason="needs CUDA (test_splitkv_kernel_takes_sinks_triton_interpreter runs the cases)")
def test_splitkv_kernel_takes_sinks_on_gpu():
    from .splitkv.sink_cases import main

    main("cuda")
