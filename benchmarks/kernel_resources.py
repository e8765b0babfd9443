"""What ptxas reports for the low-bit split-KV kernel built for sm_90 (the H200), on this
machine, no GPU: registers per thread, spilled bytes, shared memory, per cache dtype, packed
loop (bit planes with values folded into p or dequantized / interleaving), warps and key tile, at the Llama-3.1-8B attention shape
(32 heads, 8 KV heads, head size 128; the decode pair: 2 query rows). Static figures from the
compiler, not timings: spills and shared memory are what the speed sweep
(benchmarks/splitkv_sweep.py, on the GPU) then explains.

    python benchmarks/kernel_resources.py --blocks 16 32 64 128 --plot benchmarks/results/long_context/kernel-resources.png \
        --out benchmarks/results/long_context/kernel-resources.json --docs docs/long_context.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time

from orthros.bench.common import save_figure, splice_marks, subplots
from orthros.ops.cross_compile import compile_for
from orthros.bench.lowbit_launches import LOOPS, lowbit_launch, loop_options
from orthros.ops.splitkv.lowbit import _kernel


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["int4", "int2", "k4v2"], choices=("int4", "int2", "k4v2"))
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS,
                   help="packed loops: bit planes (values folded into p / dequantized: -dq), interleaving")
    p.add_argument("--out", default=None)
    p.add_argument("--docs", default=None)
    p.add_argument("--tag", default="kernel-resources")
    p.add_argument("--plot", default=None, help="spilled bytes against the key tile, a panel per cache dtype (PNG)")
    args = p.parse_args()
    cmd = "python " + " ".join(map(shlex.quote, ["benchmarks/kernel_resources.py", *sys.argv[1:]]))
    rows = []
    for kv, loop, warps, block in itertools.product(args.dtypes, args.loops, args.warps, args.blocks):
        plan = lowbit_launch(kv, block_n=block, num_warps=warps, num_stages=args.stages, **loop_options(loop))
        r = dict(kv=kv, loop=loop, num_warps=warps, block_n=block, num_stages=args.stages,
                 **compile_for(_kernel(), plan.args, plan.meta))
        rows.append(r)
        print(r, flush=True)
    lines = [f"Command: `{cmd}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; built for sm_90 "
             "on a CPU machine (ptxas -v); rotated caches, stages " + str(args.stages) + ".", "",
             "| cache | packed loop | warps | key tile | registers | spilled bytes | shared memory |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['kv']} | {r['loop']} | {r['num_warps']} | {r['block_n']} | {r['registers']} | "
              f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} KiB |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": cmd, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    if args.docs and splice_marks(args.docs, text, (f"<!-- {args.tag}-table:begin -->", f"<!-- {args.tag}-table:end -->")):
        print(f"table written into {args.docs}")


def plot(rows: list[dict], path: str) -> None:
    kvs = list(dict.fromkeys(r["kv"] for r in rows))
    fig, axes = subplots(len(kvs), 4.2, 3.4)
    for ax, kv in zip(axes, kvs):
        for loop, warps in dict.fromkeys((r["loop"], r["num_warps"]) for r in rows):
            pts = sorted((r["block_n"], r["spill_bytes"]) for r in rows
                         if r["kv"] == kv and r["loop"] == loop and r["num_warps"] == warps)
            ax.plot(*zip(*pts), marker="o", linestyle={"planar": "-", "planar-dq": ":"}.get(loop, "--"),
                    label=f"{loop}, {warps} warps")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key tile")
        ax.set_ylabel("spilled bytes / thread")
        ax.set_title(f"{kv}, sm_90 build")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
