"""Generate a continuation from a saved model directory.

    orthros generate runs/demo --prompt "def main():" --max-new-tokens 100
    orthros generate runs/smollm2-orthros --chat --prompt "What is the capital of France?" --temperature 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .data.tokenizer import load_tokenizer
from .generate import generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (config.json + model.safetensors)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template; print the answer only")
    p.add_argument("--adapter", default=None, help="a light-CPT adapter directory to apply first (adapter.json)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run(args) -> int:
    from .models import OrthrosForCausalLM

    d = Path(args.model)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d} is not a model directory (no config.json)")
    model = OrthrosForCausalLM.from_pretrained(str(d)).to(args.device).eval()
    if args.adapter:
        from .models.adapter import apply_adapter

        apply_adapter(model, args.adapter)
    tok = load_tokenizer(d, model.config.vocab_size)
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{d}: the tokenizer has no chat template (drop --chat)")
        prompt = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
    else:
        prompt = tok.encode(args.prompt)
    eos = getattr(tok, "eos_token_id", None)
    ids = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=eos,
                   prefill_chunk_size=args.prefill_chunk_size)
    out = ids[0].tolist()
    if args.chat:
        print(tok.decode(out[len(prompt):], skip_special_tokens=True).strip())
    else:
        print(tok.decode(out))
    return 0
