"""`orthros bench decode`: decode tokens/s against context length, Orthros vs full attention.

Both models run the same fast path (`orthros.generate`): a preallocated KV
cache, the sync-free decode step compiled with mode="reduce-overhead" (one
CUDA graph per step). Weights are random. To save GPU time the KV cache is
filled with random values up to the context length instead of a real
prefill (decode cost does not depend on what the cache holds); the table
says so. Each row: warm-up steps (compilation, graph capture), then
--steps steps timed with device events; the row also records how long the
cache fill and the warm-up took (stderr says so as each phase ends), and
the rows so far are saved as they finish (<tag>.partial.json: a run cut by
a time limit keeps them; `--from-json` renders it).

Achieved bandwidth counts the bytes a step must read: every weight once
(the embedding table excepted: one row is gathered) plus the K/V each
query reads (the output query: the whole context; an Orthros base query:
its window), against the copy bandwidth given by --bandwidth. With
`--kv-dtype int4|int2` (Orthros only) the output query reads the low-bit
slots at their packed size (scales included) and the bf16 sinks and window
at 2 bytes. `--profile` also gives each kernel group's achieved bandwidth:
the attention kernels against the K/V bytes, the GEMMs against the weights.
"""

from __future__ import annotations

import shlex
import sys
import time

import torch

from ..errors import count_arg
from ..generate import compiled_decode_step, decode_one_token_fast, fast_decode_step, new_static_cache
from ..models import OrthrosConfig
from ..models.lowbit_cache import LowBitStaticCache
from ..models.static_cache import FP8, KV_DTYPES, LOWBIT_KV_DTYPES
from .common import (DTYPES, add_docs_argument, add_run_arguments, build_model, copy_bandwidth, environment,
                     free_memory, is_oom, kernel_profile, log_panel, now, progress, render, result_from, save_figure,
                     save_partial, subplots, sync, variant_config)
from .prefill import _fmt_len, parse_len

VARIANTS = ("orthros", "full", "orthros-bound", "orthros-base")
"""orthros-bound / orthros-base: a mixture-of-experts model's output rows routed by their base row
(docs/moe.md); plain "orthros" routes them independently."""


def add_arguments(p):
    p.add_argument("--model", default="llama-3.1-8b", help="config name (shape)")
    p.add_argument("--contexts", nargs="+", type=parse_len, default=[parse_len(x) for x in ("4K", "32K", "128K")])
    p.add_argument("--batches", nargs="+", type=count_arg(1), default=[1, 2])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["orthros", "full"])
    p.add_argument("--window", type=count_arg(1), default=128, help="Orthros window size")
    p.add_argument("--steps", type=count_arg(1), default=100, help="timed decode steps per row")
    p.add_argument("--warmup", type=count_arg(0), default=5, help="untimed steps first (compilation, graph capture)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--profile", action="store_true", help="also break one row per variant down by kernel")
    add_run_arguments(p, compile=True, bandwidth=True)
    p.add_argument("--out-dir", default="benchmarks/results/decode", help="where <tag>.json / <tag>.png / <tag>.md go")
    add_docs_argument(p, "docs/performance.md")
    p.add_argument("--tag", default="decode",
                   help="output files <tag>.json / .md / .png; table between <!-- <tag>-table --> marks")
    p.add_argument("--from-json", nargs="+", default=None,
                   help="only re-render the plot and table from a saved decode.json (several: one table)")


def _fill(buf, a: int, b: int, g, kind: str) -> None:
    """Slots [a, b) of buf [B, S, ...]: unit normal ("normal") or random bytes ("bytes"), in slices."""
    for i in range(a, b, 1 << 15):  # bounded temporary memory
        x = buf[:, i: min(b, i + (1 << 15))]
        if kind == "bytes":
            x.copy_(torch.randint(0, 256, x.shape, generator=g, device=x.device, dtype=torch.uint8))
            continue
        r = torch.randn(x.shape, generator=g, device=x.device, dtype=torch.float32)
        x.copy_(r.clamp(-448, 448).to(buf.dtype) if buf.dtype == FP8 else r.to(buf.dtype))


def random_slots(cache, a: int, b: int, g) -> None:
    """Random K/V in slots [a, b) of every layer: unit normal (fp8 at scale 1); low-bit: random
    levels spanning [-1, 1] (every key group from a // key_group on), unit-normal sinks and ring."""
    if isinstance(cache, LowBitStaticCache):
        kg = cache.key_group
        for i in range(cache.num_layers):
            for buf in (cache.kq[i], cache.vq[i]):
                _fill(buf, a, b, g, "bytes")
            cache.k_scale[i][:, a // kg:].fill_(2.0 / (2**cache.layer_key_bits[i] - 1))
            cache.k_zero[i][:, a // kg:].fill_(-1.0)
            cache.v_scale[i][:, a:b].fill_(2.0 / (2**cache.value_bits - 1))
            cache.v_zero[i][:, a:b].fill_(-1.0)
            for buf in (cache.rk[i], cache.rv[i], cache.sk[i], cache.sv[i]):
                _fill(buf, 0, buf.shape[1], g, "normal")
        return
    for buf in (*cache.k, *cache.v):
        _fill(buf, a, b, g, "normal")
    cache.k_scale.fill_(1.0)
    cache.v_scale.fill_(1.0)
    cache._scaled = [True] * cache.num_layers


def fill_random(cache, context: int, seed: int = 0) -> None:
    """Pretend `context` tokens of one document were prefilled: random K/V (`random_slots`),
    document 0, positions 0..context-1. No real prefill is run."""
    g = torch.Generator(device=cache.doc.device).manual_seed(seed)
    random_slots(cache, 0, context, g)
    cache.doc[:, :context] = 0
    cache.length = context
    cache.slot.fill_(context)
    cache.next_pos.fill_(context)
    cache.last_doc.fill_(0)


def weight_bytes(model, experts_read: float | None = None) -> int:
    """Bytes of the weights one decode step reads (the embedding table excepted: one row is gathered).
    A mixture-of-experts model reads only the experts its rows chose: `experts_read` (the mean number
    a sparse layer read, `experts_per_step`) of each sparse layer's experts."""
    from ..layers.moe import SparseMoE

    emb = model.model.embed_tokens.weight
    experts = {id(p) for m in model.modules() if isinstance(m, SparseMoE) for p in m.experts.parameters()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb and id(p) not in experts)
    if model.lm_head.weight is emb:  # tied: the LM head still reads the whole table
        weights += emb.numel() * emb.element_size()
    return weights + expert_bytes(model, experts_read)


def expert_bytes(model, experts_read: float | None = None) -> int:
    """Bytes of `experts_read` experts (default: all) in every sparse layer; 0 for a dense model."""
    from ..layers.moe import SparseMoE

    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return 0
    one = sum(p.numel() * p.element_size() for p in moes[0].experts[0].parameters())
    n = len(moes[0].experts) if experts_read is None else experts_read
    return int(len(moes) * n * one)


def experts_per_step(model, cache, batch: int, step_fn) -> float | None:
    """The mean number of distinct experts a sparse layer reads in one decode step (the union over
    the step's rows: a pair's two rows, every sequence of the batch), from one more step's routing;
    None for a dense model."""
    from ..layers.moe import SparseMoE

    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return None
    seen = {id(m): set() for m in moes}

    def hook(m, args):
        r = args[1] if len(args) > 1 else None
        chosen = r.experts if r is not None else m.route(args[0]).experts
        seen[id(m)].update(chosen.unique().tolist())

    handles = [m.register_forward_pre_hook(hook) for m in moes]
    try:
        tok = torch.zeros(batch, dtype=torch.long, device=next(model.parameters()).device)
        decode_one_token_fast(model, tok, cache, step_fn)
    finally:
        for h in handles:
            h.remove()
    return sum(len(v) for v in seen.values()) / len(moes)


def kv_read_bytes(model, cache, batch: int, context: int) -> float:
    """Bytes of K/V one decode step's attention reads over all layers, at `context` slots."""
    c = model.config
    L = c.num_hidden_layers
    if isinstance(cache, LowBitStaticCache):
        hi = 2 * c.num_key_value_heads * c.head_dim * torch.finfo(cache.hi).bits // 8
        low = max(0, cache.bound_at(context) - cache.sinks)  # slots read from the packed storage
        out = low * cache.slot_bytes() + (context - low) * hi
    else:
        hi = 2 * c.num_key_value_heads * c.head_dim * cache.storage.itemsize
        out = context * hi  # the output query (full: the token's query) reads every key
    base = (L - 1) * min(c.window_size, context) * hi if c.attention == "orthros" else 0  # last layer skipped
    return batch * (L * out + base)


def step_bytes(model, cache, batch: int, context: int, experts_read: float | None = None) -> int:
    """Bytes one decode step must read: weights (a MoE's chosen experts only) + K/V."""
    return int(weight_bytes(model, experts_read) + kv_read_bytes(model, cache, batch, context))


def group_bandwidth(profile: dict, model, cache, batch: int, context: int, experts_read: float | None = None) -> dict:
    """Achieved GB/s of the attention kernels (K/V bytes), the GEMMs (the weights outside the experts)
    and the fused MoE kernels (the bytes of the `experts_read` experts a sparse layer read) in a profile."""
    steps, g = profile["steps"], profile["groups_ms"]
    out = {}
    for group, nbytes in (("split-KV attention", kv_read_bytes(model, cache, batch, context)),
                          ("GEMM (linear layers)", weight_bytes(model, experts_read=0)),
                          ("fused MoE experts", expert_bytes(model, experts_read) if experts_read else 0)):
        if g.get(group) and nbytes:
            out[group] = nbytes * steps / (g[group] / 1e3) / 1e9
    return out


def cache_bytes(cache) -> int:
    """Bytes of the cache's K/V storage (all layers; scales, sinks and ring included)."""
    if isinstance(cache, LowBitStaticCache):
        return cache.memory_bytes
    return 2 * cache.num_layers * cache.k[0].numel() * cache.k[0].element_size()


def time_decode(model, cache, steps: int, warmup: int, step_fn, device) -> tuple[float, float]:
    """(seconds per decode step, mean over `steps` after `warmup`; seconds the warm-up took:
    compilation and graph capture on a first call); tokens fed back greedily."""
    B = cache.batch_size
    tok = torch.randint(0, model.config.vocab_size, (B,), device=device)
    t0 = now(device)
    for _ in range(warmup):
        tok = decode_one_token_fast(model, tok, cache, step_fn).argmax(-1)
    warm_s = now(device) - t0
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    for _ in range(steps):
        tok = decode_one_token_fast(model, tok, cache, step_fn).argmax(-1)
    if device.type == "cuda":
        end.record()
        sync(device)
        return start.elapsed_time(end) / 1e3 / steps, warm_s
    return (time.perf_counter() - t0) / steps, warm_s


class GraphedStep:
    """The eager decode step captured in one CUDA graph (for MoE models: compiled, a sparse layer
    would run every expert; eager, the fused MoE step reads only the chosen ones, but a step is
    then bound by its launches). Captured on its first call, after an eager run of the same
    step, whose logits the first replay must reproduce; if the capture fails or differs, the
    step stays eager (`self.note` says why)."""

    def __init__(self):
        self.graph, self.note, self.cache = None, None, None

    def reset(self) -> None:
        """Let go of the graph and the cache it writes (before the next cache is allocated)."""
        self.graph = self.out = self.token = self.cache = None

    def __call__(self, model, token, cache):
        if self.note is None and (self.graph is None or self.cache is not cache):
            self._capture(model, token, cache)
        if self.note is not None:
            return fast_decode_step(model, token, cache)
        self.token.copy_(token)
        self.graph.replay()
        return self.out

    def _capture(self, model, token, cache) -> None:
        # an eager run of this step on a side stream (the warm-up a capture asks for; its K/V written at
        # the cache's slot), then the capture and a replay, which write the same K/V at the same slot:
        # the replay must give the eager run's logits
        self.token, self.cache = token.clone(), cache
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager = fast_decode_step(model, self.token, cache).float()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fast_decode_step(model, self.token, cache)
            self.graph.replay()
            err = ((self.out.float() - eager).norm() / eager.norm().clamp_min(1e-30)).item()
        except Exception as e:  # noqa: BLE001 - the bench goes on eagerly, and says so
            self.graph, self.note = None, f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
            return
        if not err < 2e-2:
            self.graph, self.note = None, f"the captured step's logits differ from the eager step's (rel. err {err:.2e})"


def measure(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    if args.bandwidth is None:
        args.bandwidth = round(copy_bandwidth(device), 2)
        progress(f"copy bandwidth of {device.type}: {args.bandwidth} TB/s (the roofline; --bandwidth sets it)")
    compiled = None if args.no_compile else compiled_decode_step()

    def steps_for(cfg):
        if compiled is None:
            return fast_decode_step
        if cfg.num_experts:  # compiled, a sparse layer would run every expert (no host read of the routing)
            if device.type == "cuda":
                progress(f"{cfg.num_experts} experts: eager decode steps captured in a CUDA graph (the fused MoE "
                         "step reads only the chosen experts)")
                return GraphedStep()
            progress(f"{cfg.num_experts} experts: eager decode steps (the fused MoE step reads only the chosen ones)")
            return fast_decode_step
        return compiled

    rows, profiles = [], {}
    tok = torch.zeros(max(args.batches), dtype=torch.long, device=device)

    def result():
        return dict(env=environment(device), command="orthros bench decode " + " ".join(map(shlex.quote, sys.argv[3:])),
                    model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, window=args.window, steps=args.steps,
                    compiled=not args.no_compile, bandwidth_tb_s=args.bandwidth, rows=rows, profiles=profiles)

    for variant in args.variants:
        cfg = variant_config(args, variant, max(args.contexts) + args.steps + args.warmup + 1)
        progress(f"{variant}: building {args.model} (random {args.dtype} weights)")
        model = build_model(cfg, device, dtype)
        step_fn = steps_for(cfg)
        for B in args.batches:
            for C in sorted(args.contexts):
                row = dict(variant=variant, batch=B, context=C, layers=cfg.num_hidden_layers)
                what = f"{variant} B={B} ctx={_fmt_len(C)}"
                cache = None
                try:
                    t0 = now(device)
                    cache = new_static_cache(model, B, C + args.warmup + args.steps + 11, args.kv_dtype)
                    fill_random(cache, C)
                    fill_s = now(device) - t0
                    progress(f"{what}: {args.kv_dtype} cache filled in {fill_s:.1f} s; {args.warmup} warm-up steps "
                             "(compilation, graph capture)")
                    with torch.inference_mode():
                        dt, warm_s = time_decode(model, cache, args.steps, args.warmup, step_fn, device)
                        progress(f"{what}: warm-up took {warm_s:.1f} s; {args.steps} steps timed")
                        read = experts_per_step(model, cache, B, fast_decode_step)  # (hooks: not a replay)
                        if args.profile and variant not in profiles:
                            prof = {"batch": B, "context": C, "steps": 10, **kernel_profile(
                                lambda: [decode_one_token_fast(model, tok[:B], cache, step_fn) for _ in range(10)],
                                device, top=40)}
                            # K/V at the mid-run context
                            prof["gb_per_s"] = group_bandwidth(prof, model, cache, B, cache.length - 5, read)
                            profiles[variant] = prof
                    if isinstance(step_fn, GraphedStep):
                        row["step"] = "eager" if step_fn.note else "eager, CUDA graph"
                        if step_fn.note:
                            row["note"] = step_fn.note
                            progress(f"{what}: {step_fn.note}; timed eagerly")
                    nbytes = step_bytes(model, cache, B, C + args.warmup + args.steps // 2, read)
                    if read is not None:
                        row.update(experts_per_layer=read, expert_bytes=expert_bytes(model, read))
                    rows.append({**row, "status": "ok", "step_s": dt, "tokens_per_s": B / dt, "bytes": nbytes,
                                 "gb_per_s": nbytes / dt / 1e9, "roofline": nbytes / dt / (args.bandwidth * 1e12),
                                 "roofline_tok_s": B * args.bandwidth * 1e12 / nbytes,
                                 "cache_gib": cache_bytes(cache) / 2**30, "fill_s": fill_s, "warmup_s": warm_s})
                except Exception as e:  # noqa: BLE001 - OOM is a result, anything else is re-raised
                    if not is_oom(e):
                        raise
                    rows.append({**row, "status": "oom", "note": str(e).splitlines()[0][:120]})
                if isinstance(step_fn, GraphedStep):
                    step_fn.reset()
                del cache
                free_memory()
                save_partial(args.out_dir, args.tag, result())
                r = rows[-1]
                print(f"{variant:>8} B={B} ctx={_fmt_len(C):>6}  " + (
                    f"{r['step_s'] * 1e3:7.2f} ms/step {r['tokens_per_s']:8.1f} tok/s {r['gb_per_s']:7.0f} GB/s "
                    f"({100 * r['roofline']:.0f}% of roofline)" if r["status"] == "ok" else r["status"]), flush=True)
        del model
        free_memory()
    return result()


# ------------------------------------------------------------------- render
def _step_kind(result) -> str:
    kinds = {r.get("step") for r in result["rows"] if r.get("status") == "ok"} - {None}
    if kinds:  # MoE rows: eager steps, captured where the capture held (a row's note says why not)
        return " / ".join(sorted(kinds)) + " steps"
    return "compiled (CUDA graphs)" if result["compiled"] else "eager"


def table(result) -> str:
    rows, env = result["rows"], result["env"]
    idx = {(r["variant"], r["batch"], r["context"]): r for r in rows}
    # the main table's Orthros column: `orthros`, else the first Orthros variant the run has
    variants = [r["variant"] for r in rows]
    ov = "orthros" if "orthros" in variants else next((v for v in variants if v.startswith("orthros")), "orthros")
    lab = "Orthros" if ov == "orthros" else ov
    layers = rows[0]["layers"] if rows else "?"
    out = [f"Command: `{result['command']}`  ",
           f"Date: {env['date']}; GPU: {env['gpu']}; torch {env['torch']}{', triton ' + env['triton'] if 'triton' in env else ''}; "
           f"{result['model']} shape ({layers} layers), random {result['dtype']} weights, KV cache {result['kv_dtype']}, "
           f"window {result['window']}, {_step_kind(result)}; "
           f"mean of {result['steps']} steps. KV cache filled with random values (no real prefill). "
           f"Roofline: bytes per step (weights + K/V read) at {result['bandwidth_tb_s']} TB/s.", "",
           f"| context | batch | {lab} tok/s | full tok/s | {lab} / full | {lab} GB/s (roofline) | full GB/s (roofline) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r):
        return "–" if r is None else (f"{r['tokens_per_s']:.1f}" if r["status"] == "ok" else r["status"])

    def bw(r):
        if r is None or r["status"] != "ok":
            return "–"
        roof = f", roofline {r['roofline_tok_s']:.1f} tok/s" if "roofline_tok_s" in r else ""
        return f"{r['gb_per_s']:.0f} ({100 * r['roofline']:.0f}%{roof})"

    for C in sorted({r["context"] for r in rows}):
        for B in sorted({r["batch"] for r in rows}):
            o, f = idx.get((ov, B, C)), idx.get(("full", B, C))
            ok = o and f and o["status"] == f["status"] == "ok"
            ratio = f"{o['tokens_per_s'] / f['tokens_per_s']:.3f}×" if ok else "–"
            out.append(f"| {_fmt_len(C)} | {B} | {cell(o)} | {cell(f)} | {ratio} | {bw(o)} | {bw(f)} |")
    moe = [r for r in rows if "experts_per_layer" in r]
    if moe:
        out += ["", "Mixture of experts: distinct experts a sparse layer read in a step (the union over the "
                "step's rows) and their bytes over all sparse layers:", "",
                "| variant | context | batch | tok/s | / full | experts a layer | expert GB a step |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(moe, key=lambda r: (r["context"], r["batch"], r["variant"])):
            f = idx.get(("full", r["batch"], r["context"]))
            ratio = (f"{r['tokens_per_s'] / f['tokens_per_s']:.3f}×"
                     if f and f["status"] == "ok" and r["variant"] != "full" else "–")
            out.append(f"| {r['variant']} | {_fmt_len(r['context'])} | {r['batch']} | {cell(r)} | {ratio} | "
                       f"{r['experts_per_layer']:.2f} | {r['expert_bytes'] / 1e9:.3f} |")
    prof = result.get("profiles") or {}
    if prof:
        first = next(iter(prof.values()))
        out += ["", f"Device time per decode step by kernel group (profiler, batch {first['batch']}, "
                f"context {_fmt_len(first['context'])}), µs:", "",
                "| kernels | " + " | ".join(prof) + " |", "| --- |" + " --- |" * len(prof)]
        names = list(dict.fromkeys(g for p in prof.values() for g in p["groups_ms"]))
        launches = "kernel launches a step (a count, not µs)"
        for g in names + [launches]:
            cells = []
            for p in prof.values():
                v = p["kernel_count"] if g == launches else p["groups_ms"].get(g, 0.0) * 1e3
                cells.append(f"{v / p['steps']:.0f}")
            out.append(f"| {g} | " + " | ".join(cells) + " |")
        for g in dict.fromkeys(g for p in prof.values() for g in p.get("gb_per_s", {})):
            cells = [f"{p['gb_per_s'][g]:.0f} ({100 * p['gb_per_s'][g] / (result['bandwidth_tb_s'] * 1e3):.0f}%)"
                     if g in p.get("gb_per_s", {}) else "–" for p in prof.values()]
            out.append(f"| {g}: achieved GB/s (of {result['bandwidth_tb_s']} TB/s) | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(result, path):
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows}) or [1]
    fig, axes = subplots(len(batches), 5.5, 4.2)
    for ax, B in zip(axes, batches):
        for v, c, mk in (("orthros", "C0", "o"), ("full", "C3", "s")):
            pts = sorted((r["context"], r["tokens_per_s"], r["bytes"]) for r in rows if r["variant"] == v and r["batch"] == B)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=c, label=f"{v} (measured)")
            roof = [B * result["bandwidth_tb_s"] * 1e12 / p[2] for p in pts]
            ax.plot([p[0] for p in pts], roof, color=c, linestyle=":", label=f"{v} bandwidth roofline")
        log_panel(ax, "context (tokens)", "decode tokens/s", f"batch {B}, {result['env']['gpu']}")
    save_figure(fig, path)


def run(args):
    def measure_checked():
        if args.kv_dtype in LOWBIT_KV_DTYPES and "full" in args.variants:
            raise ValueError(f"--kv-dtype {args.kv_dtype} is an Orthros cache (a full model's queries read every "
                             "key in bf16): add --variants orthros")
        OrthrosConfig.from_name(args.model)  # a clear error for unknown names before any work
        return measure(args)

    render(result_from(args, args.tag, measure_checked), args.out_dir, args.docs, args.tag, table, plot)
    return 0
