"""`orthros bench e2e`: time to first token and end-to-end time, Orthros vs full attention.

The paper's settings (prompt / new tokens): 128K/128, 127K/1K, 120K/8K, at
batch 2 (a setting that runs out of memory is retried at batch 1, and the
table says so). Both models use the same fast path: eager chunked prefill
into a preallocated cache, then the compiled decode step. Weights and
prompts are random.

    TTFT   — the prefill, timed once after an identical untimed one (kernel
             compilation, first use of the memory), including the first token's
             sampling.
    decode — the remaining n-1 steps. The first --warmup steps compile and
             capture the step; they are counted at the mean timed step time.
             Outputs longer than --max-timed-steps are timed over their first
             and last max/2 steps (the cache is advanced in between with
             random K/V) and the sum is interpolated linearly (step time is
             linear in the context); the table marks such rows.

`--kv-dtype fp8 --settings 1M/32 --batch 1 --variants orthros --tag million`
is the one-GPU million-token run. `--agreement` instead compares an fp8 (or --kv-dtype) cache with
a full-precision one on one model: greedy generation with the latter, the
same tokens teacher-forced through the former (top-1 agreement, logit
differences).
"""

from __future__ import annotations

import shlex
import sys

import torch

from ..errors import count_arg
from ..generate import (auto_chunk_size, compiled_decode_step, decode_one_token_fast, fast_decode_step,
                        new_static_cache, prefill)
from ..models import OrthrosConfig
from ..models.static_cache import KV_DTYPES, LOWBIT_KV_DTYPES
from .common import (DTYPES, add_docs_argument, add_run_arguments, build_model, environment, free_memory, is_oom, now,
                     render, result_from, save_figure, subplots, sync, variant_config)
from .decode import cache_bytes, random_slots
from .prefill import _fmt_len, parse_len

VARIANTS = ("orthros", "full")


def parse_setting(s: str) -> tuple[int, int]:
    try:
        a, b = s.split("/")
    except ValueError:
        raise ValueError(f"a setting is PROMPT/NEW, e.g. 128K/128; got {s!r}") from None
    return parse_len(a), parse_len(b)


def add_arguments(p):
    p.add_argument("--model", default="llama-3.1-8b", help="config name (shape)")
    p.add_argument("--settings", nargs="+", type=parse_setting,
                   default=[parse_setting(s) for s in ("128K/128", "127K/1K", "120K/8K")], help="PROMPT/NEW pairs")
    p.add_argument("--batch", type=count_arg(1), default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--window", type=count_arg(1), default=128, help="Orthros window size")
    p.add_argument("--chunk-size", type=parse_len, default=None,
                   help="prefill chunk (default: 128K)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--warmup", type=count_arg(0), default=3, help="decode steps that compile / capture (untimed)")
    p.add_argument("--max-timed-steps", type=count_arg(2), default=1024, help="longer outputs are timed at both ends")
    add_run_arguments(p, compile=True)
    p.add_argument("--agreement", action="store_true",
                   help="--kv-dtype (default fp8) vs a full-precision cache on one model: prompt/new from the first setting")
    p.add_argument("--checkpoint", default=None, help="--agreement: a saved Orthros model directory (default: random weights)")
    p.add_argument("--tag", default="e2e", help="output files <tag>.json / .md / .png; table between <!-- <tag>-table --> marks")
    p.add_argument("--out-dir", default="benchmarks/results/e2e")
    add_docs_argument(p, "docs/performance.md")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="only re-render the plot and table from a saved JSON (several: one table)")


# ------------------------------------------------------------------ measure
def advance_random(cache, new_length: int, seed: int = 1) -> None:
    """Move a cache forward to `new_length` slots with random K/V (untimed filler)."""
    a = cache.length
    g = torch.Generator(device=cache.doc.device).manual_seed(seed)
    random_slots(cache, a, new_length, g)
    cache.doc[:, a:new_length] = cache.last_doc.clamp_min(0)[:, None]
    cache.next_pos += new_length - a
    cache.slot += new_length - a
    cache.length = new_length


def _steps(model, tok, cache, n, step_fn):
    for _ in range(n):
        tok = decode_one_token_fast(model, tok, cache, step_fn).argmax(-1)
    return tok


def run_setting(model, B, T_in, n_out, args, step_fn, device) -> dict:
    cfg = model.config
    # One chunk up to 128K (it fits at batch 2): a later chunk of the full model would run its
    # causal attention over a key prefix through FlexAttention instead of cuDNN, which
    # would flatter Orthros.
    chunk = args.chunk_size or parse_len("128K")
    ids = torch.randint(0, cfg.vocab_size, (B, T_in), device=device)
    free_memory()
    cache = new_static_cache(model, B, T_in + n_out, args.kv_dtype)
    # Warm-up: the same prefill, whole model, same cache. A warm-up on a two-layer cut left
    # seconds of one-time work (compilation, first use of the memory) inside the timed
    # prefill on a fresh machine.
    prefill(model, ids, None, cache=cache, chunk_size=chunk)
    cache.reset()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = now(device)
    logits, _ = prefill(model, ids, None, cache=cache, chunk_size=chunk)
    tok = logits.argmax(-1)
    ttft = now(device) - t0
    if not torch.isfinite(logits.float()).all():
        raise RuntimeError(f"non-finite logits after prefill (T={T_in})")
    n_dec = n_out - 1
    w = min(args.warmup, n_dec)
    tok = _steps(model, tok, cache, w, step_fn)
    rest = n_dec - w
    extrapolated = rest > args.max_timed_steps
    if not extrapolated:
        t0 = now(device)
        tok = _steps(model, tok, cache, rest, step_fn)
        step = (now(device) - t0) / max(rest, 1)
        steps_timed = rest
    else:
        m = args.max_timed_steps // 2
        t0 = now(device)
        tok = _steps(model, tok, cache, m, step_fn)
        t_a = (now(device) - t0) / m
        advance_random(cache, T_in + n_out - 1 - m)
        t0 = now(device)
        tok = _steps(model, tok, cache, m, step_fn)
        t_b = (now(device) - t0) / m
        step = (t_a + t_b) / 2
        steps_timed = 2 * m
    decode = step * n_dec
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return dict(status="ok", ttft_s=ttft, decode_s=decode, e2e_s=ttft + decode, step_s=step,
                decode_tok_s=B / step if n_dec else float("nan"), steps_timed=steps_timed,
                extrapolated=extrapolated, chunk=chunk, peak_gib=peak,
                cache_gib=cache_bytes(cache) / 2**30)


def measure(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    step_fn = fast_decode_step if args.no_compile else compiled_decode_step()
    T_max = max(a + b for a, b in args.settings)
    rows = []
    for variant in args.variants:
        cfg = variant_config(args, variant, T_max)
        model = build_model(cfg, device, dtype)
        for T_in, n_out in args.settings:
            row = dict(variant=variant, T_in=T_in, n_out=n_out, layers=cfg.num_hidden_layers)
            for B in dict.fromkeys([args.batch, 1]):
                try:
                    with torch.inference_mode():
                        rows.append({**row, "batch": B, **run_setting(model, B, T_in, n_out, args, step_fn, device)})
                    break
                except Exception as e:  # noqa: BLE001 - OOM is a result (retried at batch 1)
                    if not is_oom(e):
                        raise
                    rows.append({**row, "batch": B, "status": "oom", "note": str(e).splitlines()[0][:120]})
                    free_memory()
            free_memory()
            r = rows[-1]
            print(f"{variant:>8} {_fmt_len(T_in)}/{_fmt_len(n_out)} B={r['batch']}  " + (
                f"TTFT {r['ttft_s']:.2f} s  decode {r['decode_s']:.2f} s ({r['decode_tok_s']:.1f} tok/s)  "
                f"e2e {r['e2e_s']:.2f} s  peak {r['peak_gib']:.1f} GiB" if r["status"] == "ok" else r["status"]),
                flush=True)
        del model
        free_memory()
    return dict(env=environment(device), command="orthros bench e2e " + " ".join(map(shlex.quote, sys.argv[3:])),
                model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, window=args.window,
                compiled=not args.no_compile, rows=rows)


def agreement(args) -> dict:
    """A quantized KV cache (--kv-dtype; fp8 if auto) vs a full-precision one: greedy tokens from the
    latter, teacher-forced through the former."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    if args.checkpoint:
        from ..loading import load_model

        model = load_model(args.checkpoint).to(device=device, dtype=dtype).eval()
        name = args.checkpoint
    else:
        over = dict(window_size=args.window)
        if args.layers:
            over["num_hidden_layers"] = args.layers
        torch.manual_seed(0)
        model = build_model(OrthrosConfig.from_name(args.model, **over), device, dtype)
        name = f"{args.model} (random weights)"
    T_in, n_out = args.settings[0]
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, T_in + n_out)
    ids = torch.randint(0, model.config.vocab_size, (1, T_in), device=device)
    step_fn = fast_decode_step if args.no_compile else compiled_decode_step()
    chunk = args.chunk_size or auto_chunk_size(model.config, 1, dtype)
    out = {}
    with torch.inference_mode():
        quant = "fp8" if args.kv_dtype == "auto" else args.kv_dtype
        for kv in ("auto", quant):
            cache = new_static_cache(model, 1, T_in + n_out, kv)
            logits, _ = prefill(model, ids, None, cache=cache, chunk_size=chunk)
            seq, tok = [logits], None
            for i in range(n_out - 1):
                tok = out["auto"][1][i: i + 1] if kv == quant else seq[-1].argmax(-1)
                seq.append(decode_one_token_fast(model, tok, cache, step_fn))
            lg = torch.cat(seq).float()
            out[kv] = (lg, lg.argmax(-1))
            del cache
    ref, q = out["auto"][0], out[quant][0]
    return dict(env=environment(device), command="orthros bench e2e " + " ".join(map(shlex.quote, sys.argv[3:])),
                model=name, dtype=args.dtype, window=model.config.window_size, T_in=T_in, n_out=n_out,
                top1_agreement=(out["auto"][1] == out[quant][1]).float().mean().item(), kv_dtype=quant,
                max_abs_logit_diff=(ref - q).abs().max().item(), logit_range=(ref.max() - ref.min()).item(),
                rel_rms_err=((ref - q).norm() / ref.norm()).item())


# ------------------------------------------------------------------- render
def table(result) -> str:
    if "top1_agreement" in result:
        return agreement_table(result)
    rows, env = result["rows"], result["env"]
    idx = {(r["variant"], r["T_in"], r["n_out"]): r for r in rows}  # the last row (after a retry) wins
    layers = rows[0]["layers"] if rows else "?"
    out = [f"Command: `{result['command']}`  ",
           f"Date: {env['date']}; GPU: {env['gpu']}; torch {env['torch']}{', triton ' + env['triton'] if 'triton' in env else ''}; "
           f"{result['model']} shape ({layers} layers), random {result['dtype']} weights and prompts, "
           f"KV cache {result['kv_dtype']}, window {result['window']}, decode "
           f"{'compiled (CUDA graphs)' if result['compiled'] else 'eager'}.", "",
           "| prompt / new | batch | TTFT Orthros | TTFT full | TTFT full / Orthros | end-to-end Orthros | "
           "end-to-end full | e2e full / Orthros | decode tok/s Orthros / full | peak GiB Orthros / full |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = set()

    def get(r, k, fmt):
        return "–" if r is None else (fmt.format(r[k]) if r["status"] == "ok" else r["status"])

    for key in dict.fromkeys((r["T_in"], r["n_out"]) for r in rows):
        o, f = idx.get(("orthros", *key)), idx.get(("full", *key))
        ok = o and f and o["status"] == f["status"] == "ok"
        batch = "/".join(str(b) for b in dict.fromkeys(r["batch"] for r in (o, f) if r))
        if any(r and r["batch"] != max(x["batch"] for x in rows) for r in (o, f)):
            notes.add("Batch 1 where the larger batch ran out of memory.")
        ext = any(r and r.get("extrapolated") for r in (o, f))
        if ext:
            notes.add("†: decode timed over its first and last steps only, the rest interpolated linearly.")
        ttft_ratio = f"{f['ttft_s'] / o['ttft_s']:.2f}×" if ok else "–"
        e2e_ratio = f"{f['e2e_s'] / o['e2e_s']:.2f}×" if ok else "–"
        out.append(
            f"| {_fmt_len(key[0])} / {_fmt_len(key[1])}{' †' if ext else ''} | {batch} | {get(o, 'ttft_s', '{:.2f} s')} | "
            f"{get(f, 'ttft_s', '{:.2f} s')} | {ttft_ratio} | {get(o, 'e2e_s', '{:.2f} s')} | "
            f"{get(f, 'e2e_s', '{:.2f} s')} | {e2e_ratio} | "
            f"{get(o, 'decode_tok_s', '{:.1f}')} / {get(f, 'decode_tok_s', '{:.1f}')} | "
            f"{get(o, 'peak_gib', '{:.0f}')} / {get(f, 'peak_gib', '{:.0f}')} |")
    out.append("")
    out += sorted(notes)
    out.append("Decode: the first steps (compilation, graph capture) are counted at the mean timed step time.")
    return "\n".join(out) + "\n"


def agreement_table(r) -> str:
    env = r["env"]
    return "\n".join([
        f"Command: `{r['command']}`  ",
        f"Date: {env['date']}; device: {env['gpu']}; torch {env['torch']}; model {r['model']}, {r['dtype']}, "
        f"window {r['window']}; prompt {_fmt_len(r['T_in'])} random tokens, {r['n_out']} greedy tokens from the "
        f"{r['dtype']} cache, teacher-forced through the {r.get('kv_dtype', 'fp8')} cache.", "",
        "| top-1 agreement | max abs logit difference | logit range | relative RMS logit error |",
        "| --- | --- | --- | --- |",
        f"| {100 * r['top1_agreement']:.2f}% | {r['max_abs_logit_diff']:.4f} | {r['logit_range']:.2f} | "
        f"{r['rel_rms_err']:.2e} |", ""])


def plot(result, path):
    fig, (ax,) = subplots(1, 7, 4.2)
    if "top1_agreement" in result:
        ax.text(0.5, 0.5, f"top-1 agreement {100 * result['top1_agreement']:.2f}%", ha="center")
    else:
        rows = [r for r in result["rows"] if r["status"] == "ok"]
        keys = list(dict.fromkeys((r["T_in"], r["n_out"]) for r in rows))
        for i, key in enumerate(keys):
            for j, (v, c) in enumerate((("orthros", "C0"), ("full", "C3"))):
                r = next((r for r in rows if r["variant"] == v and (r["T_in"], r["n_out"]) == key), None)
                if r is None:
                    continue
                x = i + (j - 0.5) * 0.38
                ax.bar(x, r["ttft_s"], 0.36, color=c, label=f"{v}: TTFT" if i == 0 else None)
                ax.bar(x, r["decode_s"], 0.36, bottom=r["ttft_s"], color=c, alpha=0.45,
                       label=f"{v}: decode" if i == 0 else None)
        ax.set_xticks(range(len(keys)), [f"{_fmt_len(a)} / {_fmt_len(b)}" for a, b in keys])
        ax.set_xlabel("prompt / new tokens")
        ax.set_ylabel("seconds (TTFT + decode = end-to-end)")
        ax.legend(fontsize=8)
    ax.set_title(f"{result['model']}, {result['env']['gpu']}")
    save_figure(fig, path)


def run(args):
    def measure_checked():
        OrthrosConfig.from_name(args.model)  # a clear error for unknown names before any work
        if args.kv_dtype in LOWBIT_KV_DTYPES and "full" in args.variants and not args.agreement:
            raise ValueError(f"--kv-dtype {args.kv_dtype} is an Orthros cache (a full model's queries read every "
                             "key in bf16): add --variants orthros")
        return agreement(args) if args.agreement else measure(args)

    render(result_from(args, args.tag, measure_checked), args.out_dir, args.docs, args.tag, table, plot)
    return 0
