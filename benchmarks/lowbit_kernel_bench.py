"""The low-bit split-KV read at a long context, kernel by kernel: the Gluon packed kernel alone
(`ops/splitkv/lowbit_gluon.py`, for its launch settings), the whole read through it (bf16 split +
packed kernel + merge) and through the Triton kernel, and the fp8 kernel as the baseline, in
interleaved rounds (each timing a CUDA-graph replay, median over its repetitions; the table gives
the median over rounds and the spread). Llama-3.1-8B attention shape, one decode step's two rows
(the base row windowed), random levels.

    python benchmarks/lowbit_kernel_bench.py [--context 1048576] [--dtypes int4 int2 k4v2]
        [--splits 132 264 528] [--maxnreg 0 168] [--pipe 0 1] [--rounds 3] [--out results.json]

GB/s: the bytes the output row must read (packed slots with their scales, the bf16 sinks and
ring) / time; roofline: against --bandwidth. The Gluon path's parts (its bf16 split with q R, and
its merge) are also timed alone: with the packed kernel they make up the path's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
from triton.testing import do_bench_cudagraph

from orthros import OrthrosConfig
from orthros.bench.decode import fill_random
from orthros.models.lowbit_cache import LowBitStaticCache
from orthros.ops.splitkv import splitkv_attention
from orthros.ops.splitkv.lowbit import bf16_split, bf16_splits, finish, gluon_launch, gluon_splits, packed_rows
from orthros.ops.splitkv.study import from_environment, lowbit_splitkv_attention

H, HKV, D, W = 32, 8, 128, 128


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1048576)
    p.add_argument("--dtypes", nargs="+", default=["int4", "int2", "k4v2"], choices=("int4", "int2", "k4v2"))
    p.add_argument("--splits", type=int, nargs="+", default=[0], help="Gluon programs a KV head (0: the default)")
    p.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="Gluon register caps (0: none)")
    p.add_argument("--pipe", type=int, nargs="+", default=[1], choices=(0, 1),
                   help="Gluon: tiles copied to shared memory a tile ahead (1) or loaded directly (0)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=4.3, help="copy bandwidth ceiling in TB/s")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from_environment()  # ORTHROS_LOWBIT_KERNEL / ORTHROS_FP8_DOTS: study switches
    dev, S = torch.device("cuda"), args.context
    q = torch.randn(1, 2, H, D, device=dev, dtype=torch.bfloat16)
    slot = torch.full((1, 2), S - 1, device=dev)
    qdoc = torch.zeros(1, 2, dtype=torch.long, device=dev)
    kdoc = torch.zeros(1, S, dtype=torch.long, device=dev)
    fns = {}  # name -> (fn, bytes)
    k8 = torch.randn(1, S, HKV, D, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    v8 = torch.randn(1, S, HKV, D, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    fns["fp8 read"] = (lambda: splitkv_attention(q, k8, v8, slot, qdoc, kdoc, window=W, window_rows=1),
                       2 * S * HKV * D)
    caches = []
    for kv in args.dtypes:
        cfg = OrthrosConfig.from_name("llama-3.1-8b", num_hidden_layers=1, window_size=W)
        cache = LowBitStaticCache(cfg, 1, S, dev, torch.bfloat16, kv)
        fill_random(cache, S)
        caches.append(cache)  # kept alive
        bound = cache.bound_at(S)
        nbytes = (bound - cache.sinks) * cache.slot_bytes() + (S - bound + cache.sinks) * 2 * HKV * D * 2
        layer, b = cache.layer(0), torch.tensor([bound], device=dev)
        common = (q, *layer, slot, qdoc, kdoc, b, S, cache.key_bits, cache.value_bits, cache.key_group)
        for pk in ("gluon", "triton"):
            fns[f"{kv} read, {pk}"] = (lambda c=common, pk=pk, rot=cache.rotation: lowbit_splitkv_attention(
                *c, rotation=rot, window=W, window_rows=1, packed_kernel=pk), nbytes)
        # the Gluon path's other launches alone, at the default split count: its breakdown
        P2, NB = gluon_splits(q, HKV, S), bf16_splits(cache.rk[0], cache.key_group)
        o = torch.zeros(1, NB + P2, 2, H, 2, D, device=dev)
        lse = torch.zeros(1, NB + P2, 2, H, device=dev)
        fns[f"{kv} path part: {NB} bf16 splits (sinks, ring) + q R"] = (
            lambda c=common, rot=cache.rotation, o=o, lse=lse: bf16_split(*c, o, lse, window=W, window_rows=1,
                                                                          rotation=rot),
            (S - bound + cache.sinks) * 2 * HKV * D * 2)
        fns[f"{kv} path part: merge (finish), {NB + P2} splits"] = (
            lambda o=o, lse=lse, rot=cache.rotation: finish(o, lse, packed_rows(2, W, 1), rot, q.dtype, NB),
            o[:, :, 1:, :, 1].numel() * 4)
        qr = (q.float() @ cache.rotation).to(q.dtype)
        pbytes = (bound - cache.sinks) * cache.slot_bytes()
        for splits in args.splits:
            P2 = gluon_splits(q, HKV, S, splits or None)
            o = torch.empty(1, 1 + P2, 2, H, 2, D, device=dev)
            lse = torch.empty(1, 1 + P2, 2, H, device=dev)
            for nreg, pipe in itertools.product(args.maxnreg, args.pipe):
                k, grid, a, meta = gluon_launch(qr, *layer[2:8], qdoc, kdoc, b, o, lse, cache.sinks, S,
                                                cache.key_bits, cache.value_bits, cache.key_group, None,
                                                packed_rows(2, W, 1), P2, nreg or None, bool(pipe))
                fns[f"{kv} packed, {P2} splits" + (f", maxnreg {nreg}" if nreg else "")
                    + (", pipelined" if pipe else ", direct")] = (
                    lambda k=k, grid=grid, a=a, meta=meta: k[grid](*a, **meta), pbytes)
    times = {name: [] for name in fns}
    for r in range(args.rounds):
        for name, (fn, _) in fns.items():
            fn()
            torch.cuda.synchronize()
            times[name].append(do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    print(f"context {S}; GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; us: median over "
          f"{args.rounds} rounds (min - max)\n")
    print("| what | us | min - max | GB/s (roofline) |\n| --- | ---: | ---: | ---: |")
    for name, (fn, nbytes) in fns.items():
        t = statistics.median(times[name])
        gbs = nbytes / t / 1e3
        rows.append({"what": name, "us": t, "all_us": times[name], "bytes": nbytes, "GB_s": gbs})
        print(f"| {name} | {t:.1f} | {min(times[name]):.1f} - {max(times[name]):.1f} | "
              f"{gbs:.0f} ({100 * gbs / (args.bandwidth * 1e3):.0f}%) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": S,
                       "command": "python " + " ".join(["benchmarks/lowbit_kernel_bench.py", *sys.argv[1:]]),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
