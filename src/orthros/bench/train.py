"""`orthros bench train`: pre-training step time, tokens/s and MFU, Orthros vs the same-size Transformer.

One optimizer step = forward + backward + AdamW on a [batch, seq_len] batch
of random tokens with `labels = input_ids` (pre-training: every position is
an output position). Same config, same code, `attention="full"` for the
baseline. Step time is the median over --steps after --warmup steps.

MFU counts the floating-point work each model really does (matrix products
of every linear layer on every token of each stream, and attention over the
visible (query, key) pairs), times 3 for forward + backward, over the step
time and the GPU's dense bf16 peak (--peak-tflops).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys

import torch

from ..errors import check_count, count_arg, positive_arg
from ..models import OrthrosConfig
from .common import DTYPES, add_run_arguments, build_model, environment, free_memory, is_oom, sync
from .prefill import parse_len


def seq_len(s: str) -> int:
    """A length (8192, 8K) of at least 2 tokens: a row trains each token on those before it."""
    return check_count(parse_len(s), 2)


def add_arguments(p):
    p.add_argument("--config", default="1.3b", help="config name")
    p.add_argument("--seq-len", type=seq_len, default=8192)
    p.add_argument("--batch-size", type=count_arg(1), default=1)
    p.add_argument("--steps", type=count_arg(1), default=10, help="timed steps")
    p.add_argument("--warmup", type=count_arg(0), default=3)
    p.add_argument("--variants", nargs="+", choices=("orthros", "full"), default=["orthros", "full"])
    p.add_argument("--window", type=count_arg(1), default=None, help="override the config's window")
    add_run_arguments(p)
    p.add_argument("--peak-tflops", type=positive_arg, default=989.0, help="dense peak of the GPU for MFU (H100/H200 bf16: 989)")
    p.add_argument("--out-dir", default="benchmarks/results/train", help="where train_bench.json / train_bench.md go")


def step_flops(cfg: OrthrosConfig, B: int, T: int) -> float:
    """Forward + backward FLOPs of one step (3x the forward's matrix products)."""
    C, F, L, H, Hkv, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    q_o = 2 * C * H * D  # q_proj + o_proj weights
    kv = 2 * C * Hkv * D
    mlp = 3 * C * F
    N = T - 1  # output positions: every position with a next-token label
    causal_pairs = N * (N + 1) / 2
    W = cfg.window_size
    swa_pairs = sum(min(t + 1, W) for t in range(T))
    if cfg.attention == "orthros":
        # base stream: every layer makes K/V; all but the last also q, o, MLP. Output stream: q, o, MLP.
        lin = L * T * kv + (L - 1) * T * (q_o + mlp) + L * N * (q_o + mlp)
        pairs = (L - 1) * swa_pairs + L * causal_pairs
    else:
        # last layer runs only at the output positions (K/V for every position)
        lin = L * T * kv + (L - 1) * T * (q_o + mlp) + N * (q_o + mlp)
        pairs = (L - 1) * T * (T + 1) / 2 + causal_pairs
    fwd = 2 * B * lin + 2 * B * N * C * V + 4 * B * H * D * pairs
    return 3 * fwd


def bench_variant(cfg, args, device, dtype) -> dict:
    model = build_model(cfg, device, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    B, T = args.batch_size, args.seq_len
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=device, generator=g)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time

            t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            end.record()
            sync(device)
            dt = start.elapsed_time(end) / 1e3
        else:
            dt = time.perf_counter() - t0
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss in {cfg.attention} step {i}")
        if i >= args.warmup:
            times.append(dt)
    step = statistics.median(times)
    flops = step_flops(cfg, B, T)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    params = sum(p.numel() for p in model.parameters())
    del model, opt
    free_memory()
    return dict(variant=cfg.attention, step_s=step, step_min_s=min(times), tokens_per_s=B * T / step,
                tflops=flops / step / 1e12, mfu=flops / step / (args.peak_tflops * 1e12), peak_gib=peak, params=params)


def table(result) -> str:
    env, rows = result["env"], result["rows"]
    full = next((r for r in rows if r["variant"] == "full" and "step_s" in r), None)
    out = [f"Command: `{result['command']}`  ",
           f"Date: {env['date']}; GPU: {env['gpu']}; torch {env['torch']}; {result['config']} "
           f"({rows[0].get('params', 0) / 1e9:.2f}B params incl. embeddings), seq {result['seq_len']}, batch "
           f"{result['batch_size']}, {result['dtype']}, AdamW, no activation checkpointing; median of {result['steps']} steps.", "",
           "| model | step time | vs full | tokens/s | model TFLOP/s | MFU | peak memory |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "step_s" not in r:
            out.append(f"| {r['variant']} | {r['status']} | – | – | – | – | – |")
            continue
        vs = f"{r['step_s'] / full['step_s']:.2f}×" if full else "–"
        out.append(f"| {r['variant']} | {1e3 * r['step_s']:.0f} ms | {vs} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                   f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} GiB |")
    out.append(f"\nMFU: FLOPs each model actually computes (both streams for Orthros) over {result['peak_tflops']:.0f} TFLOP/s.")
    return "\n".join(out)


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    over = {}
    if args.window:
        over["window_size"] = args.window
    if args.layers:
        over["num_hidden_layers"] = args.layers
    rows = []
    for v in args.variants:
        cfg = OrthrosConfig.from_name(args.config, attention=v, **over)
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.seq_len)
        try:
            rows.append(bench_variant(cfg, args, device, dtype))
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            free_memory()
            rows.append(dict(variant=v, status="oom"))
        r = rows[-1]
        print(f"{v:>8}: " + (f"{1e3 * r['step_s']:.1f} ms/step, {r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%"
                             if "step_s" in r else r["status"]), flush=True)
    result = dict(env=environment(device), command="orthros bench train " + " ".join(map(shlex.quote, sys.argv[3:])),
                  config=args.config, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                  dtype=args.dtype, peak_tflops=args.peak_tflops, rows=rows)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "train_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = table(result)
    open(os.path.join(args.out_dir, "train_bench.md"), "w").write(text + "\n")
    print(text)
    return 0
