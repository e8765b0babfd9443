"""Context-parallel prefill across N GPUs: Orthros vs the same-code full Transformer.

One run = one GPU count (the torchrun world); a report merges the runs:

    torchrun --nproc-per-node 8 benchmarks/cp_prefill.py --out benchmarks/results/cp_prefill/cp_prefill.jsonl
    torchrun --nproc-per-node 4 benchmarks/cp_prefill.py --out benchmarks/results/cp_prefill/cp_prefill.jsonl
    ...                                        (and 2, 1: `python benchmarks/cp_prefill.py ...`)
    python benchmarks/cp_prefill.py --report benchmarks/results/cp_prefill/cp_prefill.jsonl --plot benchmarks/results/cp_prefill/cp_prefill.png

Each measurement times `orthros.parallel.cp_prefill` of a random prompt of T
tokens (batch 1) on random weights with the shapes of `--preset`
(Llama-3.1-8B: 32 layers, bf16), from the first embedding to the last
token's logits with the KV cache filled, as the slowest rank's wall time
(median of `--repeats` after `--warmup`). `full` shards the prompt by equal
estimated cost (`balanced_bounds`: causal attention makes later tokens
dearer), `orthros` evenly. A configuration whose estimated memory exceeds a
GPU is recorded as skipped rather than run; an out-of-memory error is
recorded and ends the run (the rows written before it stay).

After the prefill timings, `--decode-steps` greedy decode steps on the
sharded cache give the per-token decode latency (median, slowest rank).
At world size 1 the library's own `generate.prefill` is timed too
(`attention=<kind>/model`), to show the CP loop loses nothing on one GPU.

The report gives, per (kind, T): seconds per GPU count, the speedup over
the smallest GPU count that ran, the scaling efficiency
t(n0) * n0 / (t(n) * n), and Orthros' speedup over the full Transformer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from orthros import OrthrosConfig, OrthrosForCausalLM
from orthros.generate import prefill
from orthros.parallel import CPGroup, balanced_bounds, cp_decode_one_token, cp_prefill, init_from_env
from orthros.models.block import MLP_CHUNK

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b", help="model shape (OrthrosConfig.from_name)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--window", type=int, default=128, help="Orthros window W")
    p.add_argument("--lengths", default="262144,524288,1048576", help="prompt lengths T, comma-separated")
    p.add_argument("--attention", default="orthros,full", help="kinds to time, comma-separated")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: gloo, for checking the script)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=16,
                   help="after the prefill, time this many greedy decode steps on the sharded cache (0: none)")
    p.add_argument("--crossover", type=float, default=23000.0,
                   help="full-attention sharding: the position at which a token's causal attention costs "
                        "as much as its linear layers (23K: Llama-3.1-8B on an H200, SPEC section 6)")
    p.add_argument("--out", default="benchmarks/results/cp_prefill/cp_prefill.jsonl", help="JSON lines, appended")
    p.add_argument("--report", nargs="*", default=None, metavar="JSONL",
                   help="do not run: merge result files into a markdown table")
    p.add_argument("--plot", default=None, help="with --report: write a PNG of seconds and efficiency")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.attention = [x for x in args.attention.split(",") if x]
    for kind in args.attention:
        if kind not in ("orthros", "full", "swa"):
            raise ValueError(f"--attention: unknown kind {kind!r} (orthros, full, swa)")
    if any(t < 1 for t in args.lengths):
        raise ValueError(f"--lengths must be positive, got {args.lengths}")
    return args


def build_model(args, kind: str, device: torch.device) -> OrthrosForCausalLM:
    """Random weights of the preset's shapes, made directly on the device in the run's dtype."""
    over = dict(attention=kind, window_size=args.window, attn_backend="auto")
    if args.layers:
        over["num_hidden_layers"] = args.layers
    cfg = OrthrosConfig.from_name(args.preset, **over)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with torch.device(device):
            model = OrthrosForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def estimate_gib(cfg, bounds, rank: int, T: int, kind: str, nbytes: int) -> float:
    """A rough peak-memory estimate for one rank: weights, its KV shard, activations, halo."""
    C, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    weights = 2 * cfg.vocab_size * C + L * (2 * C * qd + 2 * C * kvd + 3 * C * I)
    n = bounds[rank][1] - bounds[rank][0]
    kv = L * n * 2 * kvd
    act = n * (4 * C + 2 * qd + 6 * kvd) + min(n, MLP_CHUNK) * 3 * I
    halo = 3 * 2 * kvd * (bounds[rank][0] if kind == "full" else cfg.window_size)
    return (weights + kv + act + halo) * nbytes / GiB + 2.0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def slowest(x: float, device) -> float:
    """The max of a float over ranks."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def time_call(fn, warmup: int, repeats: int, device) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(slowest(time.perf_counter() - t0, device))
    return times


def time_decode(model, ids, cp, bounds, steps: int, device) -> float:
    """Milliseconds per greedy decode step on the sharded cache of one prefill (slowest rank, median)."""
    logits, cache = cp_prefill(model, ids, cp=cp, bounds=bounds)
    times = []
    for _ in range(steps):
        tok = logits.argmax(-1)
        sync(device)
        t0 = time.perf_counter()
        logits = cp_decode_one_token(model, tok, cache)
        sync(device)
        times.append(slowest(time.perf_counter() - t0, device))
    return 1000 * statistics.median(times[1:] or times)  # the first step may compile


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def run(args) -> list[dict]:
    owns_group = not dist.is_initialized()
    try:
        return _run(args)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _run(args) -> list[dict]:
    cp, device = init_from_env(args.device)
    cp = CPGroup(cp.group)
    world, rank = cp.world, cp.rank
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    total = torch.cuda.mem_get_info(device)[1] / GiB if device.type == "cuda" else float("inf")
    nbytes = torch.finfo(DTYPES[args.dtype]).bits // 8
    common = dict(date=datetime.date.today().isoformat(), commit=git_commit(), device=gpu, world=world,
                  preset=args.preset, dtype=args.dtype, window=args.window,
                  command=" ".join([f"torchrun --nproc-per-node {world}" if world > 1 else "python",
                                    "benchmarks/cp_prefill.py", *args.argv]))
    rows = []
    for kind in args.attention:
        model = build_model(args, kind, device)
        cfg = model.config
        for T in args.lengths:
            crossover = args.crossover if kind == "full" else float("inf")
            row = dict(common, attention=kind, T=T, layers=cfg.num_hidden_layers)
            if T < world:
                continue
            bounds = balanced_bounds(T, world, crossover)
            row["shards"] = [b - a for a, b in bounds]
            need = max(estimate_gib(cfg, bounds, r, T, kind, nbytes) for r in range(world))
            row["est_gib"] = round(need, 1)
            if need > 0.95 * total:
                rows.append(dict(row, status=f"skipped: needs ~{need:.0f} GiB per GPU, has {total:.0f}"))
                _write(args.out, rows[-1], rank)
                continue
            ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                times = time_call(lambda: cp_prefill(model, ids, cp=cp, bounds=bounds), args.warmup, args.repeats,
                                  device)
            except torch.OutOfMemoryError:
                _write(args.out, dict(row, status="oom", rank=rank), 0)  # this rank writes
                if world > 1:  # the other ranks wait in a collective: end the run (torchrun stops them)
                    sys.stderr.write(f"rank {rank}: out of memory at {kind} T={T}; ending the run\n")
                    os._exit(1)
                torch.cuda.empty_cache()
                continue
            decode_ms = time_decode(model, ids, cp, bounds, args.decode_steps, device) if args.decode_steps else None
            peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0
            rows.append(dict(row, status="ok", seconds=statistics.median(times), all_seconds=times,
                             tokens_per_s=T / statistics.median(times), peak_gib=round(slowest(peak, device), 1),
                             decode_ms_per_token=decode_ms))
            _write(args.out, rows[-1], rank)
            if world == 1:  # the model's own prefill (no MLP chunking), for reference
                ref = dict(row, attention=f"{kind}/model")
                if need + 3 * T * cfg.intermediate_size * nbytes / GiB > 0.95 * total:
                    rows.append(dict(ref, status="skipped: the unchunked MLP does not fit"))
                else:
                    try:
                        times = time_call(lambda: prefill(model, ids), args.warmup, args.repeats, device)
                        rows.append(dict(ref, status="ok", seconds=statistics.median(times), all_seconds=times,
                                         tokens_per_s=T / statistics.median(times)))
                    except torch.OutOfMemoryError:
                        rows.append(dict(ref, status="oom"))
                        torch.cuda.empty_cache()
                _write(args.out, rows[-1], rank)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _write(path: str, row: dict, rank: int):
    if rank != 0:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: row.get(k) for k in ("attention", "world", "T", "status", "seconds", "peak_gib")}),
          flush=True)


# ------------------------------------------------------------------ report
def load_rows(paths) -> list[dict]:
    rows = []
    for p in paths:
        rows += [json.loads(line) for line in open(p) if line.strip()]
    return rows


def report(rows: list[dict], plot: str | None = None) -> str:
    """Markdown: per (kind, T) the seconds at each GPU count, speedup, efficiency; Orthros vs full."""
    best = {}  # the latest row per (attention, T, world)
    for r in rows:
        best[(r["attention"], r["T"], r["world"])] = r
    kinds = sorted({k for k, _, _ in best})
    lengths = sorted({t for _, t, _ in best})
    lines = ["| attention | T | GPUs | seconds | tokens/s | speedup | efficiency | vs full | decode ms/token | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    curves = {}
    for kind in kinds:
        for T in lengths:
            runs = sorted((w, r) for (k, t, w), r in best.items() if k == kind and t == T)
            ok = [(w, r) for w, r in runs if r["status"] == "ok"]
            n0, t0 = (ok[0][0], ok[0][1]["seconds"]) if ok else (None, None)
            for w, r in runs:
                if r["status"] != "ok":
                    lines.append(f"| {kind} | {T} | {w} | | | | | | | {r['status']} |")
                    continue
                s = r["seconds"]
                base, slash, how = kind.partition("/")  # "orthros/model" compares with "full/model"
                full = None if base == "full" else best.get(("full" + slash + how, T, w))
                vs = f"{full['seconds'] / s:.2f}x" if full and full["status"] == "ok" else ""
                dec = r.get("decode_ms_per_token")
                lines.append(f"| {kind} | {T} | {w} | {s:.3f} | {T / s:,.0f} | {t0 / s:.2f}x | "
                             f"{t0 * n0 / (s * w):.0%} | {vs} | {'' if dec is None else f'{dec:.2f}'} | ok |")
                curves.setdefault((kind, T), []).append((w, s, t0 * n0 / (s * w)))
    if plot and curves:
        _plot(curves, plot)
    return "\n".join(lines)


def _plot(curves, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    gpus = set()
    for (kind, T), pts in sorted(curves.items()):
        if "/" in kind:  # the single-GPU model reference is not a scaling curve
            continue
        w, s, e = zip(*pts)
        gpus.update(w)
        style = "-o" if kind == "orthros" else "--s"
        label = f"{kind} T={T // 1024}K" if T >= 1024 else f"{kind} T={T}"
        ax1.plot(w, s, style, label=label)
        ax2.plot(w, e, style, label=label)
    ax1.set(yscale="log", ylabel="prefill seconds", title="Context-parallel prefill")
    ax2.set(ylabel="scaling efficiency", ylim=(0, 1.1), title="t(n0)·n0 / (t(n)·n)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(gpus), [str(g) for g in sorted(gpus)])
        ax.set_xlabel("GPUs")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        if not args.report:
            raise ValueError("--report needs at least one results file")
        print(report(load_rows(args.report), args.plot))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
