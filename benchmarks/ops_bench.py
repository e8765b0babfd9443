"""Candidate attention kernels per phase, one layer at Llama-3.1-8B shapes (H=32, Hkv=8, D=128, bf16).

    python benchmarks/ops_bench.py [--out results.json] [--quick]

Phases and candidates:
    swa    — base stream, window 128: FlexAttention with the dense hint
             (no index tensors) vs with doc ids (packed-batch mask); fwd, fwd+bwd.
    causal — full causal (the `full` baseline / Orthros pre-training output
             stream): SDPA with cuDNN first (native GQA or K/V expanded), SDPA
             flash only, FlexAttention; fwd, fwd+bwd.
    decode — a few queries over a long cache: the Triton split-KV kernel vs
             FlexAttention vs SDPA without a mask (a lower bound: no doc check).
Prints a table of median times (triton.testing.do_bench) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from orthros.ops import attention
from orthros.ops.dense import sdpa_causal
from orthros.ops.flex import flex_attention_op
from orthros.ops.splitkv import splitkv_attention

H, HKV, D, W = 32, 8, 128, 128
DT = torch.bfloat16


def rand(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=DT).requires_grad_(grad)


def bench(fn, backward=False):
    """Median ms; the first call (compilation) is timed separately."""
    t0 = time.perf_counter()
    out = fn()
    if backward:
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if backward:
        def step():
            fn().backward(g)

        g = torch.randn_like(out)
        return do_bench(step, warmup=10, rep=50, return_mode="median"), first
    with torch.no_grad():
        return do_bench(fn, warmup=10, rep=50, return_mode="median"), first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ops/ops_bench.json")
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args()
    rows = []

    def add(phase, cand, T, mode, fn, backward=False):
        try:
            ms, first = bench(fn, backward)
            rows.append(dict(phase=phase, candidate=cand, T=T, mode=mode, ms=ms, first_call_s=first))
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result
            rows.append(dict(phase=phase, candidate=cand, T=T, mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}"))
        r = rows[-1]
        print(f"{phase:>7} {cand:>22} T={T:>8} {mode:>7}: " + (f"{r['ms']:9.3f} ms (first call {r['first_call_s']:.1f} s)"
              if "ms" in r else r["error"]), flush=True)
        torch.cuda.empty_cache()

    swa_T = [8192, 32768] if args.quick else [8192, 32768, 131072]
    for T in swa_T:
        slot = torch.arange(T, device="cuda")[None]
        doc = torch.zeros(1, T, dtype=torch.long, device="cuda")
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd+bwd" and T > 32768:
                continue
            bw = mode == "fwd+bwd"
            q, k, v = rand(1, T, H, D, grad=bw), rand(1, T, HKV, D, grad=bw), rand(1, T, HKV, D, grad=bw)
            add("swa", "flex dense", T, mode, lambda: flex_attention_op(q, k, v, slot, doc, doc, W, dense_start=0), bw)
            if T == 32768:
                add("swa", "flex doc ids", T, mode, lambda: flex_attention_op(q, k, v, slot, doc, doc, W), bw)
            del q, k, v

    causal_T = [8192] if args.quick else [8192, 32768]
    for T in causal_T:
        slot = torch.arange(T, device="cuda")[None]
        doc = torch.zeros(1, T, dtype=torch.long, device="cuda")
        from torch.nn.attention import SDPBackend

        for mode in ("fwd", "fwd+bwd"):
            bw = mode == "fwd+bwd"
            q, k, v = rand(1, T, H, D, grad=bw), rand(1, T, HKV, D, grad=bw), rand(1, T, HKV, D, grad=bw)
            add("causal", "sdpa cudnn native-gqa", T, mode, lambda: sdpa_causal(q, k, v, gqa_mode="native"), bw)
            add("causal", "sdpa cudnn expand-kv", T, mode, lambda: sdpa_causal(q, k, v, gqa_mode="expand"), bw)
            add("causal", "sdpa flash native-gqa", T, mode,
                lambda: sdpa_causal(q, k, v, gqa_mode="native", backends=[SDPBackend.FLASH_ATTENTION]), bw)
            add("causal", "sdpa cudnn-only expand", T, mode,
                lambda: sdpa_causal(q, k, v, gqa_mode="expand", backends=[SDPBackend.CUDNN_ATTENTION]), bw)
            if T == 8192:
                add("causal", "flex dense", T, mode, lambda: flex_attention_op(q, k, v, slot, doc, doc, None, dense_start=0), bw)
            del q, k, v

    dec_S = [131072, 1 << 20] if not args.quick else [131072]
    for S in dec_S:
        for B, M in ((1, 1), (8, 1)):
            if B * S > (1 << 21):
                continue
            q, k, v = rand(B, M, H, D), rand(B, S, HKV, D), rand(B, S, HKV, D)
            slot = torch.full((B, M), S - 1, device="cuda")
            qdoc = torch.zeros(B, M, dtype=torch.long, device="cuda")
            kdoc = torch.zeros(B, S, dtype=torch.long, device="cuda")
            tag = f"B={B}"
            add("decode", f"triton split-KV {tag}", S, "fwd", lambda: splitkv_attention(q, k, v, slot, qdoc, kdoc))
            add("decode", f"auto {tag}", S, "fwd", lambda: attention(q, k, v, slot, qdoc, kdoc))
            if S == 131072 and B == 1:
                add("decode", f"flex doc ids {tag}", S, "fwd", lambda: flex_attention_op(q, k, v, slot, qdoc, kdoc))
            add("decode", f"sdpa no mask {tag}", S, "fwd", lambda: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True))
            bytes_ = 2 * k.numel() * k.element_size()
            rows.append(dict(phase="decode", candidate=f"copy-bandwidth floor {tag}", T=S, mode="fwd", ms=bytes_ / 4.3e12 * 1e3))
            del q, k, v

    with open(args.out, "w") as f:
        json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("\nphase | candidate | T | mode | median ms")
    for r in rows:
        print(f"{r['phase']} | {r['candidate']} | {r['T']} | {r['mode']} | " + (f"{r['ms']:.3f}" if "ms" in r else "error"))


if __name__ == "__main__":
    main()
