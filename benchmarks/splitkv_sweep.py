"""The split-KV decode kernel alone over a long cache, Llama-3.1-8B attention shape
(H=32, Hkv=8, D=128), one decode step's two rows per sequence (base row windowed):
launch settings against the bandwidth they reach.

    python benchmarks/splitkv_sweep.py [--contexts 131072 1048576] [--dtypes bf16 fp8 int4 int2] [--out results.json]

For each context and cache dtype (bf16, fp8 e4m3, and int4 / int2 beyond the window:
the low-bit kernel over a `LowBitStaticCache` filled with random levels): the default
launch, then splits x block size x warps x stages. GB/s = the K/V bytes the output row
must read (low-bit: packed slots with their scales, the bf16 sinks and window) / time.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

from orthros import OrthrosConfig
from orthros.bench.decode import fill_random
from orthros.models.lowbit_cache import LowBitStaticCache
from orthros.ops.splitkv import _num_sms, splitkv_attention
from orthros.ops.splitkv_lowbit import lowbit_splitkv_attention

H, HKV, D, W = 32, 8, 128, 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp8", "int4", "int2", "k4v2"), default=["bf16", "fp8"])
    p.add_argument("--split-factors", type=int, nargs="+", default=[1, 2, 4],
                   help="split counts tried, as multiples of 2 x SMs / (batch x KV heads)")
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="keys per loop iteration")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    B, dev = args.batch, torch.device("cuda")
    rows = []
    sms = _num_sms(dev)
    print(f"{'context':>8s} {'dtype':6s} {'splits':>6s} {'block':>5s} {'warps':>5s} {'stages':>6s} {'us':>8s} {'GB/s':>6s}")
    for S, dtype in itertools.product(args.contexts, args.dtypes):
        q = torch.randn(B, 2, H, D, device=dev, dtype=torch.bfloat16)
        slot = torch.tensor([[S - 1, S - 1]], device=dev).expand(B, 2)
        qdoc = torch.zeros(B, 2, dtype=torch.long, device=dev)
        kdoc = torch.zeros(B, S, dtype=torch.long, device=dev)
        if dtype in ("int4", "int2", "k4v2"):
            cfg = OrthrosConfig.from_name("llama-3.1-8b", num_hidden_layers=1, window_size=W)
            cache = LowBitStaticCache(cfg, B, S, dev, torch.bfloat16, dtype)
            fill_random(cache, S)
            bound = cache.bound_at(S)
            nbytes = B * ((bound - cache.sinks) * cache.slot_bytes() + (S - bound + cache.sinks) * 2 * HKV * D * 2)
            layer, b = cache.layer(0), torch.tensor([bound], device=dev)
        else:
            k = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16)
            if dtype == "fp8":
                k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            nbytes = 2 * B * S * HKV * D * k.element_size()
        base_splits = max(1, 2 * sms // (B * HKV))
        configs = [(None, 64, None, None)] + list(itertools.product(
            [f * base_splits for f in args.split_factors], args.blocks, args.warps, args.stages))
        for splits, block_n, warps, stages in configs:
            if dtype in ("int4", "int2", "k4v2"):
                fn = lambda: lowbit_splitkv_attention(q, *layer, slot, qdoc, kdoc, b, S, cache.key_bits,
                                                      cache.value_bits, cache.key_group,
                                                      window=W, window_rows=1, num_splits=splits, block_n=block_n,
                                                      num_warps=warps, num_stages=stages)
            else:
                fn = lambda: splitkv_attention(q, k, v, slot, qdoc, kdoc, window=W, num_splits=splits,
                                               block_n=block_n, window_rows=1, num_warps=warps, num_stages=stages)
            try:
                fn()
                ms = do_bench(fn, warmup=3, rep=20)
            except Exception as e:  # a launch that does not fit (shared memory): skip it
                print(f"{S:8d} {dtype:6s} {splits!s:>6s} {block_n:5d} {warps!s:>5s} {stages!s:>6s}  failed: {type(e).__name__}")
                continue
            rows.append({"context": S, "dtype": dtype, "splits": splits, "block_n": block_n, "num_warps": warps,
                         "num_stages": stages, "us": ms * 1e3, "GB_s": nbytes / ms / 1e6})
            print(f"{S:8d} {dtype:6s} {splits!s:>6s} {block_n:5d} {warps!s:>5s} {stages!s:>6s} {ms * 1e3:8.1f} {nbytes / ms / 1e6:6.0f}")
        best = max((r for r in rows if r["context"] == S and r["dtype"] == dtype), key=lambda r: r["GB_s"], default=None)
        if best:
            print(f"best at {S} {dtype}: {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
