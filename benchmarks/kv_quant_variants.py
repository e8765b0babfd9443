"""Low-bit cache variants on the real model's copy probe: what the rotation, group sizes and
more bf16 slots buy at about the same bits per element.

    python benchmarks/kv_quant_variants.py                     # every variant (CPU, ~1 h on 2 busy cores)
    python benchmarks/kv_quant_variants.py --only int2 "int2 unrotated"

The model and the probe are benchmarks/kv_quant_quality.py's (SmolLM2-135M-Instruct
converted at W = 128 + the shipped CPT adapter; loss on the second copy of a
100-token segment repeated after a gap, the text read through the cache in
256-token chunks). Each variant is a `LowBitStaticCache` built with other
constructor arguments; bits per element are the packed slots' (scales included;
the bf16 sinks and recent slots are a fixed count, not a per-element cost).

Writes benchmarks/results/kv_quant/kv_quant_variants.json and .md; with --docs
docs/long_context.md it also splices the table there (between its kv-variants-table marks).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from kv_quant_quality import copy_stream, load_model, publish  # sibling benchmark script

# name -> (kv_dtype, LowBitStaticCache arguments); bf16 / fp8 are the plain static cache
VARIANTS = {
    "bf16": ("bf16", {}),
    "int4 unrotated": ("int4", dict(rotate=False)),
    "int4": ("int4", {}),
    "k4v2 unrotated": ("k4v2", dict(rotate=False)),
    "k4v2": ("k4v2", {}),
    "int2 unrotated": ("int2", dict(rotate=False)),
    "int2 unrotated, 64 sinks": ("int2", dict(rotate=False, sinks=64)),
    "int2 unrotated, 256 recent": ("int2", dict(rotate=False, recent=256)),
    "int2 unrotated, groups of 32": ("int2", dict(rotate=False, key_group=32, value_group=32)),
    "int2": ("int2", {}),
    "int2, key groups of 128": ("int2", dict(key_group=128)),
    "int2, key groups of 32": ("int2", dict(key_group=32)),
    "int2, 64 sinks, 256 recent": ("int2", dict(sinks=64, recent=256)),
    "int2, key groups of 32, 64 sinks, 256 recent": ("int2", dict(key_group=32, sinks=64, recent=256)),
}


def cache_fn(kv: str, kw: dict):
    """new_cache(model, B, T) for `copy_probe`, or None for the default cache of `kv`."""
    if kv in ("bf16", "fp8"):
        return None
    from orthros.models.lowbit_cache import LowBitStaticCache

    def new(model, B, T):
        p = next(model.parameters())
        return LowBitStaticCache(model.config, B, T, p.device, p.dtype, kv, **kw)
    return new


def bits(model, kv: str, kw: dict) -> float:
    from orthros.models.lowbit_cache import LowBitStaticCache

    if kv in ("bf16", "fp8"):
        return {"bf16": 16.0, "fp8": 8.0}[kv]
    c = LowBitStaticCache(model.config, 1, 1 << 14, "meta", torch.bfloat16, kv, **kw)
    return 8 * c.slot_bytes() / (2 * model.config.num_key_value_heads * model.config.head_dim)


def table(res: dict) -> str:
    meta = res["meta"]
    ref = res["variants"].get("bf16")
    gaps = meta["gaps"]
    out = [f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; {meta['machine']}; torch {meta['torch']}; model {meta['model']} (fp32 weights, "
           f"window {meta['window']}); {meta['samples']} samples per gap, the same for every variant.", "",
           "| cache | bits / element | " + " | ".join(f"copy loss @{g}" for g in gaps) + " |",
           "| --- | --- |" + " --- |" * len(gaps)]
    for name, r in res["variants"].items():
        cells = []
        for g in map(str, gaps):
            c = r["copy"][g]["second"]
            rel = "" if ref is None or name == "bf16" else f" ({100 * (c / ref['copy'][g]['second'] - 1):+.1f}%)"
            cells.append(f"{c:.3f}{rel}")
        out.append(f"| {name} | {r['bits']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=None, help="these variants (default: all)")
    p.add_argument("--gaps", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--adapter", default="adapters/smollm2-135m-w128-lora")
    p.add_argument("--out", default="benchmarks/results/kv_quant/kv_quant_variants.json")
    p.add_argument("--docs", default=None, metavar="PAGE",
                   help="also splice the table into PAGE between its marks (docs/long_context.md holds them)")
    p.add_argument("--table-only", action="store_true", help="print (and write, splice) the table of --out and stop")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        return publish(table(json.loads(out.read_text())), out, args.docs, "kv-variants")
    from orthros.eval.longrange import copy_probe

    model, tok, name = load_model(None, args.adapter)
    stream = copy_stream(tok)
    res = dict(meta=dict(command="python " + " ".join(map(shlex.quote, ["benchmarks/kv_quant_variants.py",
                                                                         *sys.argv[1:]])),
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                         machine=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)", model=name,
                         window=model.config.window_size, gaps=args.gaps, samples=args.samples), variants={})
    for v in args.only or list(VARIANTS):
        kv, kw = VARIANTS[v]
        t = time.time()
        r = copy_probe(model, stream, args.gaps, args.samples, batch_size=4, kv_dtype=kv, new_cache=cache_fn(kv, kw))
        res["variants"][v] = dict(kv_dtype=kv, args=kw, bits=bits(model, kv, kw), copy=r["by_gap"],
                                  seconds=round(time.time() - t, 1))
        print(f"{v}: {json.dumps(r['by_gap'])} ({time.time() - t:.0f} s)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
    publish(table(res), out, args.docs, "kv-variants")


if __name__ == "__main__":
    main()
