"""Generate a continuation from a saved model directory.

    orthros generate runs/demo --prompt "def main():" --max-new-tokens 100
    orthros generate runs/smollm2-orthros --chat --prompt "What is the capital of France?" --temperature 0
    orthros generate runs/smollm2-orthros --kv-dtype int4 --prompt "$(cat long.txt)"   # int4 beyond the window
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .data.tokenizer import load_tokenizer
from .errors import UserError, count_arg, number_arg
from .generate import generate
from .models.static_cache import KV_DTYPES, LOWBIT_KV_DTYPES
from .loading import check_model_dir, load_model, resolve_device


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + model.safetensors)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template; print the answer only")
    p.add_argument("--adapter", default=None, help="a light-CPT adapter directory to apply first (adapter.json)")
    add_sampling_arguments(p, max_new_tokens=100, temperature=0.8, top_k=40)
    p.add_argument("--prefill-chunk-size", type=count_arg(1), default=None)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="the KV cache's storage: anything but auto runs the fast path (a static cache; int4 / int2 / "
                        "k4v2: Orthros models, bf16 for the window and 4 sink tokens, low-bit beyond)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float,
                           top_k: int | None) -> None:
    """The sampling flags (`orthros generate`, `python -m orthros.parallel`), each checked by the parser."""
    p.add_argument("--max-new-tokens", type=count_arg(0), default=max_new_tokens)
    p.add_argument("--temperature", type=number_arg(least=0), default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=count_arg(1), default=top_k)
    p.add_argument("--top-p", type=number_arg(above=0, most=1), default=None)
    p.add_argument("--seed", type=int, default=None)


def check_args(args) -> None:
    """Range checks before anything is loaded."""
    if not args.prompt:
        raise UserError("--prompt is empty")


def run(args) -> int:
    check_args(args)
    device = resolve_device(args.device)
    d = Path(args.model)
    cfg = check_model_dir(d)  # config, weights' headers, tokenizer and prompt: all checked before a weight is read
    if args.kv_dtype in LOWBIT_KV_DTYPES and cfg.attention != "orthros":
        raise UserError(f"--kv-dtype {args.kv_dtype} needs an Orthros model (its base stream reads only the window); "
                        f"{d / 'config.json'} has attention={cfg.attention!r}")
    tok = load_tokenizer(d, cfg.vocab_size)
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise UserError(f"{d}: the tokenizer has no chat template (drop --chat)")
        prompt = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
    else:
        prompt = tok.encode(args.prompt)
    if not prompt:
        raise UserError("--prompt encodes to no tokens")
    if max(prompt) >= cfg.vocab_size:
        raise UserError(f"{d}: the tokenizer gives token id {max(prompt)}, outside the model's vocabulary "
                        f"(vocab_size={cfg.vocab_size} in {d / 'config.json'})")
    if len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UserError(f"{d / 'config.json'}: the prompt ({len(prompt)} tokens) plus --max-new-tokens "
                        f"{args.max_new_tokens} exceeds the model's context (max_position_embeddings="
                        f"{cfg.max_position_embeddings})")
    model = load_model(d, config=cfg).to(device).eval()
    if args.adapter:
        from .models.adapter import apply_adapter

        apply_adapter(model, args.adapter)
    eos = getattr(tok, "eos_token_id", None)
    ids = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=eos,
                   prefill_chunk_size=args.prefill_chunk_size, fast=True if args.kv_dtype != "auto" else None,
                   kv_dtype=args.kv_dtype)
    out = ids[0].tolist()
    if args.chat:
        print(tok.decode(out[len(prompt):], skip_special_tokens=True).strip())
    else:
        print(tok.decode(out))
    return 0
