"""Does training on pass keys in many wordings give back what a long CPT run took? On this CPU: an adapted
model trained a few steps further on retrieval rows whose pass keys are written and asked in many wordings
(`data.retrieval.varied_passkey`, never the demo probe's words), with a new LoRA + SO on top of its own,
then read with the demo's fact in each wording (`fact_phrasing_probe.py`) and the demo's margin.

    python benchmarks/varied_repair_probe.py --adapter <52.4M light twin> --steps 40 \
        --out benchmarks/results/fact-phrasing --tag repair

The rows are `orthros experiment cpt`'s (2,048 tokens here: one retrieval sample of 1-1.9K tokens, then
training text), the loss is the recipe's (answers x32), the schedule the CPT arms' (warm-up, cosine).
Writes <tag>.json / <tag>.md: the probes before and after, and the training curve. `--fixed` is the
control: the same schedule on rows whose pass keys are the three fixed needles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fact_phrasing_probe import PHRASINGS, read_facts  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapter", required=True, help="the adapter to start from (its window and sinks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=None, help="LoRA / SO peak rate (default: the recipe's)")
    p.add_argument("--phrasings", nargs="+", default=["demo", "trained"], choices=list(PHRASINGS))
    p.add_argument("--fixed", action="store_true",
                   help="the control: the same rows with the three fixed needles instead of many wordings")
    p.add_argument("--out", default="benchmarks/results/fact-phrasing")
    p.add_argument("--tag", default="repair")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from orthros.data.retrieval import retrieval_rows
    from orthros.demo import real
    from orthros.experiments.cpt_train import train_arm
    from orthros.experiments.cpt_arms import PRESETS
    from orthros.experiments.cpt_data import train_stream
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    hf = real.source_dir(a.model_dir)
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = load_model(real.conversion_for(a.model_dir, a.adapter, 4)).float().eval()
    apply_adapter(model, a.adapter)

    def probes() -> dict:
        with torch.no_grad():
            return {"phrasings": read_facts(model, tok, a.phrasings), "margin": real.margin(model, tok)["margin"]}

    before = probes()
    print("before", json.dumps({k: v["right"] for k, v in before["phrasings"].items()}), before["margin"], flush=True)
    preset = dataclasses.replace(PRESETS["smollm2-w512-52m"], seq_len=a.seq_len, batch_size=1, steps=a.steps,
                                 warmup=max(1, a.steps // 10), checkpoint_every=0, answer_weight=32.0,
                                 **({"light_lr": a.lr, "lora_lr": a.lr} if a.lr else {}))
    stream = train_stream(tok, 4 * a.steps * a.seq_len, Path("runs/heldout-cache"))
    rows, mask = retrieval_rows(tok, stream, a.steps, a.seq_len, np.random.default_rng(4321),
                                (1024, a.seq_len - 128), questions=8, phrase=True, varied=not a.fixed)
    t0 = time.time()
    model, stats = train_arm(model, "lora+so", preset, rows, "cpu", "varied", mask=mask)
    after = probes()
    print("after", json.dumps({k: v["right"] for k, v in after["phrasings"].items()}), after["margin"], flush=True)
    res = {"adapter": a.adapter, "varied": not a.fixed, "steps": a.steps, "seq_len": a.seq_len,
           "seconds": time.time() - t0,
           "loss_curve": stats.get("loss_curve"), "before": before, "after": after}
    n = len(before["phrasings"][a.phrasings[0]]["answers"])
    rows_are = "the three fixed needles (the control)" if a.fixed else "many wordings"
    lines = [f"{a.adapter} trained {a.steps} more steps (1 row of {a.seq_len} tokens each) on retrieval rows with "
             f"pass keys in {rows_are} (LoRA + SO on top). Cells: greedy answers holding the code / "
             f"{n}; mean log p(code | the answer's first words), nats; the demo's 343 − 634 margin.", "",
             "| | " + " | ".join(a.phrasings) + " | demo margin |", "|---|" + "---|" * (len(a.phrasings) + 1)]
    for name, r in (("before", before), ("after", after)):
        ph = r["phrasings"]
        lines.append(f"| {name} | " + " | ".join(f"{ph[k]['right']} / {n}; {sum(ph[k]['logprob']) / n:.2f}"
                                                 for k in a.phrasings) + f" | {r['margin']:+.2f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
