"""The naive op is the spec: check it against a loop over positions, and its gradients."""

import math

import pytest
import torch

from orthros.ops import naive_attention

from ..conftest import DEVICE, rel_err


def loop_reference(q, k, v, q_slot, q_doc, k_doc, window):
    """SPEC §1 written literally: for each query, softmax over its visible keys."""
    B, M, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    out = torch.zeros(B, M, H, D, dtype=torch.float64)
    for b in range(B):
        for i in range(M):
            t = int(q_slot[b if q_slot.shape[0] > 1 else 0, i])
            keys = [j for j in range(S) if j <= t and k_doc[b, j] == q_doc[b, i] and (window is None or t - j < window)]
            for h in range(H):
                g = h // (H // Hkv)
                if not keys:
                    continue
                s = torch.stack([q[b, i, h].double() @ k[b, j, g].double() / math.sqrt(D) for j in keys])
                p = torch.softmax(s, 0)
                out[b, i, h] = sum(p[n] * v[b, j, g].double() for n, j in enumerate(keys))
    return out


def random_case(B=2, M=5, S=11, H=4, Hkv=2, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, M, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype)
    # two packed documents in row 0, left padding in row 1
    k_doc = torch.tensor([[0] * 6 + [1] * (S - 6), [-1] * 3 + [0] * (S - 3)])
    q_slot = torch.randint(0, S, (B, M), generator=g)
    q_doc = k_doc.gather(1, q_slot)
    return q, k, v, q_slot, q_doc, k_doc


@pytest.mark.parametrize("window", [None, 1, 3, 16])
def test_naive_equals_loop(window):
    q, k, v, q_slot, q_doc, k_doc = random_case()
    out = naive_attention(q, k, v, q_slot, q_doc, k_doc, window=window)
    ref = loop_reference(q, k, v, q_slot, q_doc, k_doc, window)
    assert rel_err(out, ref) < 1e-6


def test_base_stream_slots_broadcast():
    """Base-stream form: queries at every slot (q_slot [1, S]) with a window."""
    q, k, v, _, _, k_doc = random_case(M=11)
    slot = torch.arange(11)[None]
    out = naive_attention(q, k, v, slot, k_doc, k_doc, window=3)
    ref = loop_reference(q, k, v, slot, k_doc, k_doc, 3)
    assert rel_err(out, ref) < 1e-6


def test_query_that_sees_nothing_is_zero_with_finite_grads():
    q, k, v, q_slot, q_doc, k_doc = random_case()
    q_doc = q_doc.clone()
    q_doc[0, 0] = -2  # an invalid output query
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out, lse = naive_attention(q, k, v, q_slot, q_doc, k_doc, return_lse=True)
    assert torch.all(out[0, 0] == 0) and torch.isneginf(lse[0, 0]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_lse_matches_logsumexp():
    q, k, v, q_slot, q_doc, k_doc = random_case()
    _, lse = naive_attention(q, k, v, q_slot, q_doc, k_doc, window=None, return_lse=True)
    b, i, h = 1, 2, 3
    t = int(q_slot[b, i])
    keys = [j for j in range(k.shape[1]) if j <= t and k_doc[b, j] == q_doc[b, i]]
    s = torch.stack([q[b, i, h] @ k[b, j, h // 2] / math.sqrt(8) for j in keys])
    assert abs(lse[b, i, h].item() - torch.logsumexp(s, 0).item()) < 1e-5


@pytest.mark.parametrize("window", [None, 2])
def test_gradcheck_float64(window):
    q, k, v, q_slot, q_doc, k_doc = random_case(B=2, M=3, S=6, H=2, Hkv=1, D=4, dtype=torch.float64)
    k_doc = torch.tensor([[0, 0, 0, 1, 1, 1], [-1, 0, 0, 0, 0, 0]])
    q_slot = torch.tensor([[0, 2, 5], [1, 3, 5]])
    q_doc = k_doc.gather(1, q_slot)
    inputs = tuple(t.requires_grad_(True) for t in (q, k, v))
    fn = lambda q, k, v: naive_attention(q, k, v, q_slot, q_doc, k_doc, window=window)
    assert torch.autograd.gradcheck(fn, inputs)


def test_runs_on_test_device():
    q, k, v, q_slot, q_doc, k_doc = (t.to(DEVICE) for t in random_case())
    out = naive_attention(q, k, v, q_slot, q_doc, k_doc, window=3)
    ref = loop_reference(*(t.cpu() for t in (q, k, v, q_slot, q_doc, k_doc)), 3)
    assert rel_err(out.cpu(), ref) < 1e-5
