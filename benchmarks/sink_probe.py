"""Does an attention sink recover the zero-shot Orthros gap? A CPU measurement.

SmolLM2-135M-Instruct converted to Orthros at W=128 without training has about twice the
source's perplexity on held-out code at 2K tokens. Hypothesis: most of that is the missing
attention sink (StreamingLLM: the first tokens soak up attention mass; a window that cannot
see them redistributes it). This script measures, zero-shot, on held-out code and prose:

    source          the source model (attention="full")
    orthros         Orthros W (every position an output position), as the library computes it
    orthros+sinkS   the same, the base stream's window also seeing the first S slots
    swa / swa+sinkS sliding window only (no output stream), without / with S sink slots

The sink variant is the library's (`OrthrosConfig.sink_tokens`, set on the loaded model; until
2026-12-04 afternoon this script patched the reference op's mask instead, with the same mask on
these unpadded one-document rows). Every attention layer runs the reference op (`backend="naive"`).
Full-attention calls (the source, Orthros's output stream) are untouched by sinks. Checks before
measuring: the reference op with sinks against an explicit mask on random tensors; the reference op
against the library's default CPU backend with sinks; with W >= T (and S=4) Orthros gives the
source model's logits (SPEC invariant 2).

    PYTHONPATH=src .venv/bin/python benchmarks/sink_probe.py            # ~6+6 rows of 2,048 tokens
    PYTHONPATH=src .venv/bin/python benchmarks/sink_probe.py --rows 1 --seq-len 256   # smoke

Held-out rows: `cpt_data.heldout_sets` at --source-len tokens (default 8,192, as the CPT
runs), each row cut to its first --seq-len tokens: the first rows of the "2K" columns of
benchmarks/results/cpt-smollm2/table.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from orthros.convert.download import smollm2_gguf
from orthros.experiments.cpt import load_arm
from orthros.experiments.cpt_data import heldout_sets
from orthros.layers.attention import OrthrosAttention
from orthros.ops import naive_attention

BUCKETS = ((0, 128), (128, 512), (512, 1024), (1024, 2048))

# ------------------------------------------------------------------ the sinks
def set_sinks(model, sinks: int):
    """The library's attention sinks (`OrthrosConfig.sink_tokens`) switched on a loaded model: every
    layer's windows also see each document's first `sinks` tokens (0: none)."""
    model.config.sink_tokens = sinks
    for mod in model.modules():
        if isinstance(mod, OrthrosAttention):
            mod.sinks = sinks


def set_backend(model, backend: str):
    n = 0
    for mod in model.modules():
        if isinstance(mod, OrthrosAttention):
            mod.backend = backend
            n += 1
    assert n == model.config.num_hidden_layers, n


def converted(work: Path, window: int):
    """(the Orthros directory of SmolLM2 converted at `window` under `work`, made once; its tokenizer)."""
    from orthros.convert.hf import convert_checkpoint
    from orthros.data.tokenizer import load_tokenizer

    conv = work / "orthros"
    if not (conv / "config.json").exists():
        convert_checkpoint(smollm2_gguf(), conv, window_size=window, dtype="fp32", progress=False)
    return conv, load_tokenizer(conv)


def zero_shot(work: Path, window: int, threads: int):
    """(SmolLM2 converted to Orthros at `window`, untrained, in eval mode on the CPU; its tokenizer),
    torch using `threads` threads."""
    torch.set_num_threads(threads)
    conv, tok = converted(work, window)
    return load_arm(conv, "orthros-0shot", window, "cpu").eval(), tok


def model_args(ap, threads: int = 2) -> None:
    """The options every probe of the converted model takes: its window, its sinks, the CPU threads,
    and the work directory the conversion and the token caches live in."""
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--work", default="/tmp/sink")


def with_sinks(work: Path, window: int, sinks: int, threads: int, adapter: str | None = None):
    """`zero_shot` with `sinks` attention sinks, and a light-CPT adapter applied if given (one trained
    with those sinks at that window; another is refused)."""
    model, tok = zero_shot(work, window, threads)
    set_sinks(model, sinks)
    if adapter:
        from orthros.models.adapter import apply_adapter

        apply_adapter(model, adapter)  # (one trained at another window or sink count is refused)
    return model, tok


def heldout_rows(tok, work: Path, rows: int, seq_len: int, source_len: int) -> dict[str, torch.Tensor]:
    """The first `rows` held-out code and prose rows, cut to `seq_len` tokens."""
    held = heldout_sets(tok, source_len, rows, work / "cache")
    return {d: torch.from_numpy(held[d][:rows, :seq_len].astype(np.int64)) for d in ("code", "prose")}


# ------------------------------------------------------------------ measuring
@torch.no_grad()
def logits_of(model, row: torch.Tensor) -> torch.Tensor:
    """row [T] -> logits [T-1, V] (every position an output position: `eval.longrange.token_losses`)."""
    return model(row[None, :-1], use_cache=False).logits[0].float()


def row_losses(model, row: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(model, row), row[1:], reduction="none")


def summary(losses: torch.Tensor) -> dict:
    """losses [N, T-1] (index i: token i+1 predicted from tokens <= i)."""
    nll = losses.mean().item()
    by = {}
    for a, b in BUCKETS:
        if a < losses.shape[1]:
            by[f"{a}-{b}"] = losses[:, a:b].mean().item()
    return {"ppl": math.exp(nll), "nll": nll, "rows": losses.shape[0], "tokens": losses.numel(), "loss_by_pos": by,
            "row_ppl": [math.exp(x) for x in losses.mean(1).tolist()]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=6, help="rows per domain")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--source-len", type=int, default=8192, help="heldout_sets row length the rows are cut from")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--no-swa", action="store_true", help="skip the SWA-only variants")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="/tmp/sink")
    ap.add_argument("--out", default="/tmp/sink/sink_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    conv, tok = converted(work, args.window)
    data = heldout_rows(tok, work, args.rows, args.seq_len, args.source_len)
    print(f"data: {({d: tuple(v.shape) for d, v in data.items()})}  ({time.time() - t0:.0f}s)", flush=True)

    W = args.window
    source = load_arm(conv, "source", W, "cpu").eval()
    orth = load_arm(conv, "orthros-0shot", W, "cpu").eval()
    swa = None if args.no_swa else load_arm(conv, "swa-cpt", W, "cpu").eval()  # untrained: only its attention
    assert source.config.attention == "full" and orth.config.attention == "orthros"
    assert orth.config.window_size == W

    checks = {}
    # (0) the reference op's sinks against an explicit mask, random tensors
    g = torch.Generator().manual_seed(0)
    T_, H_, D_ = 40, 4, 8
    q, k, v = (torch.randn(1, T_, H_, D_, generator=g, dtype=torch.float64) for _ in range(3))
    slot = torch.arange(T_)[None]
    doc = torch.zeros(1, T_, dtype=torch.long)
    for S in (0, 1, 3):
        got = naive_attention(q, k, v, slot, doc, doc, window=5, sinks=S)
        i, j = torch.arange(T_)[:, None], torch.arange(T_)[None]
        mask = (j <= i) & ((i - j < 5) | (j < S))
        s = torch.einsum("bihd,bjhd->bhij", q, k) * D_ ** -0.5
        ref = torch.einsum("bhij,bjhd->bihd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        checks[f"mask_S{S}_maxdiff"] = (got - ref).abs().max().item()
    print("mask check:", {k_: f"{v_:.1e}" for k_, v_ in checks.items()}, flush=True)

    row = data["code"][0]
    # (1) the reference op vs the library's default CPU backend, with 4 sinks: rounding only
    set_sinks(orth, 4)
    set_backend(orth, "auto")
    auto = logits_of(orth, row)
    set_backend(orth, "naive")
    got4 = logits_of(orth, row)
    checks["S4_naive_vs_auto_backend_maxabs"] = (got4 - auto).abs().max().item()
    checks["S4_naive_vs_auto_backend_ppl"] = [math.exp(F.cross_entropy(x, row[1:]).item()) for x in (got4, auto)]
    set_sinks(orth, 0)
    # (2) W >= T with S=4: Orthros == the source (invariant 2)
    big = load_arm(conv, "orthros-0shot", max(4096, args.seq_len), "cpu").eval()
    set_backend(big, "naive")
    set_backend(source, "naive")
    src_logits = logits_of(source, row)
    for S in (4, 0):
        set_sinks(big, S)
        checks[f"W>=T_S{S}_vs_source_maxabs"] = (logits_of(big, row) - src_logits).abs().max().item()
    del big
    print("checks:", json.dumps(checks), f"({time.time() - t0:.0f}s)", flush=True)

    variants = [("source", source, 0), ("orthros", orth, 0)] + [(f"orthros+sink{S}", orth, S) for S in args.sinks]
    if swa is not None:
        set_backend(swa, "naive")
        variants += [("swa", swa, 0)] + [(f"swa+sink{S}", swa, S) for S in args.sinks]
    results = {}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save(extra: dict | None = None):  # after every variant: a stopped run keeps what it measured
        out = {"args": vars(args), "gguf": str(smollm2_gguf()), "window": W, "checks": checks, "results": results,
               "note": "gap closed = (nll_orthros - nll_variant) / (nll_orthros - nll_source), in nats per token",
               "seconds": time.time() - t0, **(extra or {})}
        out_path.write_text(json.dumps(out, indent=2))

    for name, model, S in variants:
        set_sinks(model, S)
        results[name] = {"sinks": S}
        for dom, rows in data.items():
            t1 = time.time()
            losses = torch.stack([row_losses(model, r) for r in rows])
            results[name][dom] = summary(losses)
            print(f"{name:14s} {dom:5s} ppl {results[name][dom]['ppl']:7.3f}  "
                  f"{json.dumps({k_: round(v_, 3) for k_, v_ in results[name][dom]['loss_by_pos'].items()})}"
                  f"  ({time.time() - t1:.0f}s)", flush=True)
        save()
        set_sinks(model, 0)

    # the table
    buckets = list(results["source"]["code"]["loss_by_pos"])
    lines = ["| variant | code ppl | prose ppl | gap closed (code) | gap closed (prose) | "
             + " | ".join(f"code loss {b}" for b in buckets) + " | " + " | ".join(f"prose loss {b}" for b in buckets)
             + " |", "|" + "---|" * (5 + 2 * len(buckets))]
    for name, r in results.items():
        closed = []
        for dom in ("code", "prose"):
            gap = results["orthros"][dom]["nll"] - results["source"][dom]["nll"]
            closed.append(f"{(results['orthros'][dom]['nll'] - r[dom]['nll']) / gap:.0%}"
                          if name.startswith("orthros") and gap > 0 else "-")
        lines.append(f"| {name} | {r['code']['ppl']:.3f} | {r['prose']['ppl']:.3f} | {closed[0]} | {closed[1]} | "
                     + " | ".join(f"{r['code']['loss_by_pos'][b]:.3f}" for b in buckets) + " | "
                     + " | ".join(f"{r['prose']['loss_by_pos'][b]:.3f}" for b in buckets) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    save({"table": table})
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
