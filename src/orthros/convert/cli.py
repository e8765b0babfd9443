"""Convert a Llama 3.x / Qwen3 / Qwen3-MoE / Mixtral checkpoint directory into an Orthros one.

    orthros convert Meta-Llama-3.1-8B llama-3.1-8b-orthros --window-size 128
    orthros convert Qwen3-8B qwen3-8b-orthros --dtype bf16
    orthros convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-orthros   # a GGUF file (Llama / Qwen3)

Every weight is reused; each layer gains the query scale-offset at identity,
so with a window >= the sequence length the result computes exactly the
source model. Continued pre-training (configs/cpt-*.yaml) adapts it to the
window. Streams tensor by tensor: memory stays far below the checkpoint size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import count_arg
from .hf import OUT_DTYPES, convert_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), "
                                "or a GGUF file / a directory holding one")
    p.add_argument("dst", help="output directory (must not exist, or be empty)")
    p.add_argument("--window-size", type=count_arg(1), default=128,
                   help="sliding window W of the base stream (default 128)")
    p.add_argument("--sink-tokens", type=count_arg(0), default=0,
                   help="the window also sees each document's first N tokens (attention sinks; default 0)")
    p.add_argument("--no-scale-offset", dest="scale_offset", action="store_false",
                   help="no query scale-offset (the paper's w/o-SO ablation)")
    p.add_argument("--dtype", choices=sorted(OUT_DTYPES), default=None,
                   help="output dtype (default: fp32 for an all-fp32 checkpoint, else bf16)")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--output-routing", choices=("independent", "bound", "base"), default=None,
                   help="a mixture-of-experts model: how output rows pick their experts (docs/moe.md; "
                        "default independent)")
    p.add_argument("--adapter", default=None,
                   help="a light-CPT adapter directory (adapter.json) to merge into the converted weights, "
                        "e.g. adapters/smollm2-135m-w128-lora")


def run(args) -> int:
    from ..data.tokenizer import TOKENIZER_FILES
    from ..errors import UserError

    src = Path(args.src)
    if (src / "config.json").is_file() and not any((src / f).exists() for f in TOKENIZER_FILES):
        raise UserError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); the converted model could not "
                        f"read text (copy the source model's tokenizer files beside its config.json)")
    if args.adapter is not None:
        out = convert_with_adapter(args)
    else:
        out = convert_checkpoint(args.src, args.dst, window_size=args.window_size, scale_offset=args.scale_offset,
                                 dtype=args.dtype, max_shard_size=args.max_shard_size,
                                 output_routing=args.output_routing, sink_tokens=args.sink_tokens)
    print(f"wrote {out}")
    return 0


def convert_with_adapter(args) -> Path:
    """Convert into a staging directory beside DST, merge the adapter, save, rename into place."""
    import json
    import os
    import shutil
    import tempfile

    from ..errors import UserError, read_json
    from ..loading import load_model
    from ..models.adapter import adapter_mismatch, apply_adapter
    from .hf import WEIGHT_SUFFIXES

    info = read_json(Path(args.adapter) / "adapter.json", "adapter description")
    why = adapter_mismatch(info, args.window_size, args.sink_tokens)  # before the conversion, not after it
    if why:
        raise UserError(f"{args.adapter}: {why} (--window-size, --sink-tokens)")
    dst = Path(args.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"destination {dst} already exists and is not an empty directory; choose another")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.adapter-", dir=dst.parent))
    try:
        conv = convert_checkpoint(args.src, staging / "conv", window_size=args.window_size,
                                  scale_offset=args.scale_offset, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                  output_routing=args.output_routing, sink_tokens=args.sink_tokens)
        model = load_model(conv)
        apply_adapter(model, args.adapter)
        out = staging / "out"
        model.save_pretrained(str(out), max_shard_size=args.max_shard_size)
        for f in conv.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (out / f.name).exists():
                shutil.copy2(f, out / f.name)
        (out / "orthros_adapter.json").write_text(json.dumps({"merged": str(args.adapter), **info}, indent=2))
        if dst.exists():
            dst.rmdir()
        os.replace(out, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst
