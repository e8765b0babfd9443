"""Train a tiny Orthros model on this machine's Python sources, then generate.

The embedded default: no download, no GPU needed. Byte-level tokens, a
sliding window much shorter than the training sequences, a time budget.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .data.stdlib import stdlib_text
from .data.tokenizer import ByteTokenizer
from .generate import generate
from .models import OrthrosConfig, OrthrosForCausalLM


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    p.add_argument("--window", type=int, default=32, help="sliding window of the base stream")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--prompt", default="def read_config(path):\n    ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--out", default="runs/demo", help="where the trained model is saved")
    p.add_argument("--seed", type=int, default=0)


def demo_config(window: int) -> OrthrosConfig:
    return OrthrosConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, window_size=window,
                         max_position_embeddings=4096, tie_word_embeddings=True)


def run(args) -> int:
    torch.manual_seed(args.seed)
    tok = ByteTokenizer()
    data = torch.tensor(tok.encode(stdlib_text("train", max_bytes=4_000_000)), dtype=torch.long)
    model = OrthrosForCausalLM(demo_config(args.window))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, window {args.window}, sequences of {args.seq_len} bytes")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    start, step, loss_avg = time.time(), 0, None
    bar = tqdm(total=int(args.seconds), unit="s", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
    while (elapsed := time.time() - start) < args.seconds:
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / args.seconds)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch_size,))
        x = torch.stack([data[i : i + args.seq_len] for i in idx])
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        bar.n = min(time.time() - start, args.seconds)
        bar.set_postfix_str(f"step {step} loss {loss_avg:.3f} ({loss_avg / math.log(2):.2f} bits/byte)")
        bar.refresh()
    bar.close()
    out = Path(args.out)
    model.save_pretrained(out)
    print(f"trained {step} steps in {time.time() - start:.0f}s; saved to {out}/")
    ids = generate(model, [tok.encode(args.prompt)], max_new_tokens=args.max_new_tokens, temperature=0.8,
                   top_k=40, seed=args.seed)
    print("-" * 60)
    print(tok.decode(ids[0].tolist()))
    print("-" * 60)
    return 0
