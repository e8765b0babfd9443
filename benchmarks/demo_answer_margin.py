"""How sure each model is of the right answer to the demo's question, against a wrong one that the
document also states: the log-probability of each candidate after the answer's first words.

    python benchmarks/demo_answer_margin.py \
        --adapters none adapters/smollm2-135m-w128-s4-lora-mix --out benchmarks/results/demo-margin

The prompt is `orthros demo`'s (its document and question through the chat template), followed by
--prefix ("The PEP "); each --candidates continuation is scored teacher-forced, summed over its
tokens. The source model is transformers' Llama; each converted model is the demo's conversion
(window 128, 4 sinks) with an adapter or none; --windows scores the conversion with no adapter at other
windows too (an adapter is scored at the window it was trained at), and --rewindow each adapted model
run at other base windows (for one forward over the prompt this equals converting at that window: the
same margins, measured). A model that prefers the wrong candidate by a wide margin reads the document
confidently and wrongly; one that finds neither likely does not read it.
Writes <tag>.json and <tag>.md under --out (tag: margin).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapters", nargs="+", default=["none"], help="adapter directories, or none")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--windows", nargs="+", type=int, default=[128],
                   help="windows of the conversion scored with no adapter (an adapter keeps its own)")
    p.add_argument("--rewindow", nargs="*", type=int, default=[],
                   help="also score each adapted model with its base window set to each of these (off the window it "
                        "was trained at: how much of its answer the window decides)")
    p.add_argument("--question", default=None, help="default: the demo's")
    p.add_argument("--prefix", default="The PEP ")
    p.add_argument("--candidates", nargs="+", default=["343", "634"], help="the right one first")
    p.add_argument("--out", default="benchmarks/results/demo-margin")
    p.add_argument("--tag", default="margin", help="output files <tag>.json / <tag>.md")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros.demo import real
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    torch.set_grad_enabled(False)
    hf, _ = real.source_and_conversion(a.model_dir, 128, a.sink_tokens)
    tok = AutoTokenizer.from_pretrained(str(hf))
    doc = real.document()
    question = a.question or real.QUESTION
    ids = real.prompt_ids(tok, doc, question)
    where = {c: len(tok.encode(doc[doc.find(c):], add_special_tokens=False)) if c in doc else None
             for c in a.candidates}  # tokens from the candidate's first mention to the document's end

    def score(model) -> dict:
        return real.margin(model, tok, question=question, prefix=a.prefix, candidates=a.candidates)["logprob"]

    rows = {"source": score(AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval())}
    print("source", rows["source"], flush=True)
    models = []  # (row name, conversion directory, adapter or None)
    for ad in a.adapters:
        if ad == "none":
            models += [("conversion, no adapter" if w == 128 else f"conversion W={w}, no adapter",
                        real.source_and_conversion(a.model_dir, w, a.sink_tokens)[1], None) for w in a.windows]
        else:
            models.append((ad, real.conversion_for(a.model_dir, ad, a.sink_tokens), ad))
    for name, cdir, ad in models:
        m = load_model(cdir).eval()
        if ad is not None:
            apply_adapter(m, ad)
        rows[name] = score(m)
        print(name, rows[name], flush=True)
        for w in a.rewindow if ad is not None else ():
            for layer in m.model.layers:
                layer.self_attn.base_window = w
            rows[f"{name}, run at W={w}"] = score(m)
            print(name, w, rows[f"{name}, run at W={w}"], flush=True)
    right, wrong = a.candidates[0], a.candidates[1]
    lines = [f"Prompt: `orthros demo`'s document ({len(ids):,} tokens) and the question \"{question}\", then "
             f"\"{a.prefix}\"; "
             f"log-probability of each continuation (nats). First mention, tokens before the document's end: "
             + ", ".join(f"{c}: {where[c]}" for c in a.candidates) + ".", "",
             "| model | " + " | ".join(f"log p({c})" for c in a.candidates) + f" | {right} − {wrong} |",
             "|---|" + "---:|" * (len(a.candidates) + 1)]
    for name, r in rows.items():
        cells = " | ".join(f"{r[c]:.2f}" for c in a.candidates)
        lines.append(f"| {name} | {cells} | {r[right] - r[wrong]:+.2f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"question": question, "prefix": a.prefix, "candidates": a.candidates, "mentions": where,
           "prompt_tokens": len(ids), "rows": rows}
    (out / f"{a.tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
