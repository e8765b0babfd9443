"""Write a full-weight fine-tune as an adapter of its base: each weight's change at rank r.

    orthros extract-adapter runs/cpt/models/ARM runs/smollm2-orthros-w128-s4 adapters/NAME --rank 16
    orthros convert runs/smollm2 DST --sink-tokens 4 --adapter adapters/NAME    # applied, as any adapter

TRAINED and BASE are model directories of the same shape (a CPT arm's saved weights and the
conversion it started from). Every changed 2-D weight becomes LoRA factors of its best rank-r
approximation (truncated SVD), every changed vector (SO, norms) its trained value: a full CPT
shipped in the size of a LoRA adapter. adapter.json records each weight's relative error; how
much of the model's quality the rank keeps is for `orthros experiment cpt` or `orthros eval` to measure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import count_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trained", help="the fine-tuned model directory")
    p.add_argument("base", help="the model directory it was fine-tuned from (the same shape)")
    p.add_argument("out", help="the adapter directory to write (adapter.safetensors + adapter.json)")
    p.add_argument("--rank", type=count_arg(1), default=16, help="rank of each weight's change (default 16)")
    p.add_argument("--lora-dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of the LoRA factors")


def run(args) -> int:
    import torch

    from ..errors import check_output_dir
    from ..loading import load_model
    from ..models.adapter import extract_adapter

    for what, d in (("TRAINED", args.trained), ("BASE", args.base)):
        if not (Path(d) / "config.json").is_file():
            raise FileNotFoundError(f"{what} {d}: not a model directory (no config.json)")
    check_output_dir(args.out, "OUT")
    trained = load_model(args.trained, dtype=torch.float32)
    base = load_model(args.base, dtype=torch.float32)
    dtype = torch.bfloat16 if args.lora_dtype == "bf16" else torch.float32
    info = extract_adapter(trained, base, args.out, args.rank, dtype,
                           meta={"trained": str(args.trained), "base": str(args.base),
                                 "command": f"orthros extract-adapter {args.trained} {args.base} {args.out} "
                                            f"--rank {args.rank} --lora-dtype {args.lora_dtype}"})
    err = info["relative_error"]
    size = (Path(args.out) / "adapter.safetensors").stat().st_size
    print(f"saved {args.out}: {info['tensors']} tensors, {info['parameters'] / 1e6:.2f}M numbers, {size / 2**20:.1f} MiB; "
          f"{len(err)} weights at rank {args.rank}, relative error of their change: mean "
          f"{sum(err.values()) / max(1, len(err)):.3f}, max {max(err.values(), default=0):.3f}")
    return 0
