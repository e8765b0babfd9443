"""`orthros bench prefill`: time to first-token logits against prompt length.

For each model shape and prompt length, in one run:
    orthros — the Orthros model: SWA base stream, one output query (prefill).
    full    — the same code with `attention="full"` (causal SDPA, cuDNN first).
    hf      — transformers' own LlamaForCausalLM / Qwen3ForCausalLM, SDPA.
    floor   — the Orthros model with attention removed: its linear work alone.
Weights are random (no downloads). Each row is warmed up on the model cut to
two layers at the same shapes (kernel compilation, cuDNN plans), then timed
once with the whole model; peak memory is the allocator's high-water mark.
Orthros and the floor prefill prompts longer than --chunk-size in chunks
(the SPEC's chunked prefill; it bounds activation memory at 512K); full
attention from --full-chunk-from on too (unchunked, 512K runs out of memory
on one H200; its later chunks are two cuDNN calls merged by log-sum-exp). Full
attention past --max-quadratic and transformers past --max-hf are skipped
(quadratic time); the table then shows an estimate, marked as such.
"""

from __future__ import annotations

import shlex
import sys

import torch

from ..errors import CountError, check_count, count_arg
from ..generate import prefill
from ..models import OrthrosConfig
from .common import (DTYPES, add_docs_argument, add_run_arguments, attention_removed, build_hf_peer, build_model,
                     environment, free_memory, is_oom, kernel_profile, log_panel, render, result_from, save_figure,
                     subplots, timed, truncated)

VARIANTS = ("orthros", "full", "hf", "floor")


def parse_len(text: str) -> int:
    s = str(text).strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise CountError(f"not a length: {text!r} (use e.g. 8192, 32K, 1M)") from None
    return check_count(n, 1)


def add_arguments(p):
    p.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b"], help="config names (shapes)")
    p.add_argument("--lengths", nargs="+", type=parse_len, default=[parse_len(x) for x in ("8K", "32K", "128K", "256K", "512K")])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--window", type=count_arg(1), default=128, help="Orthros window size")
    p.add_argument("--chunk-size", type=parse_len, default=parse_len("128K"), help="prefill chunk for orthros/floor")
    p.add_argument("--full-chunk-from", type=parse_len, default=parse_len("512K"),
                   help="full attention prefills prompts this long or longer in --chunk-size chunks")
    p.add_argument("--max-quadratic", type=parse_len, default=parse_len("256K"),
                   help="longest prompt timed for full (longer ones are estimated)")
    p.add_argument("--max-hf", type=parse_len, default=parse_len("128K"),
                   help="longest prompt timed for transformers (longer ones are estimated)")
    add_run_arguments(p)
    p.add_argument("--profile", type=parse_len, default=None, help="also break the Orthros prefill down by kernel at this length")
    p.add_argument("--out-dir", default="benchmarks/results/prefill", help="where prefill.json / prefill.png / prefill.md go")
    add_docs_argument(p, "docs/performance.md")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="only re-render the plot and table from a saved prefill.json (several: one table)")


# ------------------------------------------------------------------ measure
def _config(name, variant, args, T_max):
    over = dict(window_size=args.window, attention="full" if variant == "full" else "orthros", attn_backend="auto")
    if args.layers:
        over["num_hidden_layers"] = args.layers
    cfg = OrthrosConfig.from_name(name, **over)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, T_max)
    return cfg


def _chunk(variant, T, args):
    """The prefill chunk of one row (None: the whole prompt at once)."""
    if variant in ("orthros", "floor") and T > args.chunk_size:
        return args.chunk_size
    if variant == "full" and T >= args.full_chunk_from and T > args.chunk_size:
        return args.chunk_size
    return None


def _call(variant, model, ids, chunk):
    with torch.inference_mode():
        if variant == "hf":
            return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1]
        return prefill(model, ids, None, chunk_size=chunk)[0]


def measure(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    rows, breakdown = [], None
    T_max = max(args.lengths)
    for name in args.models:
        for variant in args.variants:
            cfg = _config(name, variant, args, T_max)
            model = build_hf_peer(cfg, device, dtype) if variant == "hf" else build_model(cfg, device, dtype)
            for T in sorted(args.lengths):
                chunk = _chunk(variant, T, args)
                row = dict(model=name, variant=variant, T=T, layers=cfg.num_hidden_layers, chunk=chunk)
                limit = {"full": args.max_quadratic, "hf": args.max_hf}.get(variant)
                if limit is not None and T > limit:
                    rows.append({**row, "status": "skipped", "note": f"quadratic time: longer than {limit}"})
                    continue
                ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
                removed = attention_removed() if variant == "floor" else _null()
                try:
                    with removed:
                        with truncated(model, min(2, cfg.num_hidden_layers)):
                            _call(variant, model, ids, chunk)
                        dt, peak, logits = timed(lambda m=model: _call(variant, m, ids, chunk), device)
                    if not torch.isfinite(logits.float()).all():
                        raise RuntimeError(f"non-finite logits: {name} {variant} T={T}")
                    rows.append({**row, "status": "ok", "time_s": dt, "peak_gib": peak})
                except Exception as e:  # noqa: BLE001 - OOM is a result, anything else is re-raised
                    if not is_oom(e):
                        raise
                    rows.append({**row, "status": "oom", "note": str(e).splitlines()[0][:120]})
                free_memory()
                r = rows[-1]
                print(f"{name:>14} {variant:>8} T={T:>8}  " + (f"{r['time_s']:8.3f} s  {r['peak_gib']:6.1f} GiB"
                      if r["status"] == "ok" else r["status"]), flush=True)
            if variant == "orthros" and args.profile and breakdown is None:
                breakdown = profile_prefill(model, args.profile, args.chunk_size, device)
                breakdown["model"] = name
            del model
            free_memory()
    return dict(env=environment(device), command="orthros bench prefill " + " ".join(map(shlex.quote, sys.argv[3:])),
                dtype=args.dtype, window=args.window, chunk_size=args.chunk_size, rows=rows, breakdown=breakdown)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def profile_prefill(model, T, chunk, device) -> dict:
    """Device time of one Orthros prefill by kernel group."""
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    chunk = chunk if T > chunk else None
    _call("orthros", model, ids, chunk)
    return {"T": T, **kernel_profile(lambda: _call("orthros", model, ids, chunk), device)}


# ------------------------------------------------------------------- render
def _index(rows):
    return {(r["model"], r["variant"], r["T"]): r for r in rows}


def estimates(rows) -> dict:
    """Quadratic-attention rows that were skipped: floor(T) + attention(T_ref) * (T / T_ref)^2,
    with attention(T_ref) = variant(T_ref) - floor(T_ref) at the longest timed length."""
    idx, est = _index(rows), {}
    for r in rows:
        if r["status"] != "skipped":
            continue
        m, v, T = r["model"], r["variant"], r["T"]
        timed_T = [t for (mm, vv, t), x in idx.items() if mm == m and vv == v and x["status"] == "ok"]
        floor = idx.get((m, "floor", T))
        if not timed_T or not floor or floor["status"] != "ok":
            continue
        ref = max(timed_T)
        fref = idx.get((m, "floor", ref))
        if not fref or fref["status"] != "ok":
            continue
        attn = idx[(m, v, ref)]["time_s"] - fref["time_s"]
        est[(m, v, T)] = floor["time_s"] + attn * (T / ref) ** 2
    return est


def _fmt_len(T):
    if T % 1024:
        return str(T)
    return f"{T // 1024}K" if T % (1024 * 1024) else f"{T // (1024 * 1024)}M"


def table(result) -> str:
    rows, env = result["rows"], result["env"]
    idx, est = _index(rows), estimates(rows)

    def time_of(m, v, T):
        r = idx.get((m, v, T))
        if r and r["status"] == "ok":
            return r["time_s"], False
        if (m, v, T) in est:
            return est[(m, v, T)], True
        return None, False

    def cell(m, v, T):
        r = idx.get((m, v, T))
        if r is None:
            return "–"
        if r["status"] == "ok":
            mark = "†" if v == "full" and r.get("chunk") else ""
            return f"{r['time_s']:.2f} s{mark} ({r['peak_gib']:.0f} GiB)"
        t, _ = time_of(m, v, T)
        return f"~{t:.0f} s est. ({r['status']})" if t is not None else r["status"]

    def ratio(a, b):
        (x, ex), (y, ey) = a, b
        if x is None or y is None:
            return "–"
        return f"{'~' if ex or ey else ''}{x / y:.2f}×"

    out = [f"Command: `{result['command']}`  ",
           f"Date: {env['date']}; GPU: {env['gpu']}; torch {env['torch']}, transformers {env['transformers']}"
           f"{', triton ' + env['triton'] if 'triton' in env else ''}; {result['dtype']}, batch 1, window {result['window']}, "
           f"Orthros chunk {_fmt_len(result['chunk_size'])}.", ""]
    for m in dict.fromkeys(r["model"] for r in rows):
        Ts = sorted({r["T"] for r in rows if r["model"] == m})
        layers = next(r["layers"] for r in rows if r["model"] == m)
        out += [f"**{m}** ({layers} layers): time to first-token logits (peak memory)", "",
                "| prompt | Orthros | linear floor | full (same code) | HF transformers | Orthros / floor | full / Orthros | HF / Orthros |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for T in Ts:
            o, f, fu, hf = (time_of(m, v, T) for v in VARIANTS[:1] + ("floor", "full", "hf"))
            out.append(f"| {_fmt_len(T)} | {cell(m, 'orthros', T)} | {cell(m, 'floor', T)} | {cell(m, 'full', T)} | "
                       f"{cell(m, 'hf', T)} | {ratio(o, f)} | {ratio(fu, o)} | {ratio(hf, o)} |")
        out.append("")
    chunked = sorted({r["chunk"] for r in rows if r["variant"] == "full" and r["status"] == "ok" and r.get("chunk")})
    if chunked:
        out.append(f"†: full attention prefilled in {'/'.join(map(_fmt_len, chunked))} chunks (unchunked, the prompt "
                   "does not fit); each later chunk is two cuDNN calls (past keys, causal block) merged by log-sum-exp.")
        out.append("")
    if est:
        out.append("`est.`: not timed (quadratic); floor(T) + (time − floor) at the longest timed length × (T / that length)².")
        out.append("")
    b = result.get("breakdown")
    if b:
        tot = sum(b["groups_ms"].values())
        out += [f"Orthros prefill at {_fmt_len(b['T'])} ({b['model']}), device time by kernel group (profiler):", "",
                "| kernels | ms | share |", "| --- | --- | --- |"]
        out += [f"| {g} | {t:.1f} | {100 * t / tot:.1f}% |" for g, t in b["groups_ms"].items()]
        out.append("")
    return "\n".join(out)


def plot(result, path):
    rows = result["rows"]
    est = estimates(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = subplots(len(models), 6, 4.5)
    style = {"orthros": ("C0", "o"), "floor": ("k", "."), "full": ("C3", "s"), "hf": ("C1", "^")}
    label = {"orthros": "Orthros", "floor": "linear floor", "full": "full attention (same code)", "hf": "HF transformers (SDPA)"}
    for ax, m in zip(axes, models):
        for v in VARIANTS:
            pts = sorted((r["T"], r["time_s"]) for r in rows if r["model"] == m and r["variant"] == v and r["status"] == "ok")
            if not pts:
                continue
            c, mk = style[v]
            ax.plot(*zip(*pts), marker=mk, color=c, label=label[v], linestyle="--" if v == "floor" else "-")
            ex = sorted((T, t) for (mm, vv, T), t in est.items() if mm == m and vv == v)
            if ex:
                ax.plot([pts[-1][0]] + [e[0] for e in ex], [pts[-1][1]] + [e[1] for e in ex], color=c, linestyle=":",
                        marker=mk, markerfacecolor="none")
        log_panel(ax, "prompt length (tokens)", "time to first-token logits (s)", f"{m}, {result['env']['gpu']}",
                  log_y=True)
    save_figure(fig, path)


def run(args):
    def measure_checked():
        for m in args.models:
            OrthrosConfig.from_name(m)  # a clear error for unknown names before any work
        return measure(args)

    result = result_from(args, "prefill", measure_checked, key=lambda r: (r["model"], r["variant"], r["T"]))
    render(result, args.out_dir, args.docs, "prefill", table, plot)
    return 0
