"""Causal SDPA for a later prefill chunk (queries at slots s..s+M-1): two calls merged
by their log-sum-exps, checked against the fp32 naive op."""

import pytest
import torch

from orthros.ops import attention, naive_attention
from orthros.ops.dense import attend_lse, sdpa_causal_offset
from orthros.ops.lse import lse_merge

from .cases import _err

CUDA = torch.cuda.is_available()


def _inputs(B, M, S, H, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, M, H, D, generator=g, device=device, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, generator=g, device=device, dtype=dtype)
    v = torch.randn(B, S, Hkv, D, generator=g, device=device, dtype=dtype)
    return q, k, v


def _reference(q, k, v, start):
    B, M = q.shape[:2]
    S = k.shape[1]
    slot = torch.arange(start, start + M, device=q.device)[None].expand(B, M)
    zeros = torch.zeros
    return naive_attention(q.float(), k.float(), v.float(), slot, zeros(B, M, dtype=torch.long, device=q.device),
                           zeros(B, S, dtype=torch.long, device=q.device))


def test_merge_of_two_key_sets_is_attention_over_their_union():
    q, k, v = (t.transpose(1, 2) for t in _inputs(2, 5, 11, 3, 3, 8))
    whole, lse = attend_lse(q, k, v, causal=False)
    (o1, l1), (o2, l2) = attend_lse(q, k[:, :, :4], v[:, :, :4], False), attend_lse(q, k[:, :, 4:], v[:, :, 4:], False)
    merged, _ = lse_merge([o1, o2], torch.stack([l1, l2]))
    assert _err(merged, whole) < 1e-6
    assert torch.allclose(lse, torch.logsumexp((q @ k.transpose(-1, -2)) * 8 ** -0.5, -1), atol=1e-5)


@pytest.mark.parametrize("start,M,extra", [(13, 7, 0), (1, 9, 5), (40, 1, 3), (0, 6, 2)])
def test_offset_chunk_matches_naive(start, M, extra):
    q, k, v = _inputs(2, M, start + M + extra, 4, 2, 16)  # GQA; keys past the chunk are ignored
    assert _err(sdpa_causal_offset(q, k, v, start), _reference(q, k, v, start)) < 1e-5


@pytest.mark.skipif(not CUDA, reason="cuDNN attention needs CUDA (CPU twin: test_offset_chunk_matches_naive)")
@pytest.mark.parametrize("start,M", [(4096, 2048), (333, 517), (1, 64)])
def test_offset_chunk_cuda_dispatch(start, M):
    q, k, v = _inputs(1, M, start + M, 32, 8, 128, torch.bfloat16, "cuda")
    slot = torch.arange(start, start + M, device="cuda")[None]
    qd = torch.zeros(1, M, dtype=torch.long, device="cuda")
    kd = torch.zeros(1, start + M, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        out = attention(q, k, v, slot, qd, kd, dense_start=start)
    assert _err(out.float(), _reference(q, k, v, start)) < 2e-2


@pytest.mark.skipif(not CUDA, reason="cuDNN attention needs CUDA (CPU: chunked prefill is checked in test_dense_hints)")
def test_full_model_chunked_prefill_cuda():
    from orthros.generate import prefill

    from ..conftest import make_model

    model = make_model(attention="full").to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    whole, _ = prefill(model, ids)
    chunked, _ = prefill(model, ids, chunk_size=128)
    assert _err(chunked.float(), whole.float()) < 2e-2
