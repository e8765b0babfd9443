"""Run under TRITON_INTERPRET=1 (see test_fast_path.py): the split-KV kernel reading an fp8
cache, with the static cache's scale folding, against the naive op on the dequantized cache."""

import torch

from orthros.models.static_cache import FP8, FP8_MAX
from orthros.ops.naive import naive_attention
from orthros.ops.splitkv import splitkv_attention


def main():
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
    for window, splits, block_n in ((None, None, None), (16, 1, None), (16, None, None), (None, None, 64)):
        ref = naive_attention(q, k8.float() * ks[:, None], v8.float() * vs[:, None], slot, qd, kd, window=window)
        qs = q * ks.repeat_interleave(H // Hkv)[:, None]
        out = splitkv_attention(qs, k8, v8, slot, qd, kd, window=window, scale=D ** -0.5, num_splits=splits,
                                block_n=block_n)  # default for 1-byte keys: 128
        out = out * vs.repeat_interleave(H // Hkv)[:, None]
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (window, splits, block_n, err)
    print("ok")


if __name__ == "__main__":
    main()
