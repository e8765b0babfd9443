"""Context-parallel generation from a saved model: one long prompt over N processes.

    torchrun --nproc-per-node 4 -m orthros.parallel runs/demo --prompt-file long.txt --max-new-tokens 64
    python -m orthros.parallel runs/demo --prompt "def main():"        # one process, same code

Each rank holds the whole model and the whole (tokenized) prompt, prefills
its shard of the prompt and keeps its shard of the KV cache; rank 0 prints
the continuation (and timings with --verbose).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..errors import count_arg
from ..generate_cli import add_sampling_arguments


PROG = "python -m orthros.parallel"


def _sizes(s: str) -> list[int]:
    """--shard-sizes: whole numbers >= 1, comma-separated (`argument --shard-sizes: must be >= 1, got 0`)."""
    return [count_arg(1)(x) for x in s.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model directory (config.json + model.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="a text file holding the prompt")
    add_sampling_arguments(p, max_new_tokens=64, temperature=0.0, top_k=None)
    p.add_argument("--shard-sizes", type=_sizes, default=None, help="tokens per rank, comma-separated (default: even)")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="cast the model (default: as saved)")
    p.add_argument("--verbose", action="store_true", help="print prompt length and timings")
    return p


def run(args) -> int:
    import torch.distributed as dist

    from ..data.tokenizer import load_tokenizer
    from ..loading import load_model
    from .comm import init_from_env
    from .context import cp_generate

    d = Path(args.model)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d} is not a model directory (no config.json)")
    if args.prompt_file is not None and not Path(args.prompt_file).exists():
        raise FileNotFoundError(f"--prompt-file {args.prompt_file} does not exist")
    owns_group = not dist.is_initialized()
    cp, device = init_from_env(args.device)
    try:
        model = load_model(d).to(device).eval()  # checked, safetensors only
        if args.dtype:
            model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype])
        tok = load_tokenizer(d, model.config.vocab_size)
        text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
        ids = torch.tensor([tok.encode(text)], dtype=torch.long, device=device)
        if ids.shape[1] < cp.world:
            raise ValueError(f"the prompt has {ids.shape[1]} tokens, fewer than the {cp.world} ranks")
        sizes = args.shard_sizes
        t0 = time.perf_counter()
        out = cp_generate(model, ids, args.max_new_tokens, cp=cp, shard_sizes=sizes, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop_tokens=getattr(tok, "eos_token_id", None))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if cp.rank == 0:
            print(tok.decode(out[0, ids.shape[1]:].tolist()))
            if args.verbose:
                n = out.shape[1] - ids.shape[1]
                print(f"[{cp.world} ranks] prompt {ids.shape[1]} tokens, {n} new, {seconds:.2f} s", file=sys.stderr)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)  # (as the parser says its errors)
        return 2


if __name__ == "__main__":
    sys.exit(main())
