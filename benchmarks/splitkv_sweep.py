"""The split-KV decode kernel alone over a long cache, Llama-3.1-8B attention shape
(H=32, Hkv=8, D=128), one decode step's two rows per sequence (base row windowed):
launch settings against the bandwidth they reach.

    python benchmarks/splitkv_sweep.py [--contexts 131072 1048576] [--dtypes bf16 fp8 int4 int2] [--out results.json]
    python benchmarks/splitkv_sweep.py --dtypes bf16 fp8 int4 int2 k4v2 --out benchmarks/results/long_context/splitkv-sweep.json \
        --docs docs/long_context.md   # + a Markdown table (default launch / best) between its splitkv-sweep-table marks
    python benchmarks/splitkv_sweep.py --dtypes int4 int2 k4v2 --no-rotate --docs docs/long_context.md \
        --tag splitkv-sweep-unrotated   # the rotation's cost: the same kernel over unrotated caches

For each context and cache dtype (bf16, fp8 e4m3, and int4 / int2 beyond the window:
the low-bit kernel over a `LowBitStaticCache` filled with random levels, rotated as the
cache is by default): the default launch, then splits x block size x warps x stages. GB/s = the K/V bytes the output row
must read (low-bit: packed slots with their scales, the bf16 sinks and window) / time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time

import torch
from triton.testing import do_bench

from orthros import OrthrosConfig
from orthros.bench.common import splice_marks
from orthros.bench.decode import fill_random
from orthros.models.lowbit_cache import LowBitStaticCache
from orthros.ops.splitkv import _num_sms, splitkv_attention
from orthros.ops.splitkv.study import LOOPS, from_environment, loop_options, lowbit_splitkv_attention

H, HKV, D, W = 32, 8, 128, 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp8", "int4", "int2", "k4v2"), default=["bf16", "fp8"])
    p.add_argument("--split-factors", type=float, nargs="+", default=[1, 2, 4],
                   help="split counts tried, as multiples of 2 x SMs / (batch x KV heads)")
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="keys per loop iteration")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                   help="registers a thread to cap the build at (0: no cap); a lower cap lets more programs share an SM "
                        "(sm_90 builds, Triton 3.6: fp8 at 32- and 64-key tiles spill nothing at 168; the int4 fp16 "
                        "loop spills 84 B at 168)")
    p.add_argument("--no-rotate", action="store_true", help="low-bit caches without the Hadamard rotation")
    p.add_argument("--loops", nargs="+", choices=LOOPS + ("gluon",), default=["gluon", "planar-f16"],
                   help="low-bit: the packed slots read by the Gluon kernel (gluon, the default on a GPU; "
                        "--split-factors then count its one-warp programs), or by the Triton kernel's loop over "
                        "bit planes with keys and values dequantized in fp16 (planar-f16), with keys folded into "
                        "q and values dequantized in fp32 (planar-dq), with the value scales folded into p "
                        "(planar), and/or the interleaving one")
    p.add_argument("--dots", nargs="+", choices=("fp16", "bf16"), default=["fp16", "bf16"],
                   help="fp8: the dots' operand type (fp16, the default: one conversion per two values; bf16: "
                        "through fp16, one more per value)")
    p.add_argument("--bandwidth", type=float, default=4.3, help="copy bandwidth ceiling in TB/s (the H200's)")
    p.add_argument("--out", default=None)
    p.add_argument("--docs", default=None, help="splice the summary table into this file (between marks)")
    p.add_argument("--tag", default="splitkv-sweep", help="the marks: <!-- <tag>-table:begin / end -->")
    args = p.parse_args()
    from_environment()  # ORTHROS_LOWBIT_KERNEL / ORTHROS_FP8_DOTS: study switches
    B, dev = args.batch, torch.device("cuda")
    rows = []
    sms = _num_sms(dev)
    print(f"{'context':>8s} {'dtype':6s} {'splits':>6s} {'block':>5s} {'warps':>5s} {'stages':>6s} {'loop':11s} {'us':>8s} {'GB/s':>6s}")
    for S, dtype in itertools.product(args.contexts, args.dtypes):
        q = torch.randn(B, 2, H, D, device=dev, dtype=torch.bfloat16)
        slot = torch.tensor([[S - 1, S - 1]], device=dev).expand(B, 2)
        qdoc = torch.zeros(B, 2, dtype=torch.long, device=dev)
        kdoc = torch.zeros(B, S, dtype=torch.long, device=dev)
        if dtype in ("int4", "int2", "k4v2"):
            cfg = OrthrosConfig.from_name("llama-3.1-8b", num_hidden_layers=1, window_size=W)
            cache = LowBitStaticCache(cfg, B, S, dev, torch.bfloat16, dtype, rotate=not args.no_rotate)
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
        low = dtype in ("int4", "int2", "k4v2")
        # the default launch (every option the kernel's own), then the sweep
        configs = [(None, None, None, None, 0)] + list(itertools.product(
            [max(1, round(f * base_splits)) for f in args.split_factors], args.blocks, args.warps, args.stages,
            args.maxnreg))
        variants = args.loops if low else [f"{x} dots" for x in args.dots] if dtype == "fp8" else [None]
        for (splits, block_n, warps, stages, nreg), loop in itertools.product(configs, variants):
            tile = {} if block_n is None else {"block_n": block_n}
            if low:
                fn = lambda: lowbit_splitkv_attention(q, *layer, slot, qdoc, kdoc, b, S, cache.key_bits,
                                                      cache.value_bits, cache.key_group, rotation=cache.rotation,
                                                      window=W, window_rows=1, num_splits=splits, **tile,
                                                      num_warps=warps, num_stages=stages, maxnreg=nreg or None,
                                                      **packed_options(loop))
            else:
                f16 = None if loop is None else loop == "fp16 dots"
                fn = lambda: splitkv_attention(q, k, v, slot, qdoc, kdoc, window=W, num_splits=splits,
                                               **tile, window_rows=1, num_warps=warps, num_stages=stages,
                                               maxnreg=nreg or None, fp16_dots=f16)
            try:
                fn()
                ms = do_bench(fn, warmup=3, rep=20)
            except Exception as e:  # a launch that does not fit (shared memory): skip it
                print(f"{S:8d} {dtype:6s} {splits!s:>6s} {block_n!s:>5s} {warps!s:>5s} {stages!s:>6s} {loop or '':11s}  failed: {type(e).__name__}")
                continue
            rows.append({"context": S, "dtype": dtype, "splits": splits, "block_n": block_n, "num_warps": warps,
                         "num_stages": stages, "maxnreg": nreg or None, "loop": loop, "us": ms * 1e3,
                         "GB_s": nbytes / ms / 1e6})
            print(f"{S:8d} {dtype:6s} {splits!s:>6s} {block_n!s:>5s} {warps!s:>5s} {stages!s:>6s} {loop or '':11s} "
                  f"{ms * 1e3:8.1f} {nbytes / ms / 1e6:6.0f}" + (f"  maxnreg {nreg}" if nreg else ""))
        best = max((r for r in rows if r["context"] == S and r["dtype"] == dtype), key=lambda r: r["GB_s"], default=None)
        if best:
            print(f"best at {S} {dtype}: {best}")
    text = summary(rows, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rotate": not args.no_rotate, "command": command(), "rows": rows}, f, indent=1)
    if args.docs and splice_marks(args.docs, text, (f"<!-- {args.tag}-table:begin -->", f"<!-- {args.tag}-table:end -->")):
        print(f"table written into {args.docs}")


def packed_options(loop: str) -> dict:
    """--loops name -> `lowbit_splitkv_attention` keyword arguments."""
    return dict(packed_kernel="gluon") if loop == "gluon" else dict(loop_options(loop), packed_kernel="triton")


def command() -> str:
    return "python " + " ".join(map(shlex.quote, ["benchmarks/splitkv_sweep.py", *sys.argv[1:]]))


def summary(rows: list[dict], args) -> str:
    """Per context and dtype: the default launch and the best one, GB/s and share of the roofline."""
    out = [f"Command: `{command()}`  ",
           f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; GPU: {torch.cuda.get_device_name()}; "
           f"torch {torch.__version__}; Llama-3.1-8B attention shape (H {H}, Hkv {HKV}, D {D}), window {W}, "
           f"batch {args.batch}, one layer; low-bit caches {'unrotated' if args.no_rotate else 'rotated'}. "
           f"GB/s: the K/V bytes the output row reads / kernel time (split + merge), against {args.bandwidth} TB/s.",
           "", "| context | cache | default launch µs | GB/s (roofline) | best (splits, block, warps, stages) | "
           "best µs | GB/s (roofline) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    frac = lambda r: f"{r['GB_s']:.0f} ({100 * r['GB_s'] / (args.bandwidth * 1e3):.0f}%)"
    for S, dtype, loop in dict.fromkeys((r["context"], r["dtype"], r.get("loop")) for r in rows):
        cell = [r for r in rows if r["context"] == S and r["dtype"] == dtype and r.get("loop") == loop]
        dtype = dtype if loop is None else f"{dtype}, {loop}" if loop.endswith("dots") else f"{dtype}, {loop} loop"
        d = next((r for r in cell if r["splits"] is None), None)
        b = max(cell, key=lambda r: r["GB_s"])
        cfg = f"{b['splits']}, {b['block_n']}, {b['num_warps']}, {b['num_stages']}" + (
            f", maxnreg {b['maxnreg']}" if b.get("maxnreg") else "")
        out.append(f"| {S} | {dtype} | {d['us']:.1f} | {frac(d)} | {cfg} | {b['us']:.1f} | {frac(b)} |" if d else
                   f"| {S} | {dtype} | – | – | {cfg} | {b['us']:.1f} | {frac(b)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
