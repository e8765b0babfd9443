"""Orthros on CPU against transformers' Llama at the same shapes (fp32, random weights).

    python benchmarks/cpu_attention_bench.py [--prefill 1024 4096 8192] [--train 1024] [--threads 2]

The model is a 135M Llama-architecture size (30 layers, hidden 576, 9 query /
3 KV heads, head dim 64, vocab 49152); Orthros uses window 128, and its
`attention="full"` baseline runs the same code as a plain causal model.
Phases:
    prefill   — no autograd, `logits_to_keep=1`: base stream (SWA) + one output query
                (Llama: full causal attention, logits of the last token).
    forward   — pre-training forward without autograd: outputs at every position.
    train     — pre-training forward + backward with `labels` (the loss at every position).
Each model runs once to warm up, then `--reps` times, the models taking turns so that
load from other processes hits them alike; the table gives the fastest run in seconds
(wall clock) and its ratio to Llama's fastest run of the same phase and length, and the
same for the process's CPU time (user + system, all threads), which load from other
processes disturbs less on a shared machine. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

SIZES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, rope_theta=1e5, tie_word_embeddings=True)
WINDOW = 128
MODELS = ("llama", "orthros", "orthros-full")


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**SIZES, attn_implementation="sdpa"))
    from orthros import OrthrosConfig, OrthrosForCausalLM

    attention = "full" if name == "orthros-full" else "orthros"
    return OrthrosForCausalLM(OrthrosConfig(**SIZES, window_size=WINDOW, attention=attention))


def step_fn(model, phase: str, ids: torch.Tensor):
    if phase == "train":
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
        return step
    model.eval()
    keep = 1 if phase == "prefill" else 0

    def step():
        with torch.no_grad():
            model(ids, logits_to_keep=keep)
    return step


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def run_phase(models: dict, phase: str, T: int, reps: int) -> dict:
    """Fastest of `reps` runs per model (after one warm-up), the models interleaved."""
    ids = torch.randint(0, SIZES["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
    steps = {name: step_fn(m, phase, ids) for name, m in models.items()}
    for fn in steps.values():
        fn()
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            times[name].append(timed(fn))
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 8192], help="prompt lengths")
    p.add_argument("--forward", type=int, nargs="*", default=[1024], help="pre-training forward lengths")
    p.add_argument("--train", type=int, nargs="*", default=[1024], help="forward + backward lengths")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ops" / "cpu_attention.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()  # 1/5/15-minute load averages: other processes on the machine
    models = {name: build(name) for name in args.models}
    base = "llama" if "llama" in models else None
    rows = []
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, load average {load_start[0]:.1f}")
    head = ("phase", "T", "model", "seconds", "vs llama", "CPU s", "vs llama")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 6, 13, 9, 9, 9, 9))))
    fmt = lambda r: "" if r is None else f"{r:.2f}x"
    for phase, lengths in (("prefill", args.prefill), ("forward", args.forward), ("train", args.train)):
        for T in lengths:
            times = run_phase(models, phase, T, args.reps)
            ref = (min(w for w, _ in times[base]), min(c for _, c in times[base])) if base else None
            for name, ts in times.items():
                wall, cpu = min(w for w, _ in ts), min(c for _, c in ts)
                ratio, cpu_ratio = (wall / ref[0], cpu / ref[1]) if ref else (None, None)
                rows.append(dict(phase=phase, T=T, model=name, seconds=wall, cpu_seconds=cpu, vs_llama=ratio,
                                 cpu_vs_llama=cpu_ratio, runs=[w for w, _ in ts], cpu_runs=[c for _, c in ts]))
                print(f"{phase:>8} {T:>6} {name:>13} {wall:>9.3f} {fmt(ratio):>9} {cpu:>9.3f} {fmt(cpu_ratio):>9}",
                      flush=True)
    out = dict(command=" ".join(["python", *sys.argv]), load_average=dict(start=load_start, end=os.getloadavg()),
               torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu,
               cpu_count=os.cpu_count(), window=WINDOW, sizes=SIZES, dtype="float32", reps=args.reps, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
