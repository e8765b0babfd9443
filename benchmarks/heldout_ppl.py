"""Held-out perplexity of the source model, its conversion and shipped adapters, by domain, with the
CPT experiment's rows and protocol (`experiments.cpt_data.heldout_sets`, `eval.longrange`).

    python benchmarks/heldout_ppl.py --domains novel --rows 4 \
        --adapters none adapters/smollm2-135m-w128-s4-lora-mix adapters/smollm2-135m-w512-s4-lora-mix

The `novel` domain is English about no software, which no training row holds: how much of the
source's quality a conversion keeps away from the Python text it was trained on. Prints a table
and writes <out>/<tag>.json / .md. CPU-sized: a few rows of each length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapters", nargs="+", default=["none"],
                   help="adapter directories, or none (the conversion at --window with no adapter)")
    p.add_argument("--window", type=int, default=512, help="the window of the conversion scored with no adapter")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--domains", nargs="+", default=["novel"])
    p.add_argument("--rows", type=int, default=4, help="rows of each length per domain")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/heldout-ppl")
    p.add_argument("--tag", default="novel")
    p.add_argument("--cache", default="runs/heldout-cache", help="the tokenized held-out rows, kept between runs")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros.demo import real
    from orthros.eval.longrange import loss_summary, token_losses
    from orthros.experiments.cpt_data import DOMAINS, heldout_sets
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    bad = set(a.domains) - set(DOMAINS)
    if bad:
        raise SystemExit(f"--domains: {', '.join(sorted(bad))} unknown; choose from {', '.join(DOMAINS)}")
    torch.set_grad_enabled(False)
    hf = real.source_dir(a.model_dir)
    tok = AutoTokenizer.from_pretrained(str(hf))
    L = max(a.lengths)
    held = heldout_sets(tok, L, a.rows, Path(a.cache))
    data = {d: torch.from_numpy(held[d][: a.rows].astype(np.int64)) for d in a.domains}

    def score(model, name: str) -> dict:
        from tqdm import tqdm

        out = {}
        with tqdm(total=sum(len(r) for r in data.values()) * len(a.lengths), desc=name, unit="row") as bar:
            for d, rows in data.items():
                for n in a.lengths:
                    s = loss_summary(token_losses(model, rows[:, :n], a.batch, progress=bar))
                    out[f"{d} {n}"] = s["ppl"]
        return out

    models = [("source", lambda: AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32))]
    for ad in a.adapters:  # each conversion made (once) when its turn comes
        def converted(ad=ad):
            m = load_model(real.conversion_for(a.model_dir, ad, a.sink_tokens, a.window if ad == "none" else 128))
            if ad != "none":
                apply_adapter(m, ad)
            return m
        models.append((f"conversion W={a.window}, no adapter" if ad == "none" else ad, converted))
    rows = {}
    for name, make in models:
        t = time.time()
        rows[name] = score(make().eval(), name)
        print(name, {k: round(v, 3) for k, v in rows[name].items()}, f"({time.time() - t:.0f} s)", flush=True)
    cols = [f"{d} {n}" for d in a.domains for n in a.lengths]
    src = rows["source"]
    lines = [f"Perplexity on {a.rows} held-out rows per length ({', '.join(a.domains)}); in brackets, against "
             "the source.", "", "| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        cells = [f"{r[c]:.3f}" + ("" if name == "source" else f" ({100 * (r[c] / src[c] - 1):+.1f}%)") for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                   "device": "cpu", "torch": torch.__version__,
                                                   "rows_per_length": a.rows, "domains": a.domains,
                                                   "lengths": a.lengths, "ppl": rows}, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
