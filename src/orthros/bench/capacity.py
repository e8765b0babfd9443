"""`orthros bench capacity`: the longest prompt that prefills and then decodes per KV cache dtype.

For each --kv-dtypes entry, prompts of --lengths (ascending) are tried on one
Orthros model (random weights, batch 1, one document) until one runs out of
memory: the prompt is prefilled in chunks into a static cache of that dtype
(the time to first token, timed once), then --new tokens are decoded with the
compiled step (the first --warmup steps untimed). Reported per length: prefill
seconds, peak memory, decode tokens/s and its fraction of the dtype's
bandwidth roofline (weights + the K/V bytes a step reads, as `bench decode`
counts them, at --bandwidth). Before the first length of each dtype an
untimed prefill of two chunks compiles the prefill kernels.

    orthros bench capacity --kv-dtypes fp8 int4 int2 --lengths 1M 2M 3M 4M 6M
    orthros bench capacity --kv-dtypes fp8:1M,2M int4:2M,3M int2:4M,5M   # lengths per dtype
"""

from __future__ import annotations

import shlex
import sys

import torch

from ..errors import count_arg
from ..generate import auto_chunk_size, compiled_decode_step, decode_one_token_fast, fast_decode_step, new_static_cache
from ..generate import prefill as run_prefill
from ..models import OrthrosConfig
from ..models.static_cache import KV_DTYPES
from .common import (DTYPES, add_docs_argument, add_run_arguments, build_model, copy_bandwidth, environment,
                     free_memory, is_oom, log_panel, now, progress, render, result_from, save_figure, save_partial,
                     subplots, variant_config)
from .decode import cache_bytes, step_bytes
from .prefill import _fmt_len, parse_len


def add_arguments(p):
    p.add_argument("--model", default="llama-3.1-8b", help="config name (shape)")
    p.add_argument("--kv-dtypes", nargs="+", type=kv_dtype_spec, default=["fp8", "int4", "int2"],
                   help=f"cache dtypes ({', '.join(KV_DTYPES)}), each with its own lengths if given as "
                        "DTYPE:L1,L2,... (else --lengths)")
    p.add_argument("--lengths", nargs="+", type=parse_len, default=[parse_len(x) for x in ("1M", "2M", "3M", "4M")],
                   help="prompt lengths tried in ascending order (stops at the first that does not fit)")
    p.add_argument("--new", type=count_arg(1), default=32,
                   help="tokens generated after the prompt (the first from prefill)")
    p.add_argument("--warmup", type=count_arg(0), default=3, help="decode steps that compile / capture (untimed)")
    p.add_argument("--window", type=count_arg(1), default=128, help="Orthros window size")
    p.add_argument("--chunk-size", type=parse_len, default=None, help="prefill chunk (default: auto_chunk_size)")
    add_run_arguments(p, compile=True, bandwidth=True)
    p.add_argument("--tag", default="capacity", help="output files <tag>.json / .md / .png")
    p.add_argument("--out-dir", default="benchmarks/results/capacity")
    add_docs_argument(p, "docs/long_context.md")
    p.add_argument("--from-json", nargs="+", default=None, help="only re-render from saved JSON")


def kv_dtype_spec(s: str) -> str:
    """'int4' or 'int4:2M,3M' (lengths of that dtype only), checked at parse time."""
    kv, _, lens = s.partition(":")
    if kv not in KV_DTYPES:
        import argparse

        raise argparse.ArgumentTypeError(f"unknown cache dtype {kv!r} (one of {', '.join(KV_DTYPES)})")
    for x in filter(None, lens.split(",")):
        parse_len(x)
    return s


def plan(args) -> list[tuple[str, list[int]]]:
    """[(kv dtype, its lengths ascending)] from --kv-dtypes and --lengths."""
    out = []
    for spec in args.kv_dtypes:
        kv, _, lens = spec.partition(":")
        out.append((kv, sorted(parse_len(x) for x in lens.split(",") if x) if lens else sorted(args.lengths)))
    return out


def try_length(model, T: int, kv: str, args, step_fn, device, chunk: int) -> dict:
    """Prefill T random tokens into a `kv` cache, decode args.new - 1 more: one row."""
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    cache = new_static_cache(model, 1, T + args.new, kv)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = now(device)
    progress(f"{kv} {_fmt_len(T)}: prefilling {T} tokens in chunks of {chunk}")
    logits, _ = run_prefill(model, ids, None, cache=cache, chunk_size=chunk)
    ttft = now(device) - t0
    progress(f"{kv} {_fmt_len(T)}: prefilled in {ttft:.1f} s; decoding {args.new - 1} tokens")
    if not torch.isfinite(logits.float()).all():
        raise RuntimeError(f"non-finite logits after prefill (T={T}, {kv})")
    tok = logits.argmax(-1)
    n = args.new - 1
    w = min(args.warmup, n)
    for _ in range(w):
        tok = decode_one_token_fast(model, tok, cache, step_fn).argmax(-1)
    t0 = now(device)
    for _ in range(n - w):
        tok = decode_one_token_fast(model, tok, cache, step_fn).argmax(-1)
    dt = (now(device) - t0) / max(n - w, 1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    nbytes = step_bytes(model, cache, 1, T + w + (n - w) // 2)
    row = dict(status="ok", prefill_s=ttft, peak_gib=peak, cache_gib=cache_bytes(cache) / 2**30,
               step_s=dt if n > w else float("nan"), tokens_per_s=1 / dt if n > w else float("nan"), bytes=nbytes,
               roofline_tok_s=args.bandwidth * 1e12 / nbytes)
    row["roofline"] = row["tokens_per_s"] / row["roofline_tok_s"]
    del cache, logits
    return row


def measure(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    if args.bandwidth is None:
        args.bandwidth = round(copy_bandwidth(device), 2)
        progress(f"copy bandwidth of {device.type}: {args.bandwidth} TB/s (the roofline; --bandwidth sets it)")

    def result(rows):
        return dict(env=environment(device), command="orthros bench capacity " + " ".join(map(shlex.quote, sys.argv[3:])),
                    model=args.model, dtype=args.dtype, window=args.window, new=args.new,
                    bandwidth_tb_s=args.bandwidth, compiled=not args.no_compile, rows=rows)

    todo = plan(args)
    cfg = variant_config(args, "orthros", max(max(lens) for _, lens in todo) + args.new)
    progress(f"building {args.model} (random {args.dtype} weights)")
    model = build_model(cfg, device, dtype)
    chunk = args.chunk_size or auto_chunk_size(cfg, 1, dtype)
    step_fn = fast_decode_step if args.no_compile else compiled_decode_step()
    rows = []
    with torch.inference_mode():
        for kv, lengths in todo:
            progress(f"{kv}: compiling the prefill kernels (two chunks, untimed)")
            warm = new_static_cache(model, 1, 2 * chunk, kv)  # compile the prefill kernels (untimed)
            run_prefill(model, torch.zeros(1, 2 * chunk, dtype=torch.long, device=device), None, cache=warm,
                        chunk_size=chunk)
            del warm
            free_memory()
            for T in lengths:
                row = dict(kv_dtype=kv, prompt=T, new=args.new, layers=cfg.num_hidden_layers, chunk=chunk)
                try:
                    row.update(try_length(model, T, kv, args, step_fn, device, chunk))
                except Exception as e:  # noqa: BLE001 - OOM is a result, anything else is re-raised
                    if not is_oom(e):
                        raise
                    row.update(status="oom", note=str(e).splitlines()[0][:120])
                free_memory()
                rows.append(row)
                save_partial(args.out_dir, args.tag, result(rows))
                print(f"{kv:>5} {_fmt_len(T):>5}: " + (
                    f"prefill {row['prefill_s']:.1f} s, peak {row['peak_gib']:.1f} GiB, decode "
                    f"{row['tokens_per_s']:.1f} tok/s ({100 * row['roofline']:.0f}% of {row['roofline_tok_s']:.1f})"
                    if row["status"] == "ok" else "out of memory"), flush=True)
                if row["status"] != "ok":
                    break
    return result(rows)


def table(result) -> str:
    rows, env = result["rows"], result["env"]
    layers = rows[0]["layers"] if rows else "?"
    out = [f"Command: `{result['command']}`  ",
           f"Date: {env['date']}; GPU: {env['gpu']}; torch {env['torch']}; {result['model']} shape ({layers} layers), "
           f"random {result['dtype']} weights and prompt, batch 1, window {result['window']}, {result['new']} tokens "
           f"generated, decode {'compiled (CUDA graphs)' if result['compiled'] else 'eager'}; roofline: weights + "
           f"K/V read per step at {result['bandwidth_tb_s']} TB/s.", "",
           "| KV cache | prompt | prefill s | peak GiB | cache GiB | decode tok/s | roofline tok/s | of roofline |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] == "ok":
            out.append(f"| {r['kv_dtype']} | {_fmt_len(r['prompt'])} | {r['prefill_s']:.1f} | {r['peak_gib']:.1f} | "
                       f"{r['cache_gib']:.1f} | {r['tokens_per_s']:.1f} | {r['roofline_tok_s']:.1f} | "
                       f"{100 * r['roofline']:.0f}% |")
        else:
            out.append(f"| {r['kv_dtype']} | {_fmt_len(r['prompt'])} | out of memory | | | | | |")
    longest = {}
    for r in rows:
        if r["status"] == "ok":
            longest[r["kv_dtype"]] = max(longest.get(r["kv_dtype"], 0), r["prompt"])
    if longest:
        out += ["", "Longest prompt that prefilled and decoded: " +
                ", ".join(f"{k} {_fmt_len(v)}" for k, v in longest.items()) + "."]
    return "\n".join(out) + "\n"


def plot(result, path):
    fig, (ax,) = subplots(1, 6, 4.2)
    for kv in dict.fromkeys(r["kv_dtype"] for r in result["rows"]):
        pts = [(r["prompt"], r["peak_gib"]) for r in result["rows"] if r["kv_dtype"] == kv and r["status"] == "ok"]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kv)
    log_panel(ax, "prompt (tokens)", "peak memory (GiB)", f"capacity, {result['env']['gpu']}")
    save_figure(fig, path)


def run(args):
    def measure_checked():
        OrthrosConfig.from_name(args.model)  # a clear error for unknown names before any work
        return measure(args)

    render(result_from(args, args.tag, measure_checked), args.out_dir, args.docs, args.tag, table, plot)
    return 0
