"""Does a model find a fact by its whole name? Compound lookups in the demo's document, on this CPU.

    python benchmarks/compound_probe.py --adapters none adapters/smollm2-135m-w128-s4-lora-mix \
        --samples 20 --chars 8000 --out benchmarks/results/compound-probe

Each sample writes the facts of a grid of adjectives by places ("The golden tower is described in
report 48213.", beside "the golden mill" and "the upper tower": `data.retrieval`'s compound kind,
with evaluation keys, which no training sample holds) at random line starts of the first --chars
characters of `orthros demo`'s document, asks for one of them through the chat template, and scores
every fact's number after the answer's first words ("The golden tower is described in report "),
teacher-forced. Right: the asked fact's number is the most likely. Also counted: a wrong pick that
shares the asked fact's adjective or its place (found by one word of the name), and a pick of the
fact written last in the text (found by position). The demo's PEP question is one such lookup: its
PEP named by its title among other PEPs. Writes <tag>.json and <tag>.md under --out.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch


def make_sample(doc: str, seed: int):
    """(text with the facts, the asked name, [(name, number)] in text order)."""
    from orthros.data.retrieval import _insert, compound_facts, eval_key

    rng = np.random.default_rng(seed)
    keys = random.Random(seed)
    facts, pieces = compound_facts(rng, lambda: eval_key(keys))
    text = _insert(doc, [p + "\n" for p in pieces], rng)  # in order: facts[-1] is written last
    asked = facts[int(rng.integers(0, len(facts)))][0]
    return text, asked, facts


def score(model, tok, text: str, asked: str, facts) -> dict:
    """Log-probability of each fact's number after the answer's first words (one batch)."""
    from orthros.demo import real

    ids = real.prompt_ids(tok, text, f"Which report is about the {asked}?")
    pre = tok.encode(f"The {asked} is described in report ", add_special_tokens=False)
    conts = [tok.encode(v, add_special_tokens=False) for _, v in facts]
    L = max(len(c) for c in conts)
    n = len(ids) + len(pre)
    batch = torch.tensor([ids + pre + c + [tok.eos_token_id] * (L - len(c)) for c in conts])
    keep = torch.arange(n - 1, n - 1 + L)  # the numbers' positions only: the prompt is read, not scored
    lp = model(batch, logits_to_keep=keep).logits.float().log_softmax(-1)
    return {v: sum(lp[i, k, t].item() for k, t in enumerate(c))
            for i, ((_, v), c) in enumerate(zip(facts, conts))}


def judge(asked: str, facts, scores: dict) -> dict:
    value = dict(facts)
    best = max(scores, key=scores.get)
    pick = next(t for t, v in facts if v == best)
    a, p = asked.split()
    return {"right": best == value[asked], "one_word": best != value[asked] and (pick.startswith(a + " ")
            or pick.endswith(" " + p)), "last": best == facts[-1][1], "margin": scores[value[asked]] - max(
            s for v, s in scores.items() if v != value[asked])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="runs/smollm2", help="the source model (orthros download)")
    p.add_argument("--adapters", nargs="+", default=["none"], help="adapter directories, or none")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--chars", type=int, default=8000, help="characters of the demo's document (the haystack)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/compound-probe")
    p.add_argument("--tag", default="probe", help="output files <tag>.json / <tag>.md")
    a = p.parse_args(argv)
    if a.samples < 1 or a.chars < 200:
        p.error("--samples must be >= 1 and --chars >= 200")

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros.demo import real
    from orthros.loading import load_model
    from orthros.models.adapter import apply_adapter

    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    hf, _ = real.source_and_conversion(a.model_dir, 128, a.sink_tokens)
    tok = AutoTokenizer.from_pretrained(str(hf))
    doc = real.document(a.chars)
    samples = [make_sample(doc, 1000 + s) for s in range(a.samples)]
    tokens = [len(real.prompt_ids(tok, t, f"Which report is about the {q}?")) for t, q, _ in samples]

    def run(name, model) -> dict:
        js = [judge(q, f, score(model, tok, t, q, f)) for t, q, f in tqdm(samples, desc=name, leave=False)]
        return {"right": sum(j["right"] for j in js), "one_word": sum(j["one_word"] for j in js),
                "last": sum(j["last"] for j in js), "mean_margin": float(np.mean([j["margin"] for j in js])),
                "samples": js}

    rows = {"source": run("source", AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval())}
    for ad in a.adapters:  # an adapter is scored at the window it was trained at; none at 128
        m = load_model(real.conversion_for(a.model_dir, ad, a.sink_tokens)).eval()
        if ad != "none":
            apply_adapter(m, ad)
        name = "conversion, no adapter" if ad == "none" else ad
        rows[name] = run(name, m)
    chance = float(np.mean([1 / len(f) for _, _, f in samples]))
    lines = [f"{a.samples} compound lookups in the first {a.chars:,} characters of `orthros demo`'s document "
             f"({min(tokens):,}–{max(tokens):,} tokens), 4–9 facts each (chance {chance:.0%}); the number scored "
             "after \"The <name> is described in report \", teacher-forced.", "",
             "| model | right | wrong, one word of the name shared | the fact written last | mean margin (nats) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['right']} / {a.samples} | {r['one_word']} | {r['last']} "
                     f"| {r['mean_margin']:+.2f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"samples": a.samples, "chars": a.chars, "tokens": [min(tokens), max(tokens)], "chance": chance,
           "rows": rows}
    (out / f"{a.tag}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
