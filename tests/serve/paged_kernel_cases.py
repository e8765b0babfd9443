"""Run under TRITON_INTERPRET=1 (see test_paged.py), or as is on a GPU: the paged single-query kernel against its
gathered reference, over scattered blocks, several splits, windows (with attention sinks), GQA, an fp8 pool (fp32 and
bf16 queries), and results stored into a given output (a view; fp16)."""

import os

import torch

from orthros.models.static_cache import FP8
from orthros.ops.paged import paged_attention_kernel, paged_attention_ref


DEVICE = torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")


def main():
    torch.manual_seed(0)
    torch.set_default_device(DEVICE)
    R, H, Hkv, D, bs, nb = 3, 4, 2, 16, 4, 24
    kp, vp = torch.randn(nb * bs, Hkv, D), torch.randn(nb * bs, Hkv, D)
    table = torch.stack([torch.randperm(nb)[:16] for _ in range(R)]).int()
    pos = torch.tensor([0, 9, 45])
    q = torch.randn(R, H, D)
    for window in (None, 7):
        for per in (None, 16):
            out = paged_attention_kernel(q, kp, vp, table, pos, bs, window, keys_per_split=per)
            ref = paged_attention_ref(q, kp, vp, table, pos, bs, window)
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (window, per, err)
    # attention sinks: a windowed row also sees its first positions (one split, several; a row whose
    # window still covers them; sinks past a split's end)
    for window, sinks, per in ((7, 2, None), (7, 2, 16), (7, 5, 4), (30, 4, 8)):
        out = paged_attention_kernel(q, kp, vp, table, pos, bs, window, keys_per_split=per, sinks=sinks)
        ref = paged_attention_ref(q, kp, vp, table, pos, bs, window, sinks=sinks)
        plain = paged_attention_ref(q, kp, vp, table, pos, bs, window)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, (window, sinks, per)
        assert ((plain - ref)[2].norm() / ref[2].norm()).item() > 1e-2  # the last row's sinks matter
    # into a view of a larger buffer (the decode pair's output rows): one split stores there itself,
    # several merge there; nothing outside the view is touched
    buf = torch.full((1, 2 * R, H, D), float("nan"))
    for window, per in ((7, None), (None, 16)):
        res = paged_attention_kernel(q, kp, vp, table, pos, bs, window, keys_per_split=per, out=buf[0, R:])
        ref = paged_attention_ref(q, kp, vp, table, pos, bs, window)
        assert res.data_ptr() == buf[0, R:].data_ptr() and bool(buf[0, :R].isnan().all())
        assert ((buf[0, R:] - ref).norm() / ref.norm()).item() < 1e-5, (window, per)
    q16 = q.half()  # one split: fp32 results stored into an fp16 output directly
    res = paged_attention_kernel(q16, kp.half(), vp.half(), table, pos, bs, 7, out=torch.empty(R, H, D).half())
    ref = paged_attention_ref(q, kp, vp, table, pos, bs, 7)
    assert res.dtype == torch.float16 and ((res.float() - ref).norm() / ref.norm()).item() < 5e-3
    k8, v8 = kp.to(FP8), vp.to(FP8)
    out = paged_attention_kernel(q, k8, v8, table, pos, bs, None, keys_per_split=16)
    ref = paged_attention_ref(q, k8, v8, table, pos, bs, None)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # bf16 queries over an fp8 pool: fp16 dots (splitkv.use_fp16_dots), also for queries past
    # fp16's range (scaled by a power of two; the softmax scale keeps the scores as at 1)
    for q_scale in (1.0, 1e7):
        qb = (q_scale * q).bfloat16()
        for window, per in ((7, None), (None, 16)):
            out = paged_attention_kernel(qb, k8, v8, table, pos, bs, window, scale=D ** -0.5 / q_scale,
                                         keys_per_split=per)
            ref = paged_attention_ref(qb.float(), k8, v8, table, pos, bs, window, scale=D ** -0.5 / q_scale)
            assert out.dtype == torch.bfloat16
            assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, (q_scale, window, per)
    print("ok")


if __name__ == "__main__":
    main()
