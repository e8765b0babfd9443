"""The split-KV kernel reading an fp8 cache, with the static cache's scale folding, against the
naive op on the dequantized cache. Run under TRITON_INTERPRET=1 on CPU, one named case a process
(test_fp8.py), or as is on a GPU (`python -m tests.ops.splitkv.fp8_cases [CASE]`)."""

import os
import sys

import torch

from orthros.models.static_cache import FP8, FP8_MAX
from orthros.ops.naive import naive_attention
from orthros.ops.splitkv.dense import splitkv_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")


def fp8_cache():
    """(q, k8, v8, ks, vs, slot, qd, kd): a random fp8 cache with per-head scales, padded slots past 260."""
    torch.manual_seed(0)
    B, S, H, Hkv, D = 2, 300, 4, 2, 32
    q = torch.randn(B, 1, H, D)
    k, v = 3 * torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    ks, vs = torch.tensor([2.0 ** -5, 2.0 ** -6]), torch.tensor([2.0 ** -6, 2.0 ** -7])
    k8 = (k / ks[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    v8 = (v / vs[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    slot, qd = torch.tensor([[250]]), torch.zeros(B, 1, dtype=torch.long)
    kd = torch.zeros(B, S, dtype=torch.long)
    kd[:, 260:] = -1
    return tuple(t.to(DEVICE) for t in (q, k8, v8, ks, vs, slot, qd, kd))


def fp32_queries():
    """fp32 queries: window or none, one split or several, 64- or 128-key tiles."""
    q, k8, v8, ks, vs, slot, qd, kd = fp8_cache()
    B, S, Hkv, D = k8.shape
    H = q.shape[2]
    for window, splits, block_n in ((None, None, None), (16, 1, None), (16, None, None), (None, None, 64)):
        ref = naive_attention(q, k8.float() * ks[:, None], v8.float() * vs[:, None], slot, qd, kd, window=window)
        qs = q * ks.repeat_interleave(H // Hkv)[:, None]
        out = splitkv_attention(qs, k8, v8, slot, qd, kd, window=window, scale=D ** -0.5, num_splits=splits,
                                block_n=block_n)  # default for 1-byte keys: 128
        out = out * vs.repeat_interleave(H // Hkv)[:, None]
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (window, splits, block_n, err)


def sixteen_bit_queries():
    """bf16 queries over fp8 K/V (the decode pair: a windowed row and an output row): the dots
    run in fp16 (the default, `fp16_dots`) within bf16 rounding of the fp32 reference, also for
    queries past fp16's range (scaled into it by a power of two). On a GPU the bf16 dots are
    checked too, and the fp16 ones must be no worse; Triton's interpreter (3.6 and 3.9)
    multiplies bf16 dots wrongly, so there they are not run."""
    _, k8, v8, ks, vs, _, _, kd = fp8_cache()
    B, S, Hkv, D = k8.shape
    H = 4
    kf, vf = k8.float() * ks[:, None], v8.float() * vs[:, None]
    slot = torch.tensor([[250, 299]], device=k8.device).expand(B, 2)
    qd = torch.zeros(B, 2, dtype=torch.long, device=k8.device)
    for q_scale in (1.0, 1e7):  # 1e7: past fp16's range; the softmax scale keeps the scores as at 1
        q = (q_scale * torch.randn(B, 2, H, D, device=k8.device)).to(torch.bfloat16)
        scale = D ** -0.5 / q_scale
        ref = torch.cat([naive_attention(q.float()[:, :1], kf, vf, slot[:, :1], qd[:, :1], kd, window=16, scale=scale),
                         naive_attention(q.float()[:, 1:], kf, vf, slot[:, 1:], qd[:, 1:], kd, scale=scale)], 1)
        qs = q * ks.repeat_interleave(H // Hkv)[:, None].to(q.dtype)
        errs = {}
        for f16 in (True, False) if k8.is_cuda else (True,):
            out = splitkv_attention(qs, k8, v8, slot, qd, kd, window=16, window_rows=1, scale=scale, fp16_dots=f16)
            assert out.dtype == torch.bfloat16
            out = out.float() * vs.repeat_interleave(H // Hkv)[:, None]
            assert torch.isfinite(out).all(), (q_scale, f16)
            errs[f16] = ((out - ref).norm() / ref.norm()).item()
        assert max(errs.values()) < 1e-2, (q_scale, errs)
        if False in errs:
            assert errs[True] <= 1.5 * errs[False] + 1e-3, (q_scale, errs)


CASES = {"fp32-queries": fp32_queries, "16-bit-queries": sixteen_bit_queries}


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        CASES[name]()
    print("ok")
