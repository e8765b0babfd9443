"""Benchmark prefill (time to first token vs prompt length) or a training step.

    orthros bench prefill   Orthros vs same-code full attention vs transformers vs the linear floor
    orthros bench train     pre-training step time, tokens/s and MFU, Orthros vs full attention
    orthros bench decode    decode tokens/s and achieved bandwidth against context, Orthros vs full attention
    orthros bench e2e       time to first token and end-to-end generation time, Orthros vs full attention
    orthros bench serve     the OpenAI server under load (TTFT, TPOT, ITL, throughput), Orthros vs full attention
    orthros bench capacity  the longest prompt that prefills and decodes per KV cache dtype (bf16 / fp8 / int4 / int2)

Results go to JSON, a Markdown table and (prefill) a log-log plot under --out-dir.

Kernel variants for A/B studies come from the environment (`ops.splitkv.study.from_environment`):
ORTHROS_LOWBIT_KERNEL=triton (the low-bit cache's packed slots by the Triton kernel, not Gluon),
ORTHROS_FP8_DOTS=bf16 (bf16 dots over an fp8 cache, not fp16).
"""

from __future__ import annotations

import argparse

from . import capacity, decode, e2e, prefill, serve, train

SUBCOMMANDS = {"prefill": prefill, "train": train, "decode": decode, "e2e": e2e, "serve": serve, "capacity": capacity}


def add_arguments(parser):
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, mod in SUBCOMMANDS.items():
        doc = (mod.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_bench_run=mod.run, _parser=p)  # (its own usage for a flag it does not know)


def run(args):
    from ..errors import check_output_dir
    from ..loading import resolve_device
    from ..ops.splitkv.study import from_environment

    from_environment()  # the study switches, if any (benchmarks only)

    if args.device is not None:
        resolve_device(args.device)
    check_output_dir(args.out_dir, "--out-dir")
    return args._bench_run(args)
