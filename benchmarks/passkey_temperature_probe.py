"""Is the far pass key lost to diluted output-stream attention? Sharpen it and see (CPU).

Every converted arm answers keys within ~1K tokens of the question and almost none beyond ~3K,
where the source answers all (docs/results.md). In the source the tokens after the needle read
it, so the question's rows can find the key close by; an Orthros base row only sees its window,
so the output stream must read the needle itself, across the whole prompt, against thousands of
competing keys. If that is the loss, sharper output-stream attention in the layers that do the
lookup should bring the far key back, and the sharpening that does it should grow with the
prompt's length (as log-length attention scaling assumes).

This multiplies the output stream's query scale-offset (`so_alpha_out`, `so_beta_out`: the query
of every output row, before RoPE) by s in the layers from --from-layer on, for each s of --scales,
and prints the pass key's teacher-forced NLL (and whether greedy would emit every key token) by
length and depth. s = 1 is the model as it is. Nothing in the base stream changes.

    PYTHONPATH=src .venv/bin/python benchmarks/passkey_temperature_probe.py \
        --adapter adapters/smollm2-135m-w128-s4-so-out --lengths 2048 4096 7680 --scales 1 1.15 1.3 1.5
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sink_probe  # noqa: E402
from passkey_layer_probe import key_scores  # noqa: E402

from orthros.eval.longrange import chat_passkey, eval_key, passkey_prompt  # noqa: E402
from orthros.experiments.cpt import sharpen_output_queries  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", default=None, help="an adapter trained with --sinks at --window, applied first")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.15, 1.3, 1.5])
    ap.add_argument("--from-layer", type=int, default=0, help="first layer whose output queries are scaled")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7680])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    ap.add_argument("--samples", type=int, default=2, help="keys per length and depth")
    sink_probe.model_args(ap)
    ap.add_argument("--heldout-rows", type=int, default=0,
                    help="also the perplexity of this many held-out code and prose rows (2K) at each s")
    ap.add_argument("--greedy", type=int, default=0,
                    help="also greedy answers through the chat template, this many keys a length and depth")
    ap.add_argument("--out", default="benchmarks/results/sink-probe/passkey_temperature_probe.json")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = sink_probe.with_sinks(Path(args.work), args.window, args.sinks, args.threads, args.adapter)
    rng = random.Random(11)
    cases = [(L, d, eval_key(rng)) for L in args.lengths for d in args.depths for _ in range(args.samples)]
    prompts = [passkey_prompt(tok, L, d, k) for L, d, k in cases]
    rows = sink_probe.heldout_rows(tok, Path(args.work), args.heldout_rows, 2048, 8192) if args.heldout_rows else {}
    params = dict(model.named_parameters())
    loaded = {n: p.detach().clone() for n, p in params.items() if n.endswith(("so_alpha_out", "so_beta_out"))}
    results = {}
    for s in args.scales:  # each s from the loaded values: the layers from --from-layer on, times s
        with torch.no_grad():
            for n, v in loaded.items():
                params[n].copy_(v)
        sharpen_output_queries(model, args.from_layer / model.config.num_hidden_layers, s)
        t1 = time.time()
        cells = {}
        for (L, d, k), p in zip(cases, prompts):
            nll, hit = key_scores(model, tok, p, k)
            c = cells.setdefault(f"{L}@{d}", {"nll": [], "hit": []})
            c["nll"].append(nll)
            c["hit"].append(hit)
        r = results[str(s)] = {c: {"nll": sum(v["nll"]) / len(v["nll"]), "hit": sum(v["hit"]) / len(v["hit"])}
                               for c, v in cells.items()}
        line = "  ".join(f"{c} {v['nll']:.2f}/{v['hit']:.0%}" for c, v in r.items())
        if rows:
            r["ppl"] = {d: math.exp(torch.stack([sink_probe.row_losses(model, x) for x in xs]).mean().item())
                        for d, xs in rows.items()}
            line += "  ppl " + " ".join(f"{d} {v:.3f}" for d, v in r["ppl"].items())
        if args.greedy:
            g = chat_passkey(model, tok, args.lengths, args.depths, samples=args.greedy, seed=5)
            r["greedy"] = {k: g[k] for k in ("by_length", "by_cell", "examples") if k in g}
            line += "  greedy " + " ".join(f"{L} {v:.0%}" for L, v in g["by_length"].items())
        print(f"s={s:<5}: {line}  ({time.time() - t1:.0f}s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results,
                                              "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
