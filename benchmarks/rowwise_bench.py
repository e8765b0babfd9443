"""A layer's row-wise work at prefill, Llama-3.1-8B shapes (C=4096, H=32, Hkv=8, D=128, I=14336, bf16):
eager PyTorch vs the compiled functions vs the Triton kernels of `ops/rowwise.py`.

    python benchmarks/rowwise_bench.py [--tokens 32768] [--out results.json]

Ops: RMSNorm; residual add + RMSNorm (eager / compiled: add then norm as
two calls, the way a block ran before fusing them); query and key preparation
(SO, RoPE); SwiGLU's gate; and, for training, query/key preparation and
residual add + RMSNorm forward + backward (eager / compiled / the Triton
autograd functions of `ops/rowwise_grad.py`). The forward + backward rows
include the elementwise products and sums that turn outputs into a loss. Each row gives the
median time (triton.testing.do_bench) and the bandwidth it reaches (bytes read +
written once / time; forward + backward: x, dy, dx and y once each).
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from orthros.layers import fused
from orthros.layers.rope import RotaryEmbedding
from orthros.ops import rowwise, rowwise_grad

C, H, HKV, D, INNER = 4096, 32, 8, 128, 14336
DT = torch.bfloat16


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    T = args.tokens
    r = lambda *s: torch.randn(*s, device="cuda", dtype=DT)
    x, res, w = r(T, C), r(T, C), r(C)
    q, k = r(1, T, H * D), r(1, T, HKV * D)
    alpha, beta = r(H * D), r(H * D)
    cos, sin = RotaryEmbedding(D, 500000.0).cuda()(torch.arange(T, device="cuda")[None], DT)
    gate, up = r(T, INNER), r(T, INNER)
    comp = {f: fused._compiled(f) for f in (fused.rms_norm, fused.heads, fused.silu_mul)}
    e = 2  # bytes per element
    ops = {  # name: (bytes moved, {variant: fn})
        "rms_norm": (2 * T * C * e, {
            "eager": lambda: fused.rms_norm(x, w, 1e-5),
            "compiled": lambda: comp[fused.rms_norm](x, w, 1e-5),
            "triton": lambda: rowwise.rms_norm(x, w, 1e-5)}),
        "add + rms_norm": (4 * T * C * e, {
            "eager": lambda: fused.rms_norm(x + res, w, 1e-5),
            "compiled": lambda: comp[fused.rms_norm](x + res, w, 1e-5),
            "triton": lambda: rowwise.rms_norm(x, w, 1e-5, residual=res)}),
        "queries (SO + RoPE)": (2 * T * H * D * e, {
            "eager": lambda: fused.heads(q, cos, sin, H, D, alpha, beta),
            "compiled": lambda: comp[fused.heads](q, cos, sin, H, D, alpha, beta),
            "triton": lambda: rowwise.heads(q, cos, sin, H, D, alpha, beta)}),
        "keys (RoPE)": (2 * T * HKV * D * e, {
            "eager": lambda: fused.heads(k, cos, sin, HKV, D),
            "compiled": lambda: comp[fused.heads](k, cos, sin, HKV, D),
            "triton": lambda: rowwise.heads(k, cos, sin, HKV, D)}),
        "SwiGLU gate": (3 * T * INNER * e, {
            "eager": lambda: fused.silu_mul(gate, up),
            "compiled": lambda: comp[fused.silu_mul](gate, up),
            "triton": lambda: rowwise.silu_mul(gate, up)}),
    }
    rows = []
    print(f"{T} tokens, bf16, {torch.cuda.get_device_name()}")
    print(f"{'op':22s} {'variant':9s} {'ms':>8s} {'GB/s':>7s}")
    with torch.no_grad():
        for name, (nbytes, variants) in ops.items():
            for v, fn in variants.items():
                fn()
                ms = do_bench(fn, warmup=5, rep=50)
                rows.append({"op": name, "variant": v, "ms": ms, "GB_s": nbytes / ms / 1e6})
                print(f"{name:22s} {v:9s} {ms:8.3f} {nbytes / ms / 1e6:7.0f}")
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    ag, bg = alpha.detach().requires_grad_(), beta.detach().requires_grad_()
    dyq, dyk = r(1, T, H, D), r(1, T, HKV, D)
    train = {
        "queries fwd+bwd (SO + RoPE)": (4 * T * H * D * e, qg, ag, bg, H, dyq),
        "keys fwd+bwd (RoPE)": (4 * T * HKV * D * e, kg, None, None, HKV, dyk),
    }
    for name, (nbytes, xg, a, b, nh, dy) in train.items():
        for v, f in (("eager", fused.heads), ("compiled", comp[fused.heads]), ("triton", rowwise_grad.heads_autograd)):
            ins = [t for t in (xg, a, b) if t is not None]
            fn = lambda: torch.autograd.grad(f(xg, cos, sin, nh, D, a, b), ins, dy)
            fn()
            ms = do_bench(fn, warmup=5, rep=50)
            rows.append({"op": name, "variant": v, "ms": ms, "GB_s": nbytes / ms / 1e6})
            print(f"{name:22s} {v:9s} {ms:8.3f} {nbytes / ms / 1e6:7.0f}")
    xg, rg, wg = x.detach().requires_grad_(), res.detach().requires_grad_(), w.detach().requires_grad_()
    dy = r(T, C)
    comp_add = fused._compiled(fused.add_rms_norm)
    name, nbytes = "add + norm fwd+bwd", 8 * T * C * e  # x, res, h, y; x(h), dy, dh, dx
    for v, f in (("eager", fused.add_rms_norm), ("compiled", comp_add), ("triton", rowwise_grad.add_rms_norm_autograd)):
        fn = lambda: torch.autograd.grad(sum((o * g).sum() for o, g in zip(f(xg, rg, wg, 1e-5), (dy, dy))),
                                         (xg, rg, wg))
        fn()
        ms = do_bench(fn, warmup=5, rep=50)
        rows.append({"op": name, "variant": v, "ms": ms, "GB_s": nbytes / ms / 1e6})
        print(f"{name:22s} {v:9s} {ms:8.3f} {nbytes / ms / 1e6:7.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": T, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
